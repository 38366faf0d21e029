"""Give the kernel back the file pages a rank has finished copying from, while it loads its stage.

A rank loads its stage from the model file's memory-mapped tensors (training/model/stage_weights.py):
each page read to copy a weight stays in the rank's resident set until the mapping goes, so during the
load the rank holds the stage twice (the mapped pages and its copy), and the machine's peak is set
there. ``MADV_PAGEOUT`` (Linux 5.4+) asks the kernel to reclaim a range now. It never changes what the
range reads: a clean file page is read again from the file if touched, an anonymous page is swapped
out or, without swap, left as it is. So it is safe on any tensor, mapped or not, shared or not, and a
kernel without it just keeps the pages (the call fails and is ignored).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable, Iterator, Mapping
from functools import cache

import torch
from torch import nn

MADV_PAGEOUT = 21  # linux/mman.h


@cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def whole_pages(start: int, length: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """``(address, length)`` of the pages wholly inside ``[start, start + length)``: a page shared with a
    neighbouring tensor is left alone (at most two per tensor)."""
    first = -(-start // page) * page
    end = (start + length) // page * page
    return first, max(0, end - first)


def page_out(tensors: Iterable[torch.Tensor]) -> int:
    """Ask the kernel to reclaim the whole pages of these CPU tensors' data; returns the bytes asked for."""
    madvise = _madvise()
    if madvise is None:
        return 0
    asked = 0
    for t in tensors:
        if type(t) is not torch.Tensor or t.device.type != "cpu" or not t.numel() or not t.is_contiguous():
            continue  # a quantized subclass or a view: its bytes are not one plain range
        address, length = whole_pages(t.data_ptr(), t.numel() * t.element_size())
        if length and madvise(address, length, MADV_PAGEOUT) == 0:
            asked += length
    return asked


def _copied_from(module: nn.Module, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sources ``module`` copied from: a loader that assigned a source as the parameter itself (zero-copy
    loading) keeps it, so its pages are still in use and stay."""
    kept = {t.data_ptr() for t in (*module._parameters.values(), *module._buffers.values())
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.device.type == "cpu"}
    return [t for t in sources if t.data_ptr() not in kept]


@contextlib.contextmanager
def paged_out_as_loaded(model: nn.Module) -> Iterator[None]:
    """Within the block, a ``model.load_state_dict`` gives back each module's source pages as soon as the next
    module starts loading (the previous one has copied them by then), so a load holds about one module's
    source pages at a time instead of the whole state dict's."""
    pending: list[tuple[nn.Module, list[torch.Tensor]]] = []

    def flush() -> None:
        for module, sources in pending:
            page_out(_copied_from(module, sources))
        pending.clear()

    def hook_for(module: nn.Module):
        def before_module(state_dict: Mapping[str, torch.Tensor], prefix: str, *_args) -> None:
            flush()
            pending.append((module, [v for k, v in state_dict.items() if k.startswith(prefix)
                                     and "." not in k[len(prefix):] and type(v) is torch.Tensor]))
        return before_module

    hooks = [m._register_load_state_dict_pre_hook(hook_for(m)) for m in model.modules() if m._parameters or m._buffers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        flush()


@contextlib.contextmanager
def paging_out_while_loading() -> Iterator[None]:
    """Within the block, the diffusion model a ComfyUI loader builds gives back its source pages as it loads
    (:func:`paged_out_as_loaded`): ComfyUI's loader then holds the model about once, not the mapped file
    beside it. Attached through torch's module-registration hook to the module a ``BaseModel`` registers as
    ``diffusion_model``, only for the block's duration."""
    import comfy.model_base
    from torch.nn.modules.module import register_module_module_registration_hook

    with contextlib.ExitStack() as stack:
        def on_register(parent: nn.Module, name: str, child: nn.Module) -> None:
            if name == "diffusion_model" and isinstance(parent, comfy.model_base.BaseModel):
                stack.enter_context(paged_out_as_loaded(child))

        stack.callback(register_module_module_registration_hook(on_register).remove)
        yield
