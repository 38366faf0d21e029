"""Prodigy's step-size estimate over every rank of the run, not one pipeline stage's share.

Prodigy estimates its step size d from two sums over all trained parameters (a numerator of
gradient·(p0 - p) terms and a denominator of |s| terms); d is their ratio. Each pipeline stage has its
own optimizer, so a plain Prodigy on a stage sums only that stage's LoRA and finds another d than a
1-stage run of the same model (and every stage a different one). prodigyopt has the cure built in:
``fsdp_in_use=True`` all-reduces the two sums over the default process group before dividing.

Summing over *all* ranks is right for this trainer's layouts:

- stages of one replica hold disjoint parameters: their sums add up to the whole model's;
- data-parallel replicas hold equal parameters and (DeepSpeed reduces them before the optimizer steps)
  equal gradients: R replicas multiply numerator and denominator alike by R, so the ratio is unchanged
  (ZeRO partitions, if ever used, would add up to the whole as stages do);
- DeepSpeed's pipeline schedule ends every train_batch with one OptimizerStep on every rank, so the
  all-reduce never waits for a rank that does not come; a stage without gradients still takes part
  (the fsdp path skips prodigyopt's early return).

Two details of prodigyopt 1.1.x are adapted without touching the package or any global state: its
all-reduce buffer is ``torch.zeros(2).cuda()``, which fails on the CPU/gloo ranks the tests (and CPU
runs) use, and is float32, which would round the sums that a 1-rank run keeps in float64. The step runs
prodigyopt's own code with its module's ``torch`` name resolved to a view that makes that buffer a
float64 tensor on the collective's device (the GPU for NCCL, the CPU for gloo). Afterwards the group
values (``d`` and its sums) become Python floats again, as a 1-rank run has them, so step events,
checkpoints and a resumed run see the same types.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.distributed as dist
from prodigyopt import Prodigy

# Names prodigyopt 1.1.x's step uses for its all-reduce; a release without them gets a clear error.
_EXPECTED_NAMES = frozenset({"zeros", "cuda", "dist", "all_reduce"})
_GROUP_SUMS = ("d", "d_max", "d_hat", "d_numerator", "d_denom")


class _OnCollectiveDevice(torch.Tensor):
    """The all-reduce buffer: ``.cuda()`` hands back the plain tensor, already where the collective needs it."""

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ARG002 - the buffer is already placed
        return self.as_subclass(torch.Tensor)


class _TorchForStep:
    """``torch`` as prodigyopt's step sees it: the same module, except ``zeros`` (its only use there is
    the all-reduce buffer) gives a float64 buffer on ``device``."""

    def __init__(self, device: torch.device):
        self._device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, *size: int, **_: Any) -> torch.Tensor:
        return torch.zeros(*size, dtype=torch.float64, device=self._device).as_subclass(_OnCollectiveDevice)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prodigy_step_on(device: torch.device) -> types.FunctionType:
    """prodigyopt's own ``Prodigy.step`` code, with its module's ``torch`` resolved to :class:`_TorchForStep`."""
    step = inspect.unwrap(Prodigy.step)  # torch's optimizer-hook wrapper, if any, stays on our class
    missing = _EXPECTED_NAMES - set(step.__code__.co_names)
    if missing:
        raise RuntimeError(
            "This prodigyopt release changed how Prodigy sums its step-size estimate across ranks "
            f"(no {', '.join(sorted(missing))} in its step): install prodigyopt 1.1.2 "
            "('pip install prodigyopt==1.1.2'), or train Prodigy with 1 pipeline stage and 1 GPU.")
    names = dict(step.__globals__, torch=_TorchForStep(device))
    return types.FunctionType(step.__code__, names, step.__name__, step.__defaults__, step.__closure__)


class RankSummedProdigy(Prodigy):
    """Prodigy whose d comes from the sums over every rank (see the module docstring). Needs an
    initialised default process group; every rank must call :meth:`step` once per optimizer step."""

    def __init__(self, params: Any, **settings: Any):
        super().__init__(params, fsdp_in_use=True, **settings)
        self._step_code = _prodigy_step_on(_collective_device())

    def step(self, closure: Any = None) -> Any:
        loss = self._step_code(self, closure)
        for group in self.param_groups:
            for key in _GROUP_SUMS:
                if isinstance(group.get(key), torch.Tensor):
                    group[key] = group[key].item()  # float64 -> the same Python float
        return loss
