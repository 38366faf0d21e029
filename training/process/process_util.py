"""Process liveness, shared by the supervisor, the ranks, the cache claims and temp-file cleanup."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True if a process with this pid exists (or exists but belongs to someone else)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
