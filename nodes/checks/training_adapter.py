"""A training adapter on the Train node's MODEL: what the Training Adapter node attaches, its checks, its replay.

The adapter (a de-distillation LoRA for a few-step checkpoint; training/pipelines/distillation.py says why)
travels as an attachment of the MODEL, never as a patch: every node after the Training Adapter node, Train
LoRA's MODEL output and previews included, samples the distilled checkpoint itself, while the training process
merges the adapter into the frozen base (the recipe lists it first among the LoRAs merged before training)
and saves only the trained LoRA.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from ...training.pipelines.base import adapter_for
from ...training.pipelines.distillation import distillation_of
from ...training.quant.stacking import recipe_base_kind, stacked_lora_problem
from ...training.spec.options import ModelRecipe

ADAPTER_KEY = "pipetrainer.training_adapter"
_NAMED = 5  # unmapped keys named in a problem; the rest are counted
# The names that follow a module's key in LoRA files ComfyUI loads (lora.py), longest first.
_KEY_SUFFIXES = (".lora_up.weight", ".lora_down.weight", ".lora_mid.weight", ".lora_A.weight", ".lora_B.weight",
                 ".alpha", ".dora_scale", ".diff", ".diff_b", ".set_weight")


@dataclasses.dataclass(frozen=True)
class TrainingAdapter:
    """A LoRA file merged into the base while training only; ``digest`` pins its bytes (training hash)."""

    path: str
    strength: float
    digest: str


def attach_training_adapter(model, adapter: TrainingAdapter):
    """A clone of ``model`` carrying ``adapter`` (its weights untouched: nothing samples with the adapter)."""
    clone = model.clone()
    clone.set_attachments(ADAPTER_KEY, adapter)
    return clone


def training_adapter_of(model) -> TrainingAdapter | None:
    return getattr(model, "attachments", {}).get(ADAPTER_KEY)


def training_adapter_problems(model, family: str, recipe: ModelRecipe | None) -> list[str]:
    """Why the MODEL's training adapter cannot be used with this family, file and base, with the fix."""
    adapter = training_adapter_of(model)
    if adapter is None:
        return []
    name = Path(adapter.path).name
    declared = distillation_of(adapter_for(family))
    if declared is None:
        return [f"The training adapter {name} is for distilled checkpoints, and PipeTrainer knows none of "
                f"{family} models that train with one: remove the Training Adapter node (a {family} LoRA "
                "trains on the model as loaded). To merge a LoRA into the base for good, stack it with "
                "LoraLoaderModelOnly instead."]
    if not os.path.isfile(adapter.path):
        return [f"The training adapter {name} is gone from the loras folder: restore it, or pick another in "
                "the Training Adapter node."]
    problems = []
    unmapped = unmapped_keys(adapter.path, model)
    if unmapped:
        shown = ", ".join(unmapped[:_NAMED]) + (f" and {len(unmapped) - _NAMED} more" if len(unmapped) > _NAMED else "")
        problems.append(f"The training adapter {name} has {len(unmapped)} key(s) this {family} model does not "
                        f"have ({shown}): it is not an adapter of this model. Pick the de-distillation adapter "
                        f"made for {declared.checkpoints}.")
    if recipe is not None:
        stacked = stacked_lora_problem(recipe_base_kind(recipe.loader, recipe.path), 1)
        if stacked:
            problems.append(f"The training adapter {name} cannot be merged into this quantized base (scaled fp8, "
                            "per-layer quantized or GGUF) before training: train on the model's full-precision or "
                            "plain fp8 file.")
    return problems


def unmapped_keys(path: str, model) -> list[str]:
    """The adapter's module keys that ComfyUI's LoRA key map of ``model`` does not take (header read only)."""
    import comfy.lora
    from safetensors import safe_open

    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
    stems = {_stem(key) for key in keys}
    return sorted(stem for stem in stems if stem not in key_map)


def _stem(key: str) -> str:
    for suffix in _KEY_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key.rsplit(".", 1)[0]


def with_training_adapter(model, recipe: ModelRecipe, folder: str | Path) -> ModelRecipe:
    """The recipe with the MODEL's training adapter merged first, from a link in the run ``folder``.

    The link is named by the file's digest: the training hash sees file names, so a resume only continues a
    run trained with the same adapter bytes, and the run keeps its adapter if the loras folder changes."""
    adapter = training_adapter_of(model)
    if adapter is None:
        return recipe
    target = Path(folder) / f"training_adapter_{adapter.digest[:16]}.safetensors"
    if not target.exists():
        try:
            os.link(adapter.path, target)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(adapter.path, target)
    return dataclasses.replace(recipe, loras=((str(target), adapter.strength), *recipe.loras))
