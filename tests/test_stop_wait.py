"""Cancel waits for the ranks as long as their steps take: they look at STOP only between whole steps, so a
run of 90-second video steps must not be killed after a fixed 120 s, losing its checkpoint."""

from __future__ import annotations

import subprocess
import sys
import types

from pipetrainer.nodes.run import run_process
from pipetrainer.training.process.events import EventReader


def _steps(*seconds: float) -> list[dict]:
    return [{"type": "step", "step": i + 1, "step_time": s} for i, s in enumerate(seconds)]


def test_the_wait_follows_the_slowest_recent_step_and_never_drops_below_the_floor():
    assert run_process.stop_grace_seconds([]) == run_process.STOP_GRACE_S
    assert run_process.stop_grace_seconds(_steps(0.4, 0.5)) == run_process.STOP_GRACE_S
    video = _steps(300.0, 40.0, 95.0, 60.0, 80.0, 70.0)  # the 300 s first step (compilation) is not recent
    assert run_process.stop_grace_seconds(video) == run_process.STOP_STEP_MARGIN * 95.0
    assert run_process.stop_grace_seconds([{"type": "validation", "loss": 1.0}, *video[-1:]]) == max(
        run_process.STOP_GRACE_S, run_process.STOP_STEP_MARGIN * 70.0)


def test_the_node_is_told_how_long_the_current_step_may_take():
    assert run_process.stopping_text(_steps(2.0, 94.6)) == (
        "Stopping after the current step (about 95 s), then saving a checkpoint...")
    assert run_process.stopping_text([]) == "Stopping after the current step, then saving a checkpoint..."


def test_stop_shows_the_text_then_waits_for_the_tree_to_save_and_exit(tmp_path):
    """A stand-in supervisor that finishes its step 1.5 s after STOP appears and exits as stopped."""
    code = ("import os, sys, time\n"
            f"stop = os.path.join({str(tmp_path)!r}, 'STOP')\n"
            "while not os.path.exists(stop): time.sleep(0.05)\n"
            "time.sleep(1.5); sys.exit(3)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    handle = run_process.RunHandle(types.SimpleNamespace(run_dir=str(tmp_path)), proc, EventReader(tmp_path),
                                   events=_steps(1.0, 1.2))
    shown = []
    assert run_process.stop(handle, on_stop=shown.append) == run_process.EXIT_STOPPED
    assert shown == ["Stopping after the current step (about 1 s), then saving a checkpoint..."]
