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
from collections.abc import Sequence
from pathlib import Path

from ..spec.run_spec import RunSpec
from .cluster import write_cluster_bundle
from .deaths import DeathWatch
from .events import EventWriter, stop_path
from .process_util import process_alive
from .rank import EXIT_FAILED, EXIT_OK, EXIT_STOPPED, cpu_rank_environment
from .slowness import slow_rank_text
from .warm_rank import WarmRank

POLL_S = 0.2
TERM_GRACE_S = 10.0
PARENT_GONE_GRACE_S = 60.0


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _rank_env(spec: RunSpec, rank: int, rendezvous: Path) -> dict[str, str]:
    """Rank ``rank``'s environment. On CUDA every rank sees the run's GPUs (``spec.launch``), in rank
    order, so rank r's device is r, as with DeepSpeed's own launcher (``--include``): its engine and
    PipelineModule place the rank by LOCAL_RANK, and all ranks seeing the same GPUs keeps NCCL's
    peer-to-peer paths. Setting them from the spec, not inheriting them, lets a run dir started
    from a shell use the GPUs the Train node chose. Everything else is ComfyUI's environment, among it
    PYTORCH_CUDA_ALLOC_CONF as ComfyUI's cuda_malloc.py set it (``backend:cudaMallocAsync`` unless ComfyUI
    was started with ``--disable-cuda-malloc``): the ranks allocate like ComfyUI does."""
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
        "PIPETRAINER_INIT_METHOD": f"file://{rendezvous}", "PYTHONUNBUFFERED": "1",
    })
    if spec.device == "cpu":
        env.update(cpu_rank_environment())
    elif spec.launch.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = spec.launch.cuda_visible_devices
        if spec.launch.cuda_device_order:
            env["CUDA_DEVICE_ORDER"] = spec.launch.cuda_device_order
    return env


def _terminate(procs: Sequence[subprocess.Popen]) -> None:
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


def supervise(spec_path: str, entry: str, warm_rank: WarmRank | None = None) -> int:
    """Run the ranks of the spec to the end; ``warm_rank`` (training/process/warm_rank.py) becomes rank 0 if it fits."""
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
    ranks = f"{spec.world_size} rank{'s' if spec.world_size != 1 else ''}"
    events.emit("phase", phase="starting_ranks", text=f"starting {ranks}")
    for rank in range(spec.world_size):
        env = _rank_env(spec, rank, rendezvous)
        if rank == 0 and warm_rank is not None and warm_rank.fits(env):
            procs.append(warm_rank.start(spec_path, env, logs / "rank0.log"))
            events.emit("warm_start", rank=0, pid=warm_rank.proc.pid)
            continue
        with open(logs / f"rank{rank}.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, entry, "rank", spec_path], stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
    if warm_rank is not None and warm_rank.proc not in procs:
        warm_rank.discard()  # it did not fit this run: a rank is never kept for another one
    try:
        return watch_ranks(procs, run_dir, events, spec.parent_pid)
    finally:
        rendezvous.unlink(missing_ok=True)


def watch_ranks(procs: Sequence[subprocess.Popen], run_dir: Path, events: EventWriter, parent_pid: int = 0) -> int:
    """Poll the rank processes (``procs[r]`` is rank ``r``) until the run ends; return its exit code.

    A rank that exits with anything but EXIT_OK / EXIT_STOPPED fails the run whenever it exits, also
    after its peers finished: a missing stage must never be reported as done. The other ranks are then
    terminated and a ``failed`` event names the rank with the tail of ``logs/rank<r>.log`` and, when the
    kernel's records show its OOM killer ended the rank, that cause (training/process/deaths.py). If the
    ComfyUI process (``parent_pid``) disappears, the ranks are asked to stop, then ended after a grace.
    """
    logs = run_dir / "logs"
    deaths = DeathWatch.start([p.pid for p in procs])
    parent_gone_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c is not None and c not in (EXIT_OK, EXIT_STOPPED)]
        if failed:
            alive = [r for r, c in enumerate(codes) if c is None]  # before the teardown ends them
            _terminate(procs)
            rank, code = _origin_of_failure(run_dir, failed)
            death = deaths.cause(procs[rank].pid, code)
            cause, text = (death.cause, death.message(rank)) if death else _slow_peers(run_dir, rank, alive)
            events.emit("failed", rank=rank, exit_code=code, log_tail=log_tail(logs / f"rank{rank}.log"),
                        cause=cause, cause_text=text)
            return EXIT_FAILED
        if all(c is not None for c in codes):
            return EXIT_STOPPED if EXIT_STOPPED in codes else EXIT_OK
        if parent_pid and parent_gone_at is None and not process_alive(parent_pid):
            parent_gone_at = time.monotonic()
            stop_path(run_dir).touch()
            events.emit("parent_gone", parent_pid=parent_pid)
        if parent_gone_at is not None and time.monotonic() - parent_gone_at > PARENT_GONE_GRACE_S:
            _terminate(procs)
            return EXIT_STOPPED
        time.sleep(POLL_S)


def _slow_peers(run_dir: Path, rank: int, alive: list[int]) -> tuple[str | None, str | None]:
    """``("slow_peer", message)`` when ``rank`` timed out while other ranks still ran (training/process/slowness.py)."""
    from .events import read_all

    events = read_all(run_dir)
    error = next((str(e.get("message", "")) for e in events if e.get("type") == "error" and e.get("rank") == rank), "")
    text = slow_rank_text(rank, error, alive, events, time.time())
    return ("slow_peer", text) if text else (None, None)


def _origin_of_failure(run_dir: Path, failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The rank the failure started at: one killed by a signal (only something outside the run kills a
    rank before this supervisor does: the OOM killer, a person), else the first to report an error (its
    peers then fail with "connection closed")."""
    from .events import read_all

    killed = [(r, c) for r, c in failed if c < 0]
    if killed:
        return killed[0]
    codes = dict(failed)
    errors = sorted((e.get("time", 0.0), e.get("rank")) for e in read_all(run_dir)
                    if e.get("type") == "error" and e.get("rank") in codes)
    if errors:
        rank = errors[0][1]
        return rank, codes[rank]
    return failed[0]
