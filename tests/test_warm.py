"""Pre-started training trees: a warm rank 0 trains exactly like a cold one, serves one run, dies with its tree.

Everything is real: the warm supervisor and rank are the processes the Train node starts, the run is a
tiny MMDiT training through the real supervisor. Timing is for bench/startup.py, not asserted here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipetrainer.nodes.run import run_process
from pipetrainer.nodes.run.warm_pool import ENTRY, WarmKey, WarmPool
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.training.process.warm_rank import READY, WarmRank


def _wait_for(predicate, timeout: float = 90.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _warm_rank_ready(folder: Path) -> bool:
    return any(READY in p.read_text(errors="replace") for p in folder.glob("warm-rank-*.log"))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_warm_rank_0_trains_like_a_cold_one_and_is_never_reused(fixture_paths, comfy_root, demo_cache, tmp_path):
    items = demo_cache.items[:2]
    cold = make_spec(fixture_paths.mmdit, items, tmp_path / "cold", comfy_root, steps=3, seed=4)
    code, cold_events = run_training(cold)
    assert code == 0, cold_events

    pool = WarmPool(enabled=True)
    warm_dir = tmp_path / ".warm"
    pool.refill(run_process.warm_key(cold), warm_dir)
    supervisor = pool._warm.proc
    _wait_for(lambda: _warm_rank_ready(warm_dir), what="the warm rank's imports")
    rank_pid = _descendants(supervisor.pid)[0].pid

    spec = make_spec(fixture_paths.mmdit, items, tmp_path / "warm", comfy_root, steps=3, seed=4,
                     parent_pid=os.getpid())
    handle = run_process.launch(spec, pool)
    assert handle.proc is supervisor
    code = run_process.follow(handle, lambda event: None, lambda: False)
    events = handle.events
    assert code == run_process.EXIT_OK, [e for e in events if e["type"] in ("error", "failed")]
    assert [e["pid"] for e in events if e["type"] == "warm_start"] == [rank_pid]
    assert losses(events) == losses(cold_events)  # the same run, bit for bit
    assert "[pipetrainer]" in (Path(spec.run_dir) / "logs" / "rank0.log").read_text()
    assert pool.take(run_process.warm_key(spec)) is None  # served one run; a new one must be started
    assert not psutil.pid_exists(rank_pid) or psutil.Process(rank_pid).status() == psutil.STATUS_ZOMBIE


def test_a_warm_tree_for_another_device_is_ended_not_used(fixture_paths, comfy_root, tmp_path):
    pool = WarmPool(enabled=True)
    pool.refill(WarmKey("cuda", str(comfy_root)), tmp_path / ".warm")
    proc = pool._warm.proc
    assert pool.take(WarmKey("cpu", str(comfy_root))) is None
    assert proc.poll() is not None


def test_a_rank_needing_other_import_time_settings_does_not_fit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.PIPE)
    try:
        rank = WarmRank(proc, {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
        assert rank.fits({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": "0"})
        assert not rank.fits({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"})
        assert not rank.fits({"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "1"})
    finally:
        WarmRank(proc, {}).discard()
    assert not WarmRank(proc, {}).fits({})  # a dead process never fits


@pytest.mark.parametrize("how", ["parent dies", "stdin closes"])
def test_a_waiting_warm_tree_leaves_with_its_parent_or_its_input(tmp_path, how):
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    warm = subprocess.Popen([sys.executable, str(ENTRY), "warm", "cpu", str(parent.pid), str(tmp_path)],
                            stdin=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(lambda: _warm_rank_ready(tmp_path), what="the warm rank's imports")
        rank = _descendants(warm.pid)[0]
        if how == "parent dies":
            parent.kill()
            parent.wait()  # reaped, as ComfyUI's own parent would: a zombie still counts as alive
        else:
            warm.stdin.close()
        warm.wait(20)
        _wait_for(lambda: not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE, 20, "the warm rank to end")
        assert warm.returncode == 0
    finally:
        parent.kill()
        if warm.poll() is None:
            warm.kill()
