"""Every collective the training loop itself calls, written once so it is right on gloo and on NCCL.

NCCL carries CUDA tensors only: a CPU tensor all-reduced on a group whose backend is NCCL fails
("No backend type associated with device type cpu"), which would end every multi-GPU run after its
first step. So a tensor collective here takes the rank's compute device and builds its tensor there.
Object collectives pickle into a byte tensor that torch places on ``torch.cuda.current_device()`` for
NCCL, which training/process/rank.py sets (``torch.cuda.set_device``) before the process group starts.

Nothing else in ``training/`` calls ``torch.distributed`` communication functions:
tests/test_collectives.py scans the package for them, and runs these functions on real gloo ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def any_rank_requests_stop(local: bool, group, device: torch.device) -> bool:
    """True on every rank of ``group`` if any rank passes ``local=True`` (an all-reduce of a 0/1 flag).

    Every rank must take the same decision at the same step, or the ranks that carry on block in the
    next pipeline exchange until the process-group timeout.
    """
    if _world(group) == 1:
        return local
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def all_gather_objects(obj: Any, group) -> list[Any]:
    """``obj`` of every rank of ``group``, in group-rank order (``[obj]`` without a process group)."""
    world = _world(group)
    if world == 1:
        return [obj]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, obj, group=group)
    return parts


def gather_objects_to_rank0(obj: Any) -> list[Any] | None:
    """``obj`` of every rank of the world, in rank order, on rank 0; ``None`` on the other ranks."""
    world = _world(None)
    if world == 1:
        return [obj]
    parts: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def broadcast_trainable(module: torch.nn.Module, source: int, group, device: torch.device) -> int:
    """Broadcast ``module``'s trainable parameters from global rank ``source``; return how many.

    Used at engine start-up instead of DeepSpeed's broadcast of every parameter: frozen base weights
    are loaded by each replica from the model file, so only the LoRA needs to agree. Each tensor is
    sent from ``device`` (where the trainer placed the LoRA; NCCL needs it there).
    """
    if _world(group) == 1:
        return 0
    count = 0
    for param in module.parameters():
        if param.requires_grad:
            tensor = param.data.to(device)  # the parameter's own storage when it is on the device
            dist.broadcast(tensor, source, group=group)
            if tensor.data_ptr() != param.data.data_ptr():
                param.data.copy_(tensor)
            count += 1
    return count


def loading_group(timeout_s: float):
    """A gloo group whose timeout covers loading the model, for :func:`wait_for_all_ranks`.

    Reading a stage's share of a 24 GB file, N ranks at once, can take longer than a training step
    may; it must not count against the training collectives' timeout.
    """
    from datetime import timedelta

    if _world(None) == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def wait_for_all_ranks(group) -> None:
    """Block until every rank of ``group`` arrives (a barrier carrying no tensor of ours)."""
    if group is not None and _world(group) > 1:
        dist.barrier(group=group)
