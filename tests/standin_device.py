"""A stand-in compute device on CPU machines: the meta device, as the rank's device and as DeepSpeed's.

On a CPU rank DeepSpeed's accelerator device is the CPU, so a ``module.to(<accelerator device>)`` is a
no-op there and no CPU test could see a stage being moved to the GPU (DESIGN.md 5c). Here DeepSpeed's
accelerator is a subclass of its own CPU accelerator whose device is ``meta``; the rank's device is
``meta`` too. :class:`DeviceLedger`, a torch dispatch mode, records every storage that comes into being
there during the set-up: what would take GPU memory on a GPU rank.

The stand-in device holds no values. Reading one back (DeepSpeed's engine reads a parameter count back
at start) gives zeros, and the ledger says so in ``read_back``: only values that do not matter for the
set-up may come back from the device.

:func:`standin_rank` runs the test process as one rank of a 1-rank gloo group with that accelerator, in
process (no rank start-up per test), and restores DeepSpeed's accelerator and the process group after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE = torch.device("meta")


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


@dataclass
class Landed:
    """One storage that came into being on the device: its bytes and the op that made it."""

    nbytes: int
    op: str
    storage: object = field(repr=False)  # kept alive, so its identity is never reused


class DeviceLedger(TorchDispatchMode):
    """Every storage created on the stand-in device while the mode is on (views of one count once)."""

    def __init__(self) -> None:
        super().__init__()
        self.landed: dict[int, Landed] = {}
        self.read_back: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        on_device = [t for t in inputs if t.device == DEVICE]
        if on_device and func is torch.ops.aten._local_scalar_dense.default:
            self.read_back.append(str(func))
            return 0 if not args[0].is_floating_point() else 0.0
        if on_device and func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device") or DEVICE) != DEVICE:
            self.read_back.append(str(func))
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        if func is torch.ops.aten.copy_.default and args[1].device == DEVICE and args[0].device != DEVICE:
            self.read_back.append(str(func))
            return args[0].zero_()
        out = func(*args, **kwargs)
        seen = {t.untyped_storage()._cdata for t in on_device}
        for t in _tensors(out):
            if t.device != DEVICE:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in seen and key not in self.landed:
                self.landed[key] = Landed(storage.nbytes(), str(func), storage)
        return out

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.landed.values())


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, as the ledger keys it."""
    return t.untyped_storage()._cdata


def _meta_accelerator():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class MetaAccelerator(CPU_Accelerator):
        """DeepSpeed's CPU accelerator, except that its device is the stand-in device."""

        def device_name(self, device_index=None):
            return DEVICE.type

        def current_device_name(self):
            return DEVICE.type

    return MetaAccelerator()


@contextlib.contextmanager
def standin_rank(tmp: Path) -> Iterator[None]:
    """This process as rank 0 of a 1-rank gloo group whose DeepSpeed accelerator device is ``meta``."""
    import torch.distributed as dist
    from pipetrainer.patches.deepspeed_shm import disable_shm_comm_build

    disable_shm_comm_build()
    import deepspeed
    import deepspeed.pipe  # noqa: F401  (imported under DeepSpeed's own accelerator: modules that read it at import)
    import deepspeed.runtime.pipe.engine  # noqa: F401
    from deepspeed.accelerator import get_accelerator, set_accelerator

    previous_local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # PipelineModule reads it
    previous = get_accelerator()
    rendezvous = tmp / "standin-rendezvous"
    rendezvous.unlink(missing_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        set_accelerator(_meta_accelerator())
        yield
    finally:
        set_accelerator(previous)
        dist.destroy_process_group()
        rendezvous.unlink(missing_ok=True)
        if previous_local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = previous_local_rank
