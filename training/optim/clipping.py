"""Gradient clipping by the norm of the *whole* LoRA, across every pipeline stage, reproducibly.

DeepSpeed's own clipping on a pipeline without ZeRO clips each stage by its local norm, so a 2-stage
run clips differently from a 1-stage run of the same model. Here each stage computes the squared
norm of each of its gradients, the stages exchange these lists, and every stage sums the same
concatenated list in the same (layer) order, so the global norm, and therefore the whole update, is
bitwise the same for any number of stages. Data-parallel replicas already hold reduced gradients when
the optimizer steps, so only the stages of one replica take part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..loop.collectives import all_gather_objects


def squared_norms(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Per-parameter squared L2 norms of the gradients (0 for a parameter without one), in fp32, on the
    parameters' device: a parameter without a gradient counts as a zero made there, not on the CPU, so
    the stack never mixes devices on a GPU."""
    return torch.stack([p.grad.detach().float().pow(2).sum() if p.grad is not None
                        else torch.zeros((), device=p.device) for p in params]) if params else torch.zeros(0)


def global_grad_norm(params: Sequence[torch.nn.Parameter], group=None) -> torch.Tensor:
    """The L2 norm of all gradients of all stages in ``group`` (stage order = layer order)."""
    local = squared_norms(params).cpu()
    every_stage = torch.cat(all_gather_objects(local, group)) if group is not None else local
    return every_stage.sum().sqrt()


def clip_by_global_norm(params: Sequence[torch.nn.Parameter], max_norm: float, group=None) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before clipping."""
    total = global_grad_norm(params, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return float(total)


class GlobalNormClipping:
    """An optimizer step pre-hook that clips by the global norm (a collective over ``group``)."""

    def __init__(self, max_norm: float, group=None):
        self.max_norm = max_norm
        self.group = group
        self.last_norm: float | None = None

    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.last_norm = clip_by_global_norm(params, self.max_norm, self.group)
