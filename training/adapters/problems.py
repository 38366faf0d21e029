"""Preflight of an adapter against a MODEL: the layers its type cannot wrap, the ``blocks`` range and the
``init_lora`` file, each checked against the model's own targets.

Apart from the type registry (training/adapters/kinds.py) because it needs the families' target rules and
the init-file reader, which themselves build on the registry."""

from __future__ import annotations

from ..spec.options import LoraSpec
from .kinds import REGISTRY, quant_layer_problem


def adapter_target_problems(model_base: object, lora: LoraSpec) -> list[str]:
    """Preflight: the adapter against the MODEL's targets: the quantized layers its type cannot wrap, the
    ``blocks`` range against the model's block counts, and the ``init_lora`` file against the targets."""
    from ..pipelines.base import adapter_for
    from ..pipelines.checks import model_inputs
    from ..pipelines.targets import block_range_problems, model_targets, preset_problems, run_target_regex
    from ..quant.layers import is_comfy_quant_linear, is_linear_like

    kind = REGISTRY.get(lora.adapter)
    inputs = model_inputs(model_base)
    if kind is None or inputs is None:
        return []  # the spec's own check names an unknown type; an unknown family is reported elsewhere
    family, dm = adapter_for(inputs.family), model_base.diffusion_model
    problems = preset_problems(family, lora.targets) or block_range_problems(family, dm, lora)
    if problems:
        return problems
    targets = model_targets(dm, run_target_regex(family, dm, lora))
    problem = quant_layer_problem(kind, [name for name, m in targets.items() if is_comfy_quant_linear(m)])
    problems += [problem] if problem else []
    if lora.init_lora:
        from .init_lora import InitLoraError, init_problems, read_init_file

        try:
            init = read_init_file(lora.init_lora)
        except (InitLoraError, OSError) as exc:
            return [*problems, str(exc)]
        linears = [n for n, m in dm.named_modules() if n and is_linear_like(m)]
        problems += init_problems(init, lora, targets, linears)
    return problems
