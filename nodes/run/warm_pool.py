"""One pre-started training process tree per ComfyUI process, for the next Train LoRA run.

After a run, the node starts a warm supervisor (training/process/warm_rank.py) in its own session: it and its warm
rank import torch, DeepSpeed and PEFT while the user looks at the result, so the next run starts in
seconds. A warm tree is taken by exactly one run and never reused; one that no longer fits (another
device or ComfyUI tree) or has died is discarded and the run starts cold. ``PIPETRAINER_WARM=0`` in
ComfyUI's environment turns it off (every run then starts cold).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "training" / "process" / "entry.py"


@dataclass(frozen=True)
class WarmKey:
    """What a warm tree was started for; a run with another key starts cold."""

    device: str
    comfyui_path: str


@dataclass
class _Warm:
    key: WarmKey
    proc: subprocess.Popen


class WarmPool:
    """Holds at most one warm supervisor; ``take`` hands it to a run, ``refill`` starts the next."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.environ.get("PIPETRAINER_WARM", "1") != "0" if enabled is None else enabled
        self._warm: _Warm | None = None

    def take(self, key: WarmKey) -> subprocess.Popen | None:
        """The warm supervisor for a run with ``key`` (removed from the pool), or None to start cold."""
        warm, self._warm = self._warm, None
        if warm is None:
            return None
        if warm.key != key or warm.proc.poll() is not None:
            _end(warm.proc)
            return None
        return warm.proc

    def refill(self, key: WarmKey, log_dir: str | Path) -> None:
        """Start a warm supervisor for the next run (replacing any other)."""
        if not self.enabled:
            return
        self.close()
        folder = Path(log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "warm-supervisor.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, str(ENTRY), "warm", key.device, str(os.getpid()), str(folder)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(folder), start_new_session=True)
        self._warm = _Warm(key, proc)

    def close(self) -> None:
        """End the warm tree, if any (its rank dies with it)."""
        warm, self._warm = self._warm, None
        if warm is not None:
            _end(warm.proc)


def hand_over(proc: subprocess.Popen, spec_path: str | Path) -> None:
    """Give a warm supervisor its run: the spec path on its stdin, then end of input."""
    proc.stdin.write(f"{spec_path}\n".encode())
    proc.stdin.close()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
