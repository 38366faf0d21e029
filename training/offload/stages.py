"""How many blocks each pipeline stage can swap, and the message when ``blocks_to_swap`` asks for more.

A layer is swappable when its family adapter says so (``StageLayer.swappable``: the repeated
transformer blocks, not the embedders or the final layer). ``blocks_to_swap`` applies per stage, so
its maximum is the swappable-block count of the smallest stage. Pure Python over the layer list:
the node layer's preflight uses it without DeepSpeed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def is_swappable(layer: object) -> bool:
    """Whether the adapter marked this stage layer as a block whose frozen weights may be offloaded."""
    return bool(getattr(layer, "swappable", False))


def swappable_per_stage(layers: Sequence[object], boundaries: Sequence[int]) -> list[int]:
    """Swappable layers of each stage; ``boundaries`` are the stage starts plus the end (len = stages + 1)."""
    return [sum(1 for layer in layers[a:b] if is_swappable(layer))
            for a, b in zip(boundaries[:-1], boundaries[1:], strict=False)]


def uniform_boundaries(num_layers: int, stages: int) -> list[int]:
    """Stage boundaries of an equal-layer-count split; the first ``num_layers % stages`` stages get one more.

    This is the split DeepSpeed's ``partition_method="uniform"`` makes, so preflight can be exact for it.
    """
    if num_layers <= stages:
        return [min(s, num_layers) for s in range(stages + 1)]
    size, extra = divmod(num_layers, stages)
    return [s * size + min(s, extra) for s in range(stages + 1)]


def balanced_boundaries(weights: Sequence[int], stages: int) -> list[int]:
    """Stage boundaries of DeepSpeed's ``partition_method="parameters"`` split over per-layer ``weights``.

    The same dynamic programme as ``deepspeed.runtime.utils.partition_balanced`` (the linear partition
    that minimises the largest minus the smallest stage, ties going to the later cut), in plain Python,
    so the node layer's memory plan sees the split the ranks will make. ``weights`` are the layers'
    counts of floating-point parameters (what DeepSpeed counts once the trainer flags them trainable).
    """
    n, m = len(weights), stages
    if n <= m:
        return uniform_boundaries(n, m)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0, *(float(v) for v in itertools.accumulate(int(w) for w in weights))]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, max_sum, min_sum, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def blocks_to_swap_problem(blocks_to_swap: int, per_stage: Sequence[int], exact: bool = True) -> str | None:
    """Why ``blocks_to_swap`` cannot be honoured by stages holding ``per_stage`` swappable blocks, or None.

    With ``exact`` False, ``per_stage`` is a bound (the real split is not known yet): the message says so.
    """
    if blocks_to_swap <= 0 or not per_stage:
        return None
    limit = min(per_stage)
    if blocks_to_swap <= limit:
        return None
    stages = len(per_stage)
    where = ("the model has" if stages == 1 else
             f"with {stages} pipeline stages the smallest stage has{'' if exact else ' at most'}")
    return (f"blocks_to_swap {blocks_to_swap} is out of range: {where} {limit} swappable block(s), so the "
            f"maximum is {limit}. Set blocks_to_swap to {limit} or less"
            + (" (0 turns block swap off)." if stages == 1 else ", or use fewer pipeline stages."))
