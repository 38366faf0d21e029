"""What a family declares about its distilled (few-step) checkpoints, and how a LoRA keeps them few-step.

A timestep-distilled checkpoint (FLUX.1 schnell, Z-Image Turbo, Krea 2 Turbo, SD3.5 Large Turbo) samples in a
handful of steps because its weights were trained away from the plain flow or noise objective. A LoRA
trained on it with that plain objective pulls the weights back towards it: the LoRA learns the subject but
also undoes part of the distillation, and few-step samples degrade.

The method offered is a *training adapter* (a de-distillation LoRA, published for several of these
checkpoints): it is merged into the frozen base while the LoRA trains, so the objective is met by the
adapter, not by the new LoRA, and it is left out of everything the run produces (the saved LoRA, the
Train node's MODEL output and its previews). The saved LoRA then applies to the distilled checkpoint
itself, which keeps its few-step sampling.

A family opts in with a class attribute on its adapter::

    distillation = Distillation(checkpoints="FLUX.1 schnell")

A family without one has no distilled checkpoint this method is known to fit; its distilled models (if
any) still train like the base, and the README says so. Guidance-distilled models (FLUX.1 dev) need no
adapter: they train with a guidance input of their own (the family's options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Distillation:
    """A family's distilled checkpoints that train with a training adapter (for messages and the README)."""

    checkpoints: str  # e.g. "FLUX.1 schnell": named in the Training Adapter node's messages


class DeclaresDistillation(Protocol):
    """A family adapter that declares its distilled checkpoints."""

    name: str
    distillation: Distillation


def distillation_of(adapter: object) -> Distillation | None:
    """The family's declaration, or None for a family that declares no distilled checkpoints."""
    declared = getattr(adapter, "distillation", None)
    return declared if isinstance(declared, Distillation) else None
