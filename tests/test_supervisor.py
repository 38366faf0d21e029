"""The supervisor's watch loop over real processes: whichever rank fails, whenever, fails the run.

``supervise`` starts ``entry.py rank <spec>`` processes and hands them to ``watch_ranks``; these tests
hand it tiny real rank programs instead (``python -c`` that print and exit with a chosen code), so
every exit order is cheap to produce and the oracle is simply the exit codes we chose.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipetrainer.training.process.events import EventWriter, read_all
from pipetrainer.training.process.rank import EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from pipetrainer.training.process.supervisor import watch_ranks


def _start(run_dir: Path, rank: int, program: str) -> subprocess.Popen:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"rank{rank}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-c", program], stdout=log, stderr=subprocess.STDOUT)


def _exits(code: int, message: str, after_s: float = 0.0) -> str:
    return f"import sys, time; time.sleep({after_s}); print({message!r}, flush=True); sys.exit({code})"


def _watch(run_dir: Path, procs: list[subprocess.Popen]) -> tuple[int, list[dict]]:
    code = watch_ranks(procs, run_dir, EventWriter(run_dir, source="supervisor"))
    return code, [e for e in read_all(run_dir) if e["type"] == "failed"]


def test_a_rank_failing_after_rank0_finished_fails_the_run_with_its_log_tail(tmp_path):
    rank0 = _start(tmp_path, 0, _exits(EXIT_OK, "rank 0: all steps done"))
    assert rank0.wait(30) == EXIT_OK  # rank 0 has really exited OK before rank 1 fails
    rank1 = _start(tmp_path, 1, _exits(EXIT_FAILED, "rank 1: stage 1 lost its LoRA", after_s=0.5))
    code, failed = _watch(tmp_path, [rank0, rank1])
    assert code == EXIT_FAILED
    assert len(failed) == 1, failed
    assert failed[0]["rank"] == 1 and failed[0]["exit_code"] == EXIT_FAILED
    assert "stage 1 lost its LoRA" in failed[0]["log_tail"]


def test_a_failing_rank_ends_its_running_peers_at_once(tmp_path):
    rank0 = _start(tmp_path, 0, _exits(EXIT_OK, "rank 0 would train for a minute", after_s=60))
    rank1 = _start(tmp_path, 1, _exits(7, "rank 1: CUDA out of memory", after_s=0.5))
    started = time.monotonic()
    code, failed = _watch(tmp_path, [rank0, rank1])
    assert code == EXIT_FAILED and time.monotonic() - started < 20
    assert rank0.poll() is not None  # terminated, not left running
    assert failed[0]["rank"] == 1 and failed[0]["exit_code"] == 7 and "out of memory" in failed[0]["log_tail"]


@pytest.mark.parametrize(("codes", "expected"), [
    ((EXIT_OK, EXIT_OK), EXIT_OK),
    ((EXIT_STOPPED, EXIT_STOPPED), EXIT_STOPPED),
    ((EXIT_OK, EXIT_STOPPED), EXIT_STOPPED),
])
def test_runs_that_end_well_are_reported_as_such(tmp_path, codes, expected):
    procs = [_start(tmp_path, r, _exits(c, f"rank {r} ends with {c}", after_s=0.2 * r)) for r, c in enumerate(codes)]
    code, failed = _watch(tmp_path, procs)
    assert (code, failed) == (expected, [])


def test_a_timeout_while_a_peer_still_runs_is_reported_as_slow_not_dead(tmp_path):
    """Rank 0 gives up on a collective (a real rank reports its error event, then exits 1) while rank 1,
    still loading, is alive: the verdict names rank 1 and what it was doing."""
    EventWriter(tmp_path, source="rank1").emit("phase", phase="loading_model", text="loading the model")
    EventWriter(tmp_path, source="rank0").emit(
        "error", rank=0, message="RuntimeError: Timed out waiting 300000ms for recv operation to complete")
    rank0 = _start(tmp_path, 0, _exits(EXIT_FAILED, "rank 0: collective timeout", after_s=0.3))
    rank1 = _start(tmp_path, 1, _exits(EXIT_OK, "rank 1 still reading its stage", after_s=60))
    code, failed = _watch(tmp_path, [rank0, rank1])
    assert code == EXIT_FAILED and failed[0]["rank"] == 0
    assert failed[0]["cause"] == "slow_peer"
    assert "rank 1 (last report 'loading_model'" in failed[0]["cause_text"] and "slow, not dead" in failed[0]["cause_text"]


def test_a_plain_failure_with_no_timeout_gets_no_slow_verdict(tmp_path):
    EventWriter(tmp_path, source="rank0").emit("error", rank=0, message="ValueError: bad spec")
    rank0 = _start(tmp_path, 0, _exits(EXIT_FAILED, "rank 0: bad spec", after_s=0.3))
    rank1 = _start(tmp_path, 1, _exits(EXIT_OK, "rank 1 busy", after_s=60))
    code, failed = _watch(tmp_path, [rank0, rank1])
    assert code == EXIT_FAILED and failed[0]["cause"] is None and failed[0]["cause_text"] is None
