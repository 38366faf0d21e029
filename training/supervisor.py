"""The supervisor: starts the ranks of one run, watches them, and tears the group down on failure.

The node starts this process in a new session; it starts one process per rank on this machine with
a per-run file rendezvous (no port to collide with another run). The first rank that fails ends the
run: the others get SIGTERM, then SIGKILL, and its error and log tail become the run's error. If the
ComfyUI process disappears, the run is asked to stop (checkpoint kept) and then ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .cluster import write_cluster_bundle
from .events import EventWriter, stop_path
from .process_util import process_alive
from .rank import EXIT_FAILED, EXIT_OK, EXIT_STOPPED, cpu_rank_environment
from .spec import RunSpec

POLL_S = 0.2
TERM_GRACE_S = 10.0
PARENT_GONE_GRACE_S = 60.0


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _rank_env(spec: RunSpec, rank: int, rendezvous: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
        "PIPETRAINER_INIT_METHOD": f"file://{rendezvous}", "PYTHONUNBUFFERED": "1",
    })
    if spec.device == "cpu":
        env.update(cpu_rank_environment())
    return env


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(spec_path: str, entry: str) -> int:
    spec = RunSpec.load(spec_path).validated()
    run_dir = Path(spec.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    events = EventWriter(run_dir, source="supervisor")
    rendezvous = run_dir / ".rendezvous"
    rendezvous.unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []

    def on_term(signum, frame):  # the node gave up waiting: end the ranks with us
        _terminate(procs)
        rendezvous.unlink(missing_ok=True)
        os._exit(EXIT_FAILED)

    signal.signal(signal.SIGTERM, on_term)
    bundle = write_cluster_bundle(spec, entry)
    events.emit("launch", world_size=spec.world_size, pid=os.getpid(), cluster=str(bundle))
    for rank in range(spec.world_size):
        with open(logs / f"rank{rank}.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, entry, "rank", spec_path], stdout=log,
                                          stderr=subprocess.STDOUT, env=_rank_env(spec, rank, rendezvous)))
    parent_gone_at: float | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c is not None and c not in (EXIT_OK, EXIT_STOPPED)]
            if failed:
                _terminate(procs)
                rank, code = _origin_of_failure(run_dir, failed)
                events.emit("failed", rank=rank, exit_code=code, log_tail=log_tail(logs / f"rank{rank}.log"))
                return EXIT_FAILED
            if all(c is not None for c in codes):
                return EXIT_STOPPED if EXIT_STOPPED in codes else EXIT_OK
            if spec.parent_pid and parent_gone_at is None and not process_alive(spec.parent_pid):
                parent_gone_at = time.monotonic()
                stop_path(run_dir).touch()
                events.emit("parent_gone", parent_pid=spec.parent_pid)
            if parent_gone_at is not None and time.monotonic() - parent_gone_at > PARENT_GONE_GRACE_S:
                _terminate(procs)
                return EXIT_STOPPED
            time.sleep(POLL_S)
    finally:
        rendezvous.unlink(missing_ok=True)


def _origin_of_failure(run_dir: Path, failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The failed rank that reported an error first (its peers then fail with "connection closed")."""
    from .events import read_all

    codes = dict(failed)
    errors = sorted((e.get("time", 0.0), e.get("rank")) for e in read_all(run_dir)
                    if e.get("type") == "error" and e.get("rank") in codes)
    if errors:
        rank = errors[0][1]
        return rank, codes[rank]
    return failed[0]
