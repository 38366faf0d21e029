"""Problems of several inputs of one node, reported once for the node.

ComfyUI attaches a message returned by a node's ``validate_inputs`` to every input that function takes:
a problem of a combination (LoKr with dropout, Prodigy with a schedule) was listed once per input, up to
seven times, with two problems run into each line. An exception raised while a node validates is stored
once, on that node, by the node that reached it (ComfyUI's ``execution.validate_inputs``; the same on 0.3.75
and 0.33), and the other nodes of the graph are still checked: every problem of a queue comes in the same
answer, each once, one per line.
"""

from __future__ import annotations

from collections.abc import Sequence


class NodeProblems(ValueError):
    """Every problem of a node's combined inputs, one per line."""


def refuse_once(problems: Sequence[str]) -> bool:
    """``True`` when there is no problem; otherwise raise them together, for ComfyUI to list once on the node."""
    if problems:
        raise NodeProblems("\n".join(problems))
    return True
