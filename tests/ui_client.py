"""What the ComfyUI frontend is told about each node: a websocket client for the test server.

ComfyUI sends a node's progress text (the text the frontend draws on the node) as a binary websocket
message to the client that queued the prompt: a big-endian u32 event type (3 = text), a u32 length,
the node id, then the UTF-8 text. This client records them per node, in order, on a thread.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections import defaultdict

import aiohttp

TEXT_EVENT = 3


class NodeTexts:
    """Collects the progress texts sent to ``server.client_id`` while the ``with`` block runs."""

    def __init__(self, server):
        self.url = f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}"
        self._texts: dict[str, list[str]] = defaultdict(list)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)
        self._error: BaseException | None = None

    def start(self) -> NodeTexts:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError(f"could not connect to {self.url}: {self._error}")
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)

    def __enter__(self) -> NodeTexts:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def of(self, node_id: str) -> list[str]:
        """The texts node ``node_id`` was given so far, oldest first."""
        with self._lock:
            return list(self._texts[str(node_id)])

    async def _listen(self) -> None:
        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(self.url, max_msg_size=0) as ws:
                self._ready.set()
                while not self._stopping.is_set():
                    try:
                        msg = await ws.receive(timeout=0.2)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        self._record(msg.data)
                    elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        break
        except BaseException as exc:  # reported by __enter__ when it never connected
            self._error = exc

    def _record(self, data: bytes) -> None:
        if len(data) < 8 or struct.unpack(">I", data[:4])[0] != TEXT_EVENT:
            return
        (length,) = struct.unpack(">I", data[4:8])
        node_id = data[8:8 + length].decode("utf-8")
        text = data[8 + length:].decode("utf-8")
        with self._lock:
            self._texts[node_id].append(text)
