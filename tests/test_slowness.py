"""A collective timeout while a peer is still running is reported as slow, not dead."""

from __future__ import annotations

from pipetrainer.training.process.slowness import is_timeout, slow_rank_text

GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "300000ms for recv operation to complete")
NCCL = "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=SEND)"


def test_gloo_and_nccl_timeouts_are_recognised_and_other_errors_are_not():
    assert is_timeout(GLOO) and is_timeout(NCCL)
    assert not is_timeout("RuntimeError: Connection closed by peer [127.0.0.1]:1234")
    assert not is_timeout("ValueError: blocks_to_swap 9 is out of range")


def test_the_message_names_the_running_rank_and_what_it_did_last():
    events = [{"type": "rank_memory", "source": "rank1", "time": 100.0},
              {"type": "phase", "phase": "loading_model", "source": "rank1", "time": 110.0},
              {"type": "step", "source": "rank0", "time": 115.0}]
    text = slow_rank_text(0, GLOO, alive=[1], events=events, now=420.0)
    assert "rank 0 timed out" in text and "rank 1 (last report 'loading_model' 310 s earlier)" in text
    assert "slow, not dead" in text and "PIPETRAINER_PG_TIMEOUT" in text


def test_no_slow_verdict_when_nobody_else_was_running_or_the_error_is_not_a_timeout():
    assert slow_rank_text(0, GLOO, alive=[], events=[], now=1.0) is None
    assert slow_rank_text(0, GLOO, alive=[0], events=[], now=1.0) is None  # only itself
    assert slow_rank_text(0, "RuntimeError: Connection closed by peer", alive=[1], events=[], now=1.0) is None
