"""The warm supervisor: pre-started before the next run, it starts a warm rank, waits for the node's spec
path and then supervises that run with the warm rank as rank 0 (training/process/warm_rank.py)."""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

from .process_util import process_alive
from .warm_rank import WarmRank, redirect_output


def wait_for_spec(parent_pid: int, poll_s: float = 0.5) -> str | None:
    """The spec path the node writes to stdin; None when stdin closes empty or the parent is gone."""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], poll_s)
        if ready:
            line = sys.stdin.readline()
            return line.strip() or None
        if parent_pid and not process_alive(parent_pid):
            return None


def warm_supervise(entry: str, device: str, parent_pid: int, log_dir: str) -> int:
    """Start a warm rank, wait for a spec, then supervise that run with the warm rank as rank 0."""
    from .rank import cpu_rank_environment
    from .supervisor import supervise

    folder = Path(log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if device == "cpu":
        env.update(cpu_rank_environment())
    rank = WarmRank.spawn(entry, env, folder / f"warm-rank-{os.getpid()}.log")
    started = time.monotonic()
    spec_path = wait_for_spec(parent_pid)
    if spec_path is None:
        rank.discard()
        return 0
    redirect_output(str(Path(spec_path).parent / "logs" / "supervisor.log"))
    print(f"[pipetrainer] warm supervisor: rank 0 was started {time.monotonic() - started:.1f} s before the run",
          flush=True)
    return supervise(spec_path, entry, warm_rank=rank)
