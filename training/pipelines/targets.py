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

A run's regex is the preset's limited to the LoRA Adapter's ``blocks`` (:func:`run_target_regex`;
numbering in training/adapters/block_range.py): every caller that selects targets for a run goes through it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from ..adapters.block_range import BlockRangeError, resolve_blocks, restrict_regex
from ..quant.layers import is_linear_like

if TYPE_CHECKING:
    from ..spec.options import LoraSpec
    from .base import FamilyAdapter

BLOCK_LIST_PRESET = "all_linear"  # block lists are the lists holding targets of the widest preset


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


def block_lists(family: FamilyAdapter, diffusion_model: nn.Module) -> list[tuple[str, int]]:
    """``(name, length)`` of the model's block lists in definition (= run) order: the ``ModuleList`` /
    ``Sequential`` children of the ComfyUI model holding at least one target of the widest preset, so the
    numbering does not change with the preset."""
    paths = model_targets(diffusion_model, family.lora_target_regex(BLOCK_LIST_PRESET))
    out = []
    for name, child in diffusion_model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and any(p.startswith(name + ".") for p in paths):
            out.append((name, len(child)))
    return out


def chosen_blocks(family: FamilyAdapter, diffusion_model: nn.Module, blocks: str) -> dict[str, frozenset[int]]:
    """``{block list: chosen indices}`` of the ``blocks`` text on this model (raises BlockRangeError)."""
    return resolve_blocks(blocks, block_lists(family, diffusion_model))


def preset_problems(family: FamilyAdapter, preset: str) -> list[str]:
    """A stream preset (``video``, ``audio``) on a family that does not list it in ``stream_presets``."""
    from ..spec.choices import TARGET_PRESETS

    streams = tuple(getattr(family, "stream_presets", ()))
    if preset in TARGET_PRESETS or preset in streams:
        return []
    return [f"The {family.name} model has no {preset!r} LoRA target preset (it is for models with several token "
            f"streams); choose one of {', '.join((*TARGET_PRESETS, *streams))}."]


def preset_regex(family: FamilyAdapter, preset: str) -> str:
    """The family's regex of ``preset``, or of the widest shared preset when the family lacks it: for
    estimates only (sizes, memory), since preflight reports such a preset by name (:func:`preset_problems`)."""
    return family.lora_target_regex(BLOCK_LIST_PRESET if preset_problems(family, preset) else preset)


def run_target_regex(family: FamilyAdapter, diffusion_model: nn.Module, lora: LoraSpec) -> str:
    """The regex a run selects its targets with: the family's preset, limited to ``lora.blocks``.
    Raises :class:`~..block_range.BlockRangeError` (a ValueError naming the model's block counts), or a
    ValueError for a preset the family does not have."""
    problems = preset_problems(family, lora.targets)
    if problems:
        raise ValueError(problems[0])
    regex = family.lora_target_regex(lora.targets)
    if not lora.blocks.strip():
        return regex
    return restrict_regex(regex, chosen_blocks(family, diffusion_model, lora.blocks))


def block_range_problems(family: FamilyAdapter, diffusion_model: nn.Module, lora: LoraSpec) -> list[str]:
    """Preflight: the ``blocks`` text against this model, and a range that selects no target."""
    if not lora.blocks.strip():
        return []
    try:
        regex = run_target_regex(family, diffusion_model, lora)
    except BlockRangeError as exc:
        return [str(exc)]
    if not model_targets(diffusion_model, regex):
        return [f"blocks {lora.blocks!r} selects no Linear of target preset {lora.targets!r}: widen the range or "
                "choose a wider preset."]
    return []


def target_paths_by_block(paths: Mapping[str, object]) -> dict[str, int]:
    """How many of ``paths`` lie under each ``<list>.<index>`` block (for reports and tests)."""
    counts: dict[str, int] = {}
    for path in paths:
        parts = path.split(".")
        key = ".".join(parts[:2]) if len(parts) > 1 and parts[1].isdigit() else parts[0]
        counts[key] = counts.get(key, 0) + 1
    return counts
