"""Telling a slow rank from a dead one when a collective times out.

A rank that waits in a collective longer than the process-group timeout fails with a timeout error,
while the rank it waits for may be alive and working (reading its share of a large model file,
computing a much heavier stage). Reporting only "rank 0 timed out" sends the user hunting for a
crash. The supervisor knows which ranks were still running when the first one failed, and the run's
events say what each was last doing; :func:`slow_rank_text` turns that into the message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_TIMEOUT = re.compile(r"tim(ed|e)[ -]?out", re.IGNORECASE)


def is_timeout(message: str) -> bool:
    """Whether a rank's error is a collective/communication timeout (gloo's or NCCL's wording)."""
    return bool(_TIMEOUT.search(message or ""))


def _last_event_of(rank: int, events: Sequence[dict]) -> dict | None:
    source = f"rank{rank}"
    mine = [e for e in events if e.get("source") == source]
    return mine[-1] if mine else None


def slow_rank_text(failed_rank: int, error: str, alive: Iterable[int], events: Sequence[dict],
                   now: float) -> str | None:
    """The message when ``failed_rank`` timed out while the ranks in ``alive`` were still running."""
    alive = sorted(set(alive) - {failed_rank})
    if not alive or not is_timeout(error):
        return None
    described = []
    for rank in alive:
        last = _last_event_of(rank, events)
        if last is None:
            described.append(f"rank {rank} (no report yet)")
        else:
            age = now - float(last.get("time", now))
            doing = last.get("phase") or last.get("type")
            described.append(f"rank {rank} (last report '{doing}' {age:.0f} s earlier)")
    return (f"rank {failed_rank} timed out waiting for other ranks, which were still running: "
            f"{', '.join(described)}. They were slow, not dead: a rank still loading its share of the model, "
            "or a much heavier pipeline stage. Raise PIPETRAINER_PG_TIMEOUT (training collectives, seconds) "
            "in ComfyUI's environment, or balance the stages (partition_method, pipeline_stages).")
