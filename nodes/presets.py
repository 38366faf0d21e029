"""Train LoRA's ``preset`` input: a family's hardware preset (training/pipelines/presets.py) applied to a run.

The preset's values replace the LoRA Adapter's rank and alpha, the Optimizer's optimizer and rate and Train
LoRA's own batch size, checkpointing and dtype; every value it changes is named on the Train node before
step 0 (and in the run log), with the example config it follows. A preset of another family is refused
with the presets the model's family has. What the preset cannot set from here is said, not done: the
source's quantized base (the loader's ``weight_dtype``) and its resolutions (the Dataset's).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..training.pipelines.base import adapter_for, known_families
from ..training.pipelines.presets import Preset
from ..training.spec.options import LoraSpec, OptimizerSpec

NO_PRESET = "none"


def presets_of(family: str) -> tuple[Preset, ...]:
    """The presets ``family``'s adapter declares itself (a relative's adapter class does not inherit them:
    FLUX.1's are not FLUX.2's)."""
    return tuple(vars(type(adapter_for(family))).get("presets", ()))


@cache
def _by_label() -> dict[str, tuple[str, Preset]]:
    return {p.label: (family, p) for family in known_families() for p in presets_of(family)}


def preset_choices() -> list[str]:
    """``none`` and every family's presets, as Train LoRA's ``preset`` combo lists them."""
    return [NO_PRESET, *_by_label()]


@dataclass(frozen=True)
class Applied:
    lora: LoraSpec
    optimizer: OptimizerSpec
    settings: dict[str, Any]
    problems: list[str]
    notes: list[str]


def _changed(name: str, value: object, own: object, owner: str) -> str | None:
    return None if value == own else f"  {name} {value!r} ({owner}'s {own!r} set aside)"


def base_storage(model: Any) -> str:
    """The dtype most of the diffusion model's weights are stored in (``float8_e4m3fn``, ``bfloat16``, ...)."""
    sizes: Counter[str] = Counter()
    for p in model.model.diffusion_model.parameters():
        sizes[str(p.dtype).removeprefix("torch.")] += p.numel()
    return sizes.most_common(1)[0][0] if sizes else "unknown"


def apply_preset(label: str, family: str, model: Any, lora: LoraSpec, optimizer: OptimizerSpec,
                 settings: Mapping[str, Any]) -> Applied:
    """The run's LoRA, optimizer and Train LoRA settings with preset ``label`` applied, for a model of
    ``family``; problems when it is another family's (or unknown), notes naming each change."""
    if label in (None, NO_PRESET):
        return Applied(lora, optimizer, dict(settings), [], [])
    found = _by_label().get(label)
    if found is None or found[0] != family:
        own = ", ".join(p.label for p in presets_of(family)) or "none yet"
        whose = f"a {found[0]} preset" if found else "not a preset of this version"
        return Applied(lora, optimizer, dict(settings), [
            f"preset {label!r} is {whose}, but the model is {family}: choose one of its presets ({own}) or none."], [])
    preset = found[1]
    changes = [
        _changed("rank", preset.rank, lora.rank, "LoRA Adapter"),
        _changed("alpha", float(preset.rank), lora.alpha, "LoRA Adapter"),
        _changed("optimizer", preset.optimizer, optimizer.name, "Optimizer"),
        _changed("lr", preset.lr, optimizer.lr, "Optimizer"),
        *(_changed(name, value, settings.get(name), "Train LoRA") for name, value in preset.settings().items()),
    ]
    notes = [f"preset {label!r} follows {preset.source}:", *(c for c in changes if c)]
    if len(notes) == 1:
        notes[0] += " every value it sets is already so."
    stored = base_storage(model)
    if preset.quantized_base and not stored.startswith(("float8", "int", "uint")):
        notes.append(f"  its source trains a {preset.quantized_base} base; this one is stored in {stored}: load it "
                     "with weight_dtype fp8_e4m3fn for about that memory, or keep blocks_to_swap at -1 (auto).")
    notes.append(f"  its source trains at {' / '.join(map(str, preset.resolutions))} px (the Dataset's resolutions "
                 "are not changed).")
    return Applied(dataclasses.replace(lora, rank=preset.rank, alpha=float(preset.rank)),
                   dataclasses.replace(optimizer, name=preset.optimizer, lr=preset.lr),
                   {**settings, **preset.settings()}, [], notes)
