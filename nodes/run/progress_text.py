"""Text drawn on a node while it runs: ComfyUI's progress text (``PromptServer.send_progress_text``).

It is the one text display every ComfyUI frontend draws on any node (a ``text`` UI output is drawn only
by a few stock nodes such as 'Preview Any'), and it stays on the node after the run ends, fails or is
cancelled, so the last text sent is what the user reads. An empty text is ignored by the frontend: to
replace an old text, send a new one.
"""

from __future__ import annotations


def show_text(text: str, node_id: str | None) -> None:
    """Show ``text`` on node ``node_id`` for the client that queued the prompt (no-op outside the server)."""
    if node_id is None or not text:
        return
    try:
        from server import PromptServer

        server = PromptServer.instance
        server.send_progress_text(text, node_id, getattr(server, "client_id", None))
    except (ImportError, AttributeError):  # not running inside the ComfyUI server
        pass
