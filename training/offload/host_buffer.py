"""One flat host buffer per swapped block: its frozen tensors become views into a single allocation.

Why: ``Tensor.pin_memory()`` goes through torch's caching host allocator, which rounds every
allocation up to a power of two. Pinning a swapped block tensor by tensor held ~35 GB of pinned
memory for 23.8 GB of swapped weights (issue #9); one ``pin_memory()`` per block would still round
each block up (a 680 MB Flux double block takes 1 GB). Here a block's frozen tensors are copied into
one ordinary host allocation of exactly their total size (each tensor starting on an ``ALIGN``-byte
boundary), and that allocation is page-locked in place with ``cudaHostRegister`` (what
torch.distributed's checkpoint stager does for its staging buffers): pinned bytes = weight bytes plus
at most ``ALIGN - 1`` bytes per tensor.

Without CUDA nothing is pinned and the layout is the same, so the layout, the sharing of one buffer
and the forward through the views are tested on CPU; only the registration needs a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's element size (so typed views are legal)


def is_packable(tensor: torch.Tensor) -> bool:
    """Plain dense tensors only: a tensor subclass (e.g. ComfyUI-GGUF's quantized weights) carries state a
    typed view of a byte buffer would lose; the swapper packs the plain tensors under it instead and rebuilds
    the subclass around their views (subclass.py)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided


def buffer_layout(tensors: Sequence[torch.Tensor], align: int = ALIGN) -> tuple[list[int], int]:
    """Byte offset of each tensor in the flat buffer, and the buffer's size (each start aligned)."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


class HostBuffer:
    """The host copies of one block's frozen tensors, as views (``views[i]`` has ``tensors[i]``'s
    dtype, shape and values, contiguous) into one uint8 ``buffer``; page-locked when ``pin`` is set."""

    def __init__(self, tensors: Sequence[torch.Tensor], pin: bool = False) -> None:
        offsets, total = buffer_layout(tensors)
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.views: list[torch.Tensor] = []
        with torch.no_grad():
            for t, start in zip(tensors, offsets, strict=True):
                nbytes = t.numel() * t.element_size()
                view = self.buffer[start:start + nbytes].view(t.dtype).view(t.shape)
                view.copy_(t.detach())
                self.views.append(view)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.pinned = False
        if pin and total:
            _register(self.buffer)
            self.pinned = True

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def release(self) -> None:
        """Unpin the buffer (call once nothing copies from it any more; the memory itself stays valid
        while views are referenced)."""
        if self.pinned:
            _unregister(self.buffer)
            self.pinned = False


def _register(buffer: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if code != 0:
        raise RuntimeError(f"Pinning {buffer.numel() / 2**20:.0f} MiB of host memory for block swap failed "
                           f"(cudaError {code}): the machine may limit locked memory (ulimit -l); lower "
                           "blocks_to_swap or raise the limit.")


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
