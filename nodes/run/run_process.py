"""Starting the training process tree from the node, following its events, and stopping it.

The supervisor runs in its own session (process group) so it can always be ended as a whole. Cancel
asks for a graceful stop first (the ranks agree on a step, checkpoint and save), then terminates the
group if that takes too long. Whatever happens in the node, no training process outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...training.process.events import EventReader, EventWriter, stop_path
from ...training.spec.run_spec import RunSpec
from .warm_pool import WarmKey, WarmPool, hand_over

ENTRY = Path(__file__).resolve().parents[2] / "training" / "process" / "entry.py"
EXIT_OK, EXIT_STOPPED = 0, 3
STOP_GRACE_S = 120.0  # the least the ranks get to reach the end of their step, checkpoint and save
STOP_STEP_MARGIN = 3.0  # times the slowest recent step: the step under way, a checkpoint, a slower rank
RECENT_STEPS = 5
POLL_S = 0.25


class TrainingFailed(RuntimeError):
    pass


@dataclass
class RunHandle:
    spec: RunSpec
    proc: subprocess.Popen
    reader: EventReader
    events: list[dict] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir)


def warm_key(spec: RunSpec) -> WarmKey:
    return WarmKey(spec.device, spec.comfyui_path)


def launch(spec: RunSpec, pool: WarmPool | None = None, notes: Sequence[str] = ()) -> RunHandle:
    """Write the spec into its run dir and start its supervisor in a new session: the pool's warm one
    (nodes/run/warm_pool.py) when it fits the run, else a fresh one. ``notes`` (the memory plan of
    ``blocks_to_swap`` auto) go into the run log first, as ``note`` events."""
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(spec.to_json(), encoding="utf-8")
    writer = EventWriter(spec.run_dir, source="node")
    for note in notes:
        writer.emit("note", message=note)
    if spec.device == "cuda" and spec.launch.gpus:
        _note_gpus(spec)
    warm = pool.take(warm_key(spec)) if pool is not None else None
    if warm is not None:
        hand_over(warm, spec_path)
        return RunHandle(spec, warm, EventReader(run_dir))
    log = open(run_dir / "logs" / "supervisor.log", "ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(ENTRY), "supervise", str(spec_path)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=str(run_dir), start_new_session=True)
    log.close()
    return RunHandle(spec, proc, EventReader(run_dir))


def follow(handle: RunHandle, on_event: Callable[[dict], None], interrupted: Callable[[], bool],
           on_idle: Callable[[], None] | None = None, on_stop: Callable[[str], None] | None = None) -> int:
    """Forward events until the supervisor exits; on interrupt, stop the run and return its code.

    ``on_idle`` runs between polls while the run goes on (the Train node shows there what its preview
    worker rendered or skipped; the training processes never wait for previews). It must return quickly:
    events are forwarded only between its calls.

    Exceptions raised by ``on_event`` or ``on_idle`` (ComfyUI's progress hook raises on Cancel) also stop
    the run.
    After a stop, the events written while stopping (the checkpoint's ``saved``, ``stopped``) are in
    ``handle.events`` without being forwarded, so the caller can say where the run stopped. ``on_stop``
    gets the text to show while a stop waits for the ranks (:func:`stopping_text`).
    """
    try:
        while True:
            code = handle.proc.poll()
            for event in handle.reader.poll():
                _deliver(handle, event, on_event)
            if code is not None:
                for event in handle.reader.poll():
                    _deliver(handle, event, on_event)
                return code
            if interrupted():
                code = stop(handle, on_stop=on_stop)
                handle.events.extend(handle.reader.poll())
                return code
            if on_idle is not None:
                on_idle()
            time.sleep(POLL_S)
    except BaseException:
        stop(handle, on_stop=on_stop)
        handle.events.extend(handle.reader.poll())
        raise


def _deliver(handle: RunHandle, event: dict, on_event: Callable[[dict], None]) -> None:
    """Record and forward one event; ``note`` events (a launch setting set aside, the GPUs) also go to
    ComfyUI's console, where the user looks first."""
    handle.events.append(event)
    if event.get("type") == "note":
        logging.info("[PipeTrainer] %s", event.get("message", ""))
    on_event(event)


def _note_gpus(spec: RunSpec) -> None:
    """Put the ranks' GPUs with their memory, as it is once ComfyUI freed its models, into the run log."""
    from ..checks.gpus import gpu_table, visible_gpus

    EventWriter(spec.run_dir, source="node").emit("note", message=gpu_table(spec.launch.gpus, visible_gpus()))


def recent_step_seconds(events: list[dict]) -> float | None:
    """The slowest of the run's last few step times (None before the first step)."""
    times = [float(e["step_time"]) for e in events if e.get("type") == "step" and "step_time" in e]
    return max(times[-RECENT_STEPS:]) if times else None


def stop_grace_seconds(events: list[dict]) -> float:
    """How long a stop waits for the checkpoint: ranks look at STOP only between whole steps, so a run of
    long steps (video) gets a few of its own steps, never less than :data:`STOP_GRACE_S`."""
    step = recent_step_seconds(events)
    return max(STOP_GRACE_S, STOP_STEP_MARGIN * step) if step is not None else STOP_GRACE_S


def stopping_text(events: list[dict]) -> str:
    """What the Train node shows while a stop waits for the ranks."""
    step = recent_step_seconds(events)
    about = f" (about {max(1, round(step))} s)" if step is not None else ""
    return f"Stopping after the current step{about}, then saving a checkpoint..."


def stop(handle: RunHandle, grace_s: float | None = None, on_stop: Callable[[str], None] | None = None) -> int:
    """Ask the ranks to stop and save; end the process group if they do not within ``grace_s`` (by
    default scaled to the run's recent step times, :func:`stop_grace_seconds`)."""
    if grace_s is None:
        grace_s = stop_grace_seconds(handle.events)
    if handle.proc.poll() is None:
        stop_path(handle.run_dir).touch()
        if on_stop is not None:
            on_stop(stopping_text(handle.events))
        try:
            handle.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_group(handle.proc)
    kill_group(handle.proc)  # leftovers of a finished supervisor, if any
    return handle.proc.returncode


def kill_group(proc: subprocess.Popen, term_wait_s: float = 15.0) -> None:
    """SIGTERM the supervisor's process group, then SIGKILL whatever remains."""
    for sig, wait in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            if proc.poll() is None:
                try:
                    proc.wait(0.1)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.1)
        if not _group_alive(proc.pid):
            break
    if proc.poll() is None:
        proc.wait(5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def failure_message(handle: RunHandle) -> str:
    """The most useful error text: the kernel's cause of a rank's death, rank errors (each message once,
    with the ranks that raised it: a diverged loss stops every rank with the same one), the
    supervisor's verdict, and log tails."""
    parts = [e["cause_text"] for e in handle.events if e.get("type") == "failed" and e.get("cause_text")]
    by_message: dict[str, list[int]] = {}
    for e in handle.events:
        if e.get("type") == "error":
            by_message.setdefault(str(e.get("message")), []).append(int(e.get("rank", -1)))
    for message, ranks in by_message.items():
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}: {message}")
    for e in handle.events:
        if e.get("type") == "failed":
            parts.append(f"rank {e.get('rank')} exited with code {e.get('exit_code')}. Log tail:\n{e.get('log_tail', '')}")
    if not parts:
        sup = handle.run_dir / "logs" / "supervisor.log"
        tail = sup.read_text(errors="replace")[-4000:] if sup.exists() else ""
        parts.append(f"the training process exited with code {handle.proc.returncode}.\n{tail}")
    return f"Training failed (run dir {handle.run_dir}):\n" + "\n".join(parts)
