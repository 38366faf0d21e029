"""The event stream from the training process back to the node: append-only JSON lines.

One writer per process appends whole lines; the reader remembers its byte offset and only returns
complete lines, so a line being written while it reads is picked up on the next poll.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
STOP_FILE = "STOP"


def events_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / EVENTS_FILE


def stop_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STOP_FILE


class EventWriter:
    """Appends events; each event is one line written with a single ``write`` call."""

    def __init__(self, run_dir: str | Path, source: str):
        self._path = events_path(run_dir)
        self._source = source

    def emit(self, kind: str, **fields: Any) -> None:
        record = {"type": kind, "time": time.time(), "source": self._source, **fields}
        line = json.dumps(record, default=str) + "\n"
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode("utf-8"))
        finally:
            os.close(fd)


class EventReader:
    """Reads new complete events since the last call."""

    def __init__(self, run_dir: str | Path):
        self._path = events_path(run_dir)
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        out = []
        for raw in data[: end + 1].splitlines():
            if raw.strip():
                out.append(json.loads(raw))
        return out


def read_all(run_dir: str | Path) -> list[dict[str, Any]]:
    return EventReader(run_dir).poll()
