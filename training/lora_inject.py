"""LoRA injection with PEFT into the pipeline's stage layers.

Injection is per stage layer with a seed derived from the layer index, so a layer's initial LoRA
weights do not depend on how layers are split into stages (1-stage and N-stage runs start equal).
LoRA parameters are kept in fp32 whatever the base weights are (bf16, fp8). PEFT moves a new adapter
to its base weight's dtype, so on a bf16 or fp8 base its initial values would be rounded to that
dtype; the initial values are therefore drawn here, in fp32 on the CPU, after injection: the same
seed gives bit-identical initial LoRA weights on every base dtype and device.

ComfyUI's per-layer-quantized Linears are not ``nn.Linear``: PEFT cannot wrap them, so they get the
project's :class:`~.quant.layers.QuantLinearLora` (same layout and key names, same initialisation order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .pipelines.targets import layer_targets, peft_target_regex
from .quant.layers import QuantLinearLora, wrap_quant_linears
from .spec import LoraSpec


def inject_lora(layers: Iterable[tuple[int, nn.Module]], target_regex: str, spec: LoraSpec, seed: int) -> int:
    """Add LoRA adapters to the targets of each ``(layer index, layer)``; return how many.

    ``target_regex`` is the family's preset over ComfyUI module paths; :mod:`.pipelines.targets`
    decides which Linears it selects (the same rule partitioning and preflight use), and PEFT is
    given exactly those names. A is drawn like ``nn.Linear``'s default (Kaiming-uniform, a=sqrt(5))
    and B is zero, both fp32.
    """
    from peft import LoraConfig, inject_adapter_in_model

    count = 0
    for index, layer in layers:
        names = list(layer_targets(layer, target_regex))
        if not names:
            continue
        linears = [n for n in names if isinstance(layer.get_submodule(n), nn.Linear)]
        wrap_quant_linears(layer, [n for n in names if n not in linears], spec.rank, spec.alpha, spec.dropout)
        if linears:
            config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                target_modules=peft_target_regex(linears), bias="none", init_lora_weights=False)
            with torch.random.fork_rng(devices=[]):  # PEFT's throw-away default init must not move the global RNG
                inject_adapter_in_model(config, layer)
        _init_fp32(layer, torch.Generator().manual_seed(seed * 10_007 + index))
        count += len(names)
    return count


def _init_fp32(layer: nn.Module, generator: torch.Generator) -> None:
    """fp32 A (Kaiming-uniform, drawn on the CPU from ``generator``) and zero B for every adapter in ``layer``."""
    from peft.tuners.lora import LoraLayer

    adapters = (m for m in layer.modules() if isinstance(m, (LoraLayer, QuantLinearLora)))
    for module in adapters:  # a fixed order: the module tree's
        for adapter in sorted(module.lora_A.keys()):
            lora_a, lora_b = module.lora_A[adapter].float(), module.lora_B[adapter].float()
            init = torch.empty(lora_a.weight.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
            with torch.no_grad():
                lora_a.weight.copy_(init)
                lora_b.weight.zero_()


def freeze_all_but_lora(module: nn.Module) -> list[nn.Parameter]:
    """Freeze the base model, make LoRA weights trainable fp32, and return them."""
    trainable = []
    for name, p in module.named_parameters():
        is_lora = ".lora_A." in name or ".lora_B." in name
        p.requires_grad_(is_lora)
        if is_lora:
            if p.dtype != torch.float32:
                p.data = p.data.float()
            trainable.append(p)
    return trainable


def named_lora_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if ".lora_A." in n or ".lora_B." in n}
