"""LoRA injection with PEFT into the pipeline's stage layers.

Injection is per stage layer with a seed derived from the layer index, so a layer's initial LoRA
weights do not depend on how layers are split into stages (1-stage and N-stage runs start equal).
LoRA parameters are kept in fp32 whatever the base weights are (bf16, fp8). PEFT moves a new adapter
to its base weight's dtype, so on a bf16 or fp8 base its initial values would be rounded to that
dtype; the initial values are therefore drawn here, in fp32 on the CPU, after injection: the same
seed gives bit-identical initial LoRA weights on every base dtype and device.

ComfyUI's per-layer-quantized Linears are not ``nn.Linear``: PEFT cannot wrap them, so they get the
project's :class:`~.quant.layers.QuantLinearLora` (same layout and key names, same initialisation order);
it implements LoRA only, so other adapter types are refused there (training/adapters/kinds.py says why, in
preflight and here).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..pipelines.targets import layer_targets, peft_target_regex
from ..quant.layers import wrap_quant_linears
from ..spec.options import LoraSpec
from .kinds import adapter_kind, init_fp32, is_adapter_parameter, quant_layer_problem


def inject_lora(layers: Iterable[tuple[int, nn.Module]], target_regex: str, spec: LoraSpec, seed: int) -> int:
    """Add adapters of ``spec.adapter``'s type to the targets of each ``(layer index, layer)``; return how many.

    ``target_regex`` is the family's preset over ComfyUI module paths; :mod:`.pipelines.targets`
    decides which Linears it selects (the same rule partitioning and preflight use), and PEFT is
    given exactly those names, with the type's config (training/adapters/kinds.py). Initial values are fp32:
    the type's zero factors are 0, the others Kaiming-uniform (for LoRA: A drawn, B zero); with
    ``spec.init_lora`` they are then the file's values (training/adapters/init_lora.py; the draws still happen,
    so the RNG streams match a fresh run's).
    """
    from peft import inject_adapter_in_model

    kind = adapter_kind(spec.adapter)
    count = 0
    injected = []
    for index, layer in layers:
        names = list(layer_targets(layer, target_regex))
        if not names:
            continue
        injected.append((index, layer))
        linears = [n for n in names if isinstance(layer.get_submodule(n), nn.Linear)]
        quantized = [n for n in names if n not in linears]
        problem = quant_layer_problem(kind, quantized)
        if problem:
            raise ValueError(problem)
        wrap_quant_linears(layer, quantized, spec.rank, spec.alpha, spec.dropout)
        if linears:
            config = kind.peft_config(spec, peft_target_regex(linears))
            with torch.random.fork_rng(devices=[]):  # PEFT's throw-away default init must not move the global RNG
                inject_adapter_in_model(config, layer)
        init_fp32(layer, kind, torch.Generator().manual_seed(seed * 10_007 + index))
        count += len(names)
    if spec.init_lora:
        from .init_lora import load_init_values, read_init_file

        load_init_values(injected, read_init_file(spec.init_lora), spec)
    return count


def freeze_all_but_lora(module: nn.Module) -> list[nn.Parameter]:
    """Freeze the base model, make the adapter weights (any registered type) trainable fp32, and return them."""
    trainable = []
    for name, p in module.named_parameters():
        is_adapter = is_adapter_parameter(name)
        p.requires_grad_(is_adapter)
        if is_adapter:
            if p.dtype != torch.float32:
                p.data = p.data.float()
            trainable.append(p)
    return trainable


def named_lora_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights of ``module`` (any registered type) by PEFT parameter name."""
    return {n: p for n, p in module.named_parameters() if is_adapter_parameter(n)}
