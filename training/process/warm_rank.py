"""Pre-started training processes: the next run's supervisor and rank 0, with their imports done.

Most of the time from Queue to the first step of a small run is a fresh Python importing torch,
DeepSpeed and PEFT (transformers) in each rank. The node therefore keeps one *warm* supervisor ready
(nodes/run/warm_pool.py): started in its own session like any supervisor, it starts a warm rank that
imports those packages and then waits. When a run starts, the node writes the spec path to the warm
supervisor's stdin; it then supervises exactly like a cold one, except that rank 0 is the warm rank,
told its environment, log file and spec on its stdin. Ranks 1.. start cold.

Crash isolation is unchanged: a warm pair serves one run and is never reused (the node starts a fresh
one after each run); it is a child tree of its own session; the warm rank dies with its supervisor
(PR_SET_PDEATHSIG) and the supervisor leaves when the ComfyUI process does. ComfyUI itself is not
imported ahead: its launch settings (attention, precision flags) are applied per run before
``comfy.model_management`` is imported, so a warm rank computes exactly like a cold one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Environment read while the warm rank imports (DeepSpeed's accelerator, the visible GPUs, threads):
# a run whose rank 0 needs other values there gets a cold rank 0 instead.
IMPORT_TIME_ENV = ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")
READY = "pipetrainer warm rank ready"


@dataclass
class WarmRank:
    """A rank process that has done its imports and waits for its order on stdin."""

    proc: subprocess.Popen
    env: dict[str, str]

    @classmethod
    def spawn(cls, entry: str, env: dict[str, str], log: Path) -> WarmRank:
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, entry, "warm-rank"], stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, env=env)
        return cls(proc, env)

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a rank needing ``env`` can be this process (same import-time environment, alive)."""
        return self.proc.poll() is None and all(self.env.get(k) == env.get(k) for k in IMPORT_TIME_ENV)

    def start(self, spec_path: str, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Make this process the rank described by ``env``, logging to ``log``; return its process."""
        order = json.dumps({"spec": spec_path, "env": env, "log": str(log)})
        self.proc.stdin.write(order.encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def discard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run_warm_rank() -> int:
    """The warm rank: import the heavy packages, wait for the order, then be that rank."""
    from .rank import die_with_parent

    die_with_parent()
    import deepspeed  # noqa: F401  (the point: pay the imports before the run starts)
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    print(READY, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    redirect_output(order["log"])
    os.environ.update(order["env"])
    from .rank import run_rank

    return run_rank(order["spec"])


def redirect_output(log: str) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


