"""How many parameters an adapter of each registered type adds to a model: the disk estimate's base.

LoRA adds ``rank * (in + out)`` to a Linear, but LoHa adds twice that and LoKr far less (its factors
are Kronecker factors of the weight's shape, decomposed or whole by PEFT's rules), so one formula
over-counts one type and under-counts the other. Each registered type (training/adapters/kinds.py) has its
rule here, keyed by the type's name; a type without one fails at import, not in a user's preflight.

The rules are plain arithmetic on purpose: preflight runs in the ComfyUI process, which never imports
PEFT (tests/test_preflight.py). tests/test_disk_estimate.py holds them to PEFT's own layers (built
on the meta device from each type's registry config, over many shapes) and to saved files.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from ..spec.options import LoraSpec
from .kinds import REGISTRY


def _lora(fan_in: int, fan_out: int, lora: LoraSpec) -> int:
    return lora.rank * (fan_in + fan_out)  # lora_A [rank, in], lora_B [out, rank]


def _loha(fan_in: int, fan_out: int, lora: LoraSpec) -> int:
    return 2 * lora.rank * (fan_in + fan_out)  # two LoRA-shaped pairs, multiplied elementwise


def kronecker_split(dim: int, factor: int) -> tuple[int, int]:
    """``(first, second)`` with ``first * second == dim``, as PEFT's LoKr splits a dimension: a ``factor``
    that divides ``dim`` comes first as it is (even when it is the larger side); otherwise the divisor
    pair closest to the square root whose smaller side is at most ``factor`` (< 0: no limit), smaller first."""
    if factor > 0 and dim % factor == 0:
        return factor, dim // factor
    limit = math.isqrt(dim) if factor < 0 else min(math.isqrt(dim), factor)
    small = max((d for d in range(1, limit + 1) if dim % d == 0), default=1)
    return small, dim // small


def _lokr(fan_in: int, fan_out: int, lora: LoraSpec) -> int:
    """``w1`` is [out first, in first] (whole: this trainer never decomposes both factors); ``w2`` is
    [out second, in second], whole when the rank reaches half its larger side, else ``w2_a`` [out
    second, rank] and ``w2_b`` [rank, in second]."""
    in_first, in_second = kronecker_split(fan_in, lora.factor)
    out_first, out_second = kronecker_split(fan_out, lora.factor)
    w1 = out_first * in_first
    whole_w2 = lora.rank >= max(out_second, in_second) / 2
    w2 = out_second * in_second if whole_w2 else lora.rank * (out_second + in_second)
    return w1 + w2


PER_LINEAR: dict[str, Callable[[int, int, LoraSpec], int]] = {"lora": _lora, "lokr": _lokr, "loha": _loha}
assert set(PER_LINEAR) == set(REGISTRY), "every adapter type in training/adapters/kinds.py needs a count rule here"


def adapter_parameter_count(lora: LoraSpec, shapes: Iterable[tuple[int, int]]) -> int:
    """Parameters ``lora``'s adapter type (at its rank and LoKr factor) adds to Linears of these
    ``(in_features, out_features)`` shapes."""
    rule = PER_LINEAR[lora.adapter]
    return sum(n * rule(fan_in, fan_out, lora) for (fan_in, fan_out), n in Counter(shapes).items())


def model_adapter_parameter_count(model_base: object, lora: LoraSpec) -> int:
    """Parameters the run's adapter adds to a ComfyUI ``BaseModel``: every target of the run's preset and
    block range (the rule injection uses), counted per type; 0 for a family that cannot train or an
    unknown adapter type (both are reported by their own checks)."""
    from ..pipelines.base import adapter_for
    from ..pipelines.checks import model_inputs
    from ..pipelines.targets import model_targets, preset_regex, run_target_regex

    inputs = model_inputs(model_base)
    if inputs is None or lora.adapter not in PER_LINEAR:
        return 0
    dm, family = model_base.diffusion_model, adapter_for(inputs.family)
    try:
        regex = run_target_regex(family, dm, lora)
    except ValueError:  # a bad block range or a preset the family lacks is its own preflight problem
        regex = preset_regex(family, lora.targets)
    targets = model_targets(dm, regex)
    return adapter_parameter_count(lora, ((int(m.in_features), int(m.out_features)) for m in targets.values()))
