"""LoRA injection with PEFT into the pipeline's stage layers.

Injection is per stage layer with a seed derived from the layer index, so a layer's initial LoRA
weights do not depend on how layers are split into stages (1-stage and N-stage runs start equal).
LoRA parameters are kept in fp32 whatever the base weights are (bf16, fp8).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .spec import LoraSpec


def inject_lora(layers: Iterable[tuple[int, nn.Module]], target_regex: str, spec: LoraSpec, seed: int) -> int:
    """Add LoRA adapters to the matching Linears of each ``(layer index, layer)``; return how many."""
    from peft import LoraConfig, inject_adapter_in_model

    count = 0
    for index, layer in layers:
        names = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and _full_match(target_regex, n)]
        if not names:
            continue
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                            target_modules=target_regex, bias="none")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 10_007 + index)
            inject_adapter_in_model(config, layer)
        count += len(names)
    return count


def _full_match(regex: str, name: str) -> bool:
    import re

    return re.fullmatch(regex, name) is not None


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
