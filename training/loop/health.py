"""Two ways a run can go on "succeeding" while producing nothing usable, turned into errors that name the step.

- A NaN or infinite loss: every later step trains on garbage. DeepSpeed's pipeline engine broadcasts
  the loss from the last stage to every stage of its pipeline (after averaging over data-parallel
  replicas), so every rank sees the same value after ``train_batch`` and raises at the same step: no
  extra collective is needed, and the supervisor's fail-fast teardown ends the run with this message.
- A LoRA whose update is still zero when it is saved (every ``lora_B`` is 0, so ``B @ A`` is 0): the
  file would load fine and change nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


class TrainingDiverged(FloatingPointError):
    """The loss stopped being a finite number."""


class LoraUntrained(RuntimeError):
    """The LoRA about to be saved applies no change."""


def check_loss(loss: float, step: int, lr: float) -> None:
    """Raise :class:`TrainingDiverged` naming ``step`` when ``loss`` is NaN or infinite."""
    if math.isfinite(loss):
        return
    raise TrainingDiverged(
        f"The loss is {loss} at step {step}: training diverged (the LoRA weights or their gradients "
        f"overflowed), so every rank stopped at this step and nothing was saved for it. Lower the learning "
        f"rate (it is {lr:g}), add warm-up steps, or clip gradients harder; a checkpoint saved before this "
        "step, if any, is still in the run folder."
    )


def check_lora_update(tensors: Mapping[str, torch.Tensor], step: int, lr: float,
                      zero_suffixes: tuple[str, ...] = (".lora_B.weight",)) -> None:
    """Raise :class:`LoraUntrained` naming ``step`` when every tensor in ``tensors`` whose key ends in one of
    ``zero_suffixes`` (the adapter type's zero-initialised factors, training/adapters/kinds.py) is zero."""
    b = [t for key, t in tensors.items() if key.endswith(zero_suffixes)]
    if not b or any(bool(t.any()) for t in b):
        return
    names = "/".join(sorted({s.strip(".").removesuffix(".weight") for s in zero_suffixes}))
    raise LoraUntrained(
        f"The LoRA is still untrained at step {step}: every {names} weight is exactly 0, so the file would "
        f"change nothing. The learning rate ({lr:g}) is too small for the optimizer to move the weights, or "
        "no gradient reaches the LoRA: raise the learning rate, or check that the LoRA targets are used "
        "by the model."
    )
