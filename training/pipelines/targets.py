"""The one rule for "which Linear gets a LoRA", for injection, partitioning and preflight alike.

A family's preset is a regex over ComfyUI module paths (``diffusion_model``-relative, e.g.
``blocks.3.self_attn.q``): the names the LoRA file is keyed by. A module is a target when it is an
``nn.Linear`` (ComfyUI's cast and fp8 Linears subclass it; PEFT injects into those) or ComfyUI's
per-layer-quantized Linear (a plain module; training/quant/layers.py wraps it) whose
ComfyUI path fully matches. Applied to the whole ComfyUI model (:func:`model_targets`: preflight's
parameter count, no stage layer built) or to one stage layer (:func:`layer_targets`: injection and
the stage plan), it selects the same modules, since stage layers adopt ComfyUI's modules under
their ComfyUI paths (``StageLayer.comfy_paths``); a module a layer holds without adopting it (a
parameter-free helper such as Flux's ``pe_embedder``) is never a target.
"""

from __future__ import annotations

import re

from torch import nn

from ..quant.layers import is_linear_like


def is_lora_target(target_regex: str, comfy_path: str | None, module: nn.Module) -> bool:
    return comfy_path is not None and is_linear_like(module) and re.fullmatch(target_regex, comfy_path) is not None


def layer_targets(layer: object, target_regex: str) -> dict[str, str]:
    """``{name inside the layer: ComfyUI module path}`` of the layer's LoRA targets, in module order."""
    if not isinstance(layer, nn.Module) or not hasattr(layer, "comfy_path"):
        return {}
    out = {}
    for name, module in layer.named_modules():
        path = layer.comfy_path(name) if name else None
        if is_lora_target(target_regex, path, module):
            out[name] = path
    return out


def model_targets(diffusion_model: nn.Module, target_regex: str) -> dict[str, nn.Linear]:
    """``{ComfyUI module path: Linear}`` of every LoRA target of the whole ComfyUI model."""
    return {name: module for name, module in diffusion_model.named_modules()
            if name and is_lora_target(target_regex, name, module)}


def peft_target_regex(names: list[str]) -> str:
    """A PEFT ``target_modules`` regex (PEFT full-matches it) selecting exactly ``names`` in a layer."""
    return "(" + "|".join(re.escape(n) for n in names) + ")"
