"""What each pipeline stage holds: layer ranges, names, parameter counts, LoRA targets.

DeepSpeed decides the boundaries (by parameter count or uniformly); this module describes them so
the user can see them (``partition.json`` in the run dir and the ``setup`` event), and refuses a
split in which some stage would hold no LoRA target. Every rank builds the same description from
the full layer list, so every rank raises the same error at the same time instead of one rank
failing and the others timing out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

from ..pipelines.targets import layer_targets

PARTITION_FILE = "partition.json"


@dataclass(frozen=True)
class StagePlan:
    stage: int
    first_layer: int
    end_layer: int  # exclusive
    layers: tuple[str, ...]
    parameters: int
    lora_targets: int


def layer_name(layer: object) -> str:
    """A readable name: the ComfyUI module paths a stage layer wraps, else the class or function name."""
    paths = getattr(layer, "comfy_paths", None)
    if paths:
        return "+".join(paths.values())
    return getattr(layer, "__name__", type(layer).__name__).lstrip("_")


def lora_target_count(layer: object, target_regex: str) -> int:
    """LoRA targets in ``layer``, by the one target rule (training/pipelines/targets.py)."""
    return len(layer_targets(layer, target_regex))


def describe(layers: Sequence[object], boundaries: Sequence[int], target_regex: str) -> list[StagePlan]:
    """One :class:`StagePlan` per stage; ``boundaries`` are DeepSpeed's ``parts`` (len = stages + 1)."""
    params = [sum(p.numel() for p in layer.parameters()) if isinstance(layer, nn.Module) else 0 for layer in layers]
    targets = [lora_target_count(layer, target_regex) for layer in layers]
    return [
        StagePlan(stage=s, first_layer=int(a), end_layer=int(b),
                  layers=tuple(layer_name(layers[i]) for i in range(a, b)),
                  parameters=sum(params[a:b]), lora_targets=sum(targets[a:b]))
        for s, (a, b) in enumerate(zip(boundaries[:-1], boundaries[1:], strict=False))
    ]


class StageWithoutLoraError(RuntimeError):
    pass


def require_lora_on_every_stage(plan: Sequence[StagePlan], preset: str) -> None:
    """Refuse a split where a stage has nothing to train (it would have no optimizer and no gradients)."""
    empty = [p for p in plan if p.lora_targets == 0]
    if empty:
        where = "; ".join(f"stage {p.stage} holds only {', '.join(p.layers) or 'no layers'}" for p in empty)
        raise StageWithoutLoraError(
            f"With {len(plan)} pipeline stages, {where}: no LoRA target (preset {preset!r}) on that stage. "
            "Use fewer pipeline stages or the other partition_method."
        )


def write_plan(run_dir: str | Path, plan: Sequence[StagePlan], method: str,
               extra: dict[str, object] | None = None) -> Path:
    path = Path(run_dir) / PARTITION_FILE
    data = {"method": method, "stages": [asdict(p) for p in plan], **(extra or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    tmp.replace(path)
    return path


def log_lines(plan: Sequence[StagePlan]) -> list[str]:
    return [f"stage {p.stage}: layers [{p.first_layer}, {p.end_layer}) {', '.join(p.layers)} "
            f"({p.parameters:,} params, {p.lora_targets} LoRA targets)" for p in plan]

