"""LoRAs stacked on the input MODEL (e.g. by the stock LoraLoader) travel to the training process.

The training process rebuilds the base model from its recipe, so whatever the graph patched on top
must be replayed there. Plain LoRA patches are written back as LoRA files (ComfyUI's generic
``<model key>.lora_up/lora_down/alpha`` names, the patch strength folded into alpha), one file per
stacking level, and the recipe lists them; the trainer merges them before training. Patch types that
cannot be expressed that way are refused with the fix, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from ...training.adapters.lora_file import atomic_save
from ...training.spec.options import ModelRecipe


class UnsupportedStackedPatch(ValueError):
    pass


def _lora_tensors(key: str, patch: tuple) -> dict[str, torch.Tensor]:
    from comfy.weight_adapter.lora import LoRAAdapter

    strength_patch, adapter, strength_model, offset, function = patch
    if not isinstance(adapter, LoRAAdapter):
        kind = getattr(adapter, "name", None) or type(adapter).__name__
        raise UnsupportedStackedPatch(
            f"The MODEL carries a {kind} patch on {key}; only plain LoRAs can be merged before "
            "training. Merge it into the model file (e.g. with a model-merge/save node) and train on that file.")
    up, down, alpha, mid, dora_scale, reshape = adapter.weights
    if mid is not None or dora_scale is not None or reshape is not None or offset is not None \
            or function is not None or strength_model != 1.0:
        raise UnsupportedStackedPatch(
            f"The LoRA patch on {key} uses LoCon/DoRA/offsets or a model strength other than 1; merge it into "
            "the model file and train on that file.")
    rank = down.shape[0]
    scaled_alpha = (float(alpha) if alpha is not None else float(rank)) * float(strength_patch)
    stem = key[: -len(".weight")]
    return {f"{stem}.lora_up.weight": up.detach().to("cpu", torch.float32).contiguous(),
            f"{stem}.lora_down.weight": down.detach().to("cpu", torch.float32).contiguous(),
            f"{stem}.alpha": torch.tensor(scaled_alpha)}


def stacked_levels(model) -> int:
    """How many LoRA levels are stacked on the MODEL (the most patches on any one weight); 0 for none."""
    return max((len(patches) for patches in getattr(model, "patches", {}).values()), default=0)


def write_stacked_loras(model, recipe: ModelRecipe, folder: str | Path) -> ModelRecipe:
    """Write the MODEL's LoRA patches into ``folder`` and return the recipe that replays them."""
    levels: list[dict[str, torch.Tensor]] = []
    for key, patches in sorted(getattr(model, "patches", {}).items()):
        if not key.endswith(".weight"):
            raise UnsupportedStackedPatch(f"The MODEL patches {key}; only weight patches can be replayed.")
        for level, patch in enumerate(patches):
            if level == len(levels):
                levels.append({})
            levels[level].update(_lora_tensors(key, patch))
    files = []
    for level, tensors in enumerate(levels):
        digest = hashlib.blake2b(digest_size=8)
        for name in sorted(tensors):
            digest.update(name.encode())
            digest.update(tensors[name].numpy().tobytes())
        # The content digest in the name lets the run's training hash (which sees file names) tell
        # different stacked LoRAs apart, so resume only continues a run with the same stack.
        path = Path(folder) / f"stacked_lora_{level}_{digest.hexdigest()}.safetensors"
        atomic_save(tensors, path, {"source": "LoRAs stacked on the Train node's MODEL input"})
        files.append((str(path), 1.0))
    return dataclasses.replace(recipe, loras=recipe.loras + tuple(files))
