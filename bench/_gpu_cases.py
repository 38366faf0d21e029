"""bench/gpu.py's cases: which ones a precision runs, and the run of one (placement, swapper, timed steps).

:func:`cases_for` lists a precision's cases (all / half / no blocks swapped, H2D-only on and off);
:func:`run_case` places the loaded stage (bench/_gpu_model.py) for one case, attaches its swapper
(PipeTrainer's ``BlockSwapper`` or bench/_copy_back_swap.py), trains the warm-up and timed steps and
fills a :class:`Result` with the measurements (bench/_gpu_measure.py). Torch and the pack are imported
inside the functions.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field

from _gpu_measure import forward_flops, host_rss_gib, pinned_gib
from _gpu_model import Bundle, Settings


@dataclass(frozen=True)
class Case:
    precision: str  # a gpu_smoke.PRECISIONS key
    blocks_to_swap: int
    h2d_only: bool = True

    @property
    def label(self) -> str:
        if not self.blocks_to_swap:
            return f"{self.precision} swap 0"
        return f"{self.precision} swap {self.blocks_to_swap} {'H2D-only' if self.h2d_only else 'copy-back'}"


@dataclass
class Result:
    case: Case
    losses: list[float] = field(default_factory=list)  # warm-up and timed steps
    step_s: list[float] = field(default_factory=list)  # timed steps
    setup_s: float = 0.0
    peak_vram_gib: float | None = None
    reserved_vram_gib: float | None = None
    host_rss_gib: float = 0.0
    pinned: dict = field(default_factory=dict)  # torch's pinned-host allocator, GiB (see pinned_gib)
    block_loads: int = 0
    swap_host: tuple = ()  # (pinned GiB, weight GiB) of the swapper's flat host buffers
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def s_per_step(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None


def cases_for(precision: str, swappable: int) -> list[Case]:
    """All blocks swapped, half, none; the swapped ones with H2D-only on, then off.

    Most swapped first: the freshly loaded model is in host memory, so the first case places it the
    way the engine does (swapped blocks pinned straight from host memory, never whole on the device).
    Each case ends with its swapper detached (the whole stage on the device), so a later case with
    fewer swapped blocks copies fewer of them back to the host."""
    out = []
    for n in sorted({swappable, swappable // 2} - {0}, reverse=True):
        out += [Case(precision, n, True), Case(precision, n, False)]
    return [*out, Case(precision, 0)]


def run_case(bundle: Bundle, case: Case, settings: Settings, device) -> Result:
    """Place the stage for the case, attach its swapper, train warm-up + timed steps; leave the stage
    on the device (the swapper detached) for the next case."""
    import torch
    import torch.utils.checkpoint
    from _copy_back_swap import CopyBackSwapper
    from gpu_smoke import train_step
    from pipetrainer.training.adapters.inject import named_lora_parameters
    from pipetrainer.training.offload.block_swap import BlockSwapper
    from pipetrainer.training.offload.placement import last_swappable, move_trainable, place_stage

    result = Result(case)
    cuda = device.type == "cuda"
    swapper = None
    try:
        t0 = time.perf_counter()
        swapped = last_swappable(bundle.layers, case.blocks_to_swap)
        place_stage(bundle.layers, swapped, device)
        move_trainable(swapped, device)
        with torch.no_grad():
            for name, param in named_lora_parameters(bundle.stage).items():
                param.copy_(bundle.lora_init[name])
        params = [p for p in bundle.stage.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        if swapped:
            swapper = (BlockSwapper if case.h2d_only else CopyBackSwapper)(swapped, device).attach()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        result.setup_s = time.perf_counter() - t0
        if bundle.flops is None:
            dm = bundle.patcher.model.diffusion_model
            bundle.flops = forward_flops(bundle.stage, bundle.layers, bundle.inputs, dm.params.hidden_size,
                                         bundle.swappable, settings.tokens, batch=1)
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        for i in range(settings.warmup + settings.steps):
            if i == settings.warmup and cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            result.losses.append(train_step(bundle.layers, bundle.inputs, bundle.target, optimizer, checkpoint))
            if i >= settings.warmup:
                result.step_s.append(time.perf_counter() - t)
                result.host_rss_gib = max(result.host_rss_gib, host_rss_gib())
        if cuda:
            result.peak_vram_gib = torch.cuda.max_memory_allocated(device) / 2**30
            result.reserved_vram_gib = torch.cuda.max_memory_reserved(device) / 2**30
            result.pinned = pinned_gib()
        result.block_loads = swapper.loads if swapper else 0
        if swapper is not None:
            result.swap_host = tuple(b / 2**30 for b in swapper.host_bytes())
        if not all(math.isfinite(v) for v in result.losses):
            result.error = f"non-finite loss: {result.losses}"
    except Exception as exc:  # report every case, then fail at the end
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if swapper is not None:
            swapper.detach()
        if cuda:
            torch.cuda.empty_cache()
    return result
