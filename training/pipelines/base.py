"""The contract every model family implements, and the registry that finds the family of a model.

A family adapter turns ComfyUI's diffusion model into an ordered list of stage layers for DeepSpeed's
pipeline (each takes and returns a flat tuple of tensors), says which Linears get LoRA, and packs the
first stage's inputs. Everything else (noise, timesteps, loss, LoRA files) is shared and lives outside.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch
from torch import nn


class StageLayer(nn.Module):
    """A pipeline layer that reuses modules of the ComfyUI model.

    ``comfy_paths`` maps each attribute holding a ComfyUI submodule to that submodule's path inside
    ``diffusion_model``; LoRA key mapping relies on it, so the saved file uses ComfyUI's own names.
    ``swappable`` marks the repeated transformer blocks: block swap (training/offload) may keep their
    frozen weights off the GPU between uses. Embedders and final layers stay resident.
    """

    comfy_paths: dict[str, str]
    swappable: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.comfy_paths = {}

    def adopt(self, attr: str, module: nn.Module, comfy_path: str) -> None:
        """Hold ``module`` as ``self.<attr>`` and remember where it lives in the ComfyUI model."""
        setattr(self, attr, module)
        self.comfy_paths[attr] = comfy_path


@runtime_checkable
class FamilyAdapter(Protocol):
    """What the trainer needs to know about one model family."""

    name: str

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        """The model as an ordered list of layers for a pipeline (flat tuples of tensors in and out)."""
        ...

    def lora_target_regex(self, preset: str) -> str:
        """A regex (PEFT ``target_modules``) selecting the Linears of ``preset`` in the stage layers."""
        ...

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width or 0)`` the model takes: preflight checks the cache against it."""
        ...

    def first_stage_inputs(
        self, noisy: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor, pooled: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """The tuple the first stage layer receives."""
        ...


# ComfyUI model class name (comfy.model_base.<name>) -> module in training.pipelines defining ADAPTER.
_FAMILIES: dict[str, str] = {
    "SD3": "mmdit",
    "Flux": "flux",
}


class UnknownFamilyError(ValueError):
    pass


def known_families() -> list[str]:
    return sorted(_FAMILIES)


def family_name_for(model_base: object) -> str:
    """The registered family of a ComfyUI ``BaseModel`` instance, walking its class hierarchy."""
    for cls in type(model_base).__mro__:
        if cls.__name__ in _FAMILIES:
            return cls.__name__
    raise UnknownFamilyError(
        f"PipeTrainer cannot train {type(model_base).__name__} models yet. "
        f"Supported model families: {', '.join(known_families())}. "
        "Load one of those with 'Load Diffusion Model (train)'."
    )


def adapter_for(family: str) -> FamilyAdapter:
    """The adapter of a registered family name (see :func:`family_name_for`)."""
    if family not in _FAMILIES:
        raise UnknownFamilyError(f"Unknown family {family!r}. Supported: {', '.join(known_families())}.")
    module = importlib.import_module(f"{__package__}.{_FAMILIES[family]}")
    return module.ADAPTER
