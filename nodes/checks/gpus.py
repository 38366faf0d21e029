"""The Train node's ``gpus`` input: which GPUs the ranks run on, checked before anything starts.

GPU numbers are ComfyUI's (torch's device numbers in the ComfyUI process, i.e. after ``--cuda-device``
or ``CUDA_VISIBLE_DEVICES``): "0" is the first GPU ComfyUI may use. Empty means ComfyUI's devices
0..N-1 for N ranks. A listed set must give exactly one GPU per rank (pipeline_stages x data_parallel):
a GPU left out or added silently would be a surprise either way. Parsing and the messages are pure
functions over :class:`GpuInfo` values, so they are tested without a GPU; :func:`visible_gpus` reads
the facts from torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class GpuInfo:
    """One GPU ComfyUI may use, with its memory when read (bytes)."""

    index: int  # ComfyUI's device number
    name: str
    free_bytes: int
    total_bytes: int
    memory_read: bool = True  # False: free memory unknown (no NVML, and no CUDA context here to ask)

    @property
    def used_bytes(self) -> int:
        return max(0, self.total_bytes - self.free_bytes)

    def describe(self) -> str:
        if not self.memory_read:
            return (f"GPU {self.index} ({self.name}: {self.total_bytes / GIB:.1f} GiB; free memory not read: "
                    "install pynvml to see it)")
        return (f"GPU {self.index} ({self.name}: {self.free_bytes / GIB:.1f} GiB free, "
                f"{self.used_bytes / GIB:.1f} GiB used of {self.total_bytes / GIB:.1f} GiB)")


def parse_gpus(text: str) -> tuple[tuple[int, ...], list[str]]:
    """``"0,1, 3"`` -> ``(0, 1, 3)``; spaces or commas separate; with every problem of the text."""
    tokens = [t for t in text.replace(",", " ").split() if t]
    bad = [t for t in tokens if not t.isdigit()]
    if bad:
        return (), [f"gpus {text!r} is not a list of GPU numbers: {', '.join(repr(b) for b in bad)}. "
                    "Write e.g. '0,1' (ComfyUI's GPU numbers), or leave it empty for the first GPUs."]
    gpus = tuple(int(t) for t in tokens)
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:
        return (), [f"gpus {text!r} lists GPU {', '.join(map(str, twice))} more than once: each rank needs its own GPU."]
    return gpus, []


def _visible_text(visible: Sequence[GpuInfo]) -> str:
    if not visible:
        return "ComfyUI sees no GPU"
    return "ComfyUI sees " + "; ".join(g.describe() for g in visible)


def select_gpus(requested: Sequence[int], ranks: int, visible: Sequence[GpuInfo]) -> tuple[tuple[int, ...], list[str]]:
    """The GPU of each rank (rank order) and the problems; every message names the GPUs and their memory."""
    by_index = {g.index: g for g in visible}
    missing = [g for g in requested if g not in by_index]
    if missing:
        return (), [f"gpus lists GPU {', '.join(map(str, missing))}, which ComfyUI cannot see. {_visible_text(visible)}. "
                    "Use those numbers (they count after --cuda-device / CUDA_VISIBLE_DEVICES)."]
    if not requested:
        if ranks > len(visible):
            return (), [f"pipeline_stages x data_parallel = {ranks} ranks need {ranks} GPUs (one per rank); "
                        f"{_visible_text(visible)}. Lower pipeline_stages or data_parallel, or start ComfyUI with "
                        "more GPUs visible."]
        return tuple(g.index for g in visible[:ranks]), []
    if len(requested) != ranks:
        listed = "; ".join(by_index[g].describe() for g in requested)
        fix = (f"list {ranks} GPUs" if len(requested) < ranks else
               f"list {ranks}, or raise pipeline_stages / data_parallel to use all {len(requested)}")
        return (), [f"gpus lists {len(requested)} GPU(s) ({listed}) but pipeline_stages x data_parallel = {ranks} "
                    f"ranks need exactly {ranks}, one per rank: {fix}."]
    return tuple(requested), []


def cpu_gpus_problems(text: str) -> list[str]:
    """``gpus`` set while ComfyUI runs on the CPU: say so rather than ignore it."""
    if not text.strip():
        return []
    return [f"gpus is {text!r} but ComfyUI runs on the CPU (--cpu, or no CUDA GPU): training runs there too. "
            "Clear gpus, or start ComfyUI on a GPU."]


def gpu_table(gpus: Sequence[int], visible: Sequence[GpuInfo]) -> str:
    """One line for the run log: which GPU each rank gets, with its memory before the run."""
    by_index = {g.index: g for g in visible}
    return "GPUs: " + "; ".join(f"rank {r} -> {by_index[g].describe() if g in by_index else f'GPU {g}'}"
                                for r, g in enumerate(gpus))


def visible_gpus(cuda=None) -> list[GpuInfo]:
    """The CUDA GPUs this (ComfyUI) process may use, with free / total memory (``cuda``: ``torch.cuda``).

    Used memory comes from NVML (what nvidia-smi shows) where torch can reach it. Asking CUDA instead
    (``mem_get_info``) opens a context on the GPU asked, memory the ranks then lack for the whole run: so
    without NVML only a GPU this process already computes on is asked (ComfyUI's own device, whose
    context exists), and the others are listed with their size and "free memory not read".
    """
    if cuda is None:
        import torch

        cuda = torch.cuda
    own = cuda.current_device() if cuda.is_initialized() else None
    out = []
    for i in range(cuda.device_count()):
        props = cuda.get_device_properties(i)
        total = int(props.total_memory)
        try:
            out.append(GpuInfo(i, props.name, total - int(cuda.device_memory_used(i)), total))
        except Exception:  # no pynvml / amdsmi, or an old torch
            if i == own:
                free, total = (int(v) for v in cuda.mem_get_info(i))
                out.append(GpuInfo(i, props.name, free, total))
            else:
                out.append(GpuInfo(i, props.name, total, total, memory_read=False))
    return out
