"""The memory plan behind ``blocks_to_swap`` auto: the fewest swapped blocks with which each stage fits its GPU.

Pure arithmetic over byte counts (no torch): the Train node reads the facts from ComfyUI's model, the
cache and the GPUs (nodes/checks/memory.py) and resolves "auto" into a number before the run starts.
Tests state capacities and check the chosen number and the refusal.

The estimate of one pipeline stage's peak GPU memory with its last ``N`` swappable blocks swapped
(the blocks :func:`~.placement.last_swappable` picks)::

    weights     = rest + (blocks not swapped) + in flight
                  in flight = min(N, interval + 1) x the largest swapped block with gradient
                  checkpointing: the block computing and the one prefetched, and in backward the
                  ``checkpoint_interval`` blocks of the recomputed chunk, whose device copies live until
                  its backward (block_swap.py). Without checkpointing autograd keeps every swapped
                  block's device copy until its backward, so swap saves nothing: in flight = all swapped.
    lora        = LoRA parameters x (4 fp32 weight + 4 fp32 gradient + the optimizer's state, + 4 for EMA)
    activations = with H = tokens x batch_size x hidden x compute-dtype bytes (one hidden state) and
                  A = ACTIVATION_WIDTHS x H (what one transformer block saves for backward):
                  checkpointing on:  in_flight x ceil(layers / interval) x H  +  (interval + 1) x A
                  checkpointing off: in_flight x blocks x A  +  A
                  with in_flight = min(stages - stage, gradient_accumulation) micro-batches (DeepSpeed's
                  1F1B schedule holds that many on a stage before its first backward), the "+ ... A" the
                  chunk recomputed in backward and its gradients, plus 2 x max(2, in_flight) x H of
                  pipeline send/receive buffers when there are several stages.
    need        = (weights + lora + activations) x (1 + margin fraction) + margin fixed bytes

Assumptions: attention is memory-efficient (PyTorch SDPA, xformers, flash: no tokens^2 term; the math
fallback needs far more); a block saves about 18 hidden-width tensors per token (attention q, k, v and
output, two norms and modulations, an MLP of ratio 4 and its activation); text tokens pass every block
(true for joint-attention families, an upper bound for cross-attention ones); LoRA's own rank-wide
activations are left out (rank << hidden); the fixed margin holds the rank's CUDA context, cuBLAS
workspace and NCCL buffers, the fraction the caching allocator's fragmentation and what the estimate
misses. Free memory is what the GPU reports once every process's share (ComfyUI's included) is taken
out, plus what ComfyUI's loaded models hold there (the Train node unloads them before the launch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..spec.choices import OPTIMIZERS

GIB = 2**30
ACTIVATION_WIDTHS = 18  # hidden-width tensors one block saves per token for backward (see above)
LORA_WEIGHT_AND_GRAD_BYTES = 8  # fp32 weight + fp32 gradient per LoRA parameter
EMA_BYTES = 4  # fp32 moving average per LoRA parameter (OptimizerSpec.ema_decay > 0)
# Optimizer state per LoRA parameter (fp32 unless said): two moments for AdamW and schedule-free AdamW,
# two 8-bit ones for AdamW8bit, one momentum for Lion, CAME's momentum (its second moments are factored),
# Adafactor's factored second moment (rows + columns; no momentum), Prodigy's four (two moments, s, p0).
OPTIMIZER_STATE_BYTES = {"AdamW": 8, "AdamW8bit": 2, "Adafactor": 1, "Prodigy": 16, "Lion": 4, "CAME": 4,
                         "AdamWScheduleFree": 8}
assert set(OPTIMIZER_STATE_BYTES) == set(OPTIMIZERS), "every optimizer needs its state size here"
DEFAULT_FIXED_BYTES = GIB  # per rank: CUDA context, cuBLAS workspace, NCCL buffers
DEFAULT_FRACTION = 0.10


def lora_bytes_per_param(optimizer: str, ema: bool = False) -> int:
    """GPU bytes one trained LoRA parameter costs: weight, gradient, ``optimizer``'s state, EMA copy."""
    return LORA_WEIGHT_AND_GRAD_BYTES + OPTIMIZER_STATE_BYTES.get(optimizer, 16) + (EMA_BYTES if ema else 0)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class GpuBudget:
    """One GPU's memory for a rank: ``free_bytes`` as read (every process's share, ComfyUI's own included,
    already taken out) plus ``releasable_bytes``, ComfyUI's loaded models there that the Train node
    unloads before it starts the run."""

    label: str  # e.g. "GPU 0 (NVIDIA H100)"
    free_bytes: int
    releasable_bytes: int = 0

    @property
    def available_bytes(self) -> int:
        return self.free_bytes + self.releasable_bytes


@dataclass(frozen=True)
class StageWeights:
    """What one pipeline stage holds: its swappable blocks' frozen bytes in forward order, every other
    frozen byte (embedders, final layer, layers that never swap), its layer count and LoRA parameters.
    Bytes are as the rank stores them (the compute dtype, or the quantized size of fp8 / GGUF weights)."""

    block_bytes: tuple[int, ...]
    rest_bytes: int
    layers: int
    lora_params: int

    @property
    def blocks(self) -> int:
        return len(self.block_bytes)


@dataclass(frozen=True)
class Workload:
    """What sets the activations and the LoRA's share: the largest example's tokens through a block
    (image or video patches, text, reference images), the blocks' hidden width, and the run's settings."""

    tokens: int
    hidden: int
    batch_size: int = 1
    grad_accum: int = 1
    stages: int = 1
    dtype_bytes: int = 2  # compute dtype: 2 for bf16, 4 for fp32
    checkpointing: bool = True
    checkpoint_interval: int = 1
    lora_bytes_per_param: int = lora_bytes_per_param("AdamW")

    @property
    def hidden_state_bytes(self) -> int:
        return self.tokens * self.batch_size * self.hidden * self.dtype_bytes


@dataclass(frozen=True)
class Margin:
    fixed_bytes: int = DEFAULT_FIXED_BYTES
    fraction: float = DEFAULT_FRACTION


@dataclass(frozen=True)
class StageNeed:
    """One stage's estimated peak, by part (bytes)."""

    weights: int
    lora: int
    activations: int
    margin: int

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations + self.margin


def stage_need(stage: int, held: StageWeights, work: Workload, margin: Margin, swapped: int) -> StageNeed:
    """The estimate of stage ``stage``'s peak with its last ``swapped`` blocks swapped (module docstring)."""
    swapped = max(0, min(swapped, held.blocks))
    kept, gone = held.block_bytes[:held.blocks - swapped], held.block_bytes[held.blocks - swapped:]
    interval = max(1, work.checkpoint_interval)
    if not gone:
        in_flight_weights = 0
    elif work.checkpointing:
        in_flight_weights = min(swapped, interval + 1) * max(gone)
    else:
        in_flight_weights = sum(gone)
    weights = held.rest_bytes + sum(kept) + in_flight_weights
    lora = held.lora_params * work.lora_bytes_per_param
    h = work.hidden_state_bytes
    block_activations = ACTIVATION_WIDTHS * h
    micro_batches = max(1, min(work.stages - stage, work.grad_accum))
    if work.checkpointing:
        activations = micro_batches * math.ceil(held.layers / interval) * h + (interval + 1) * block_activations
    else:
        activations = micro_batches * held.blocks * block_activations + block_activations
    if work.stages > 1:
        activations += 2 * max(2, micro_batches) * h
    extra = int((weights + lora + activations) * margin.fraction) + margin.fixed_bytes
    return StageNeed(weights, lora, activations, extra)


@dataclass(frozen=True)
class StageFit:
    """One stage's plan: its GPU, its need without swap, the fewest swapped blocks that fit (None: none
    does) and the need with them (with every block swapped when none fits)."""

    stage: int
    blocks: int
    gpu: GpuBudget
    unswapped: StageNeed
    swapped: int | None
    need: StageNeed

    def describe(self) -> str:
        head = (f"stage {self.stage} needs {gib(self.unswapped.total)}, {gib(self.gpu.available_bytes)} free "
                f"on {self.gpu.label}")
        if self.swapped is None:
            return f"{head}: does not fit even with all {self.blocks} blocks swapped ({gib(self.need.total)})"
        if self.swapped == 0:
            return f"{head}: no block swapped"
        return f"{head}: {self.swapped} of {self.blocks} blocks swapped ({gib(self.need.total)})"


@dataclass(frozen=True)
class SwapPlan:
    stages: tuple[StageFit, ...]
    blocks_to_swap: int | None  # None: refused (see problem)
    problem: str | None = None

    def text(self) -> str:
        """The line the Train node shows and the run log keeps."""
        lines = "; ".join(s.describe() for s in self.stages)
        if self.blocks_to_swap is None:
            return f"Memory plan: {lines}."
        return f"Memory plan: {lines}. blocks_to_swap auto = {self.blocks_to_swap}."


def fit_stage(stage: int, held: StageWeights, gpu: GpuBudget, work: Workload, margin: Margin) -> StageFit:
    """The fewest of the stage's last blocks to swap so its need fits ``gpu`` (the first N from 0 that fits)."""
    unswapped = stage_need(stage, held, work, margin, 0)
    for n in range(held.blocks + 1):
        need = unswapped if n == 0 else stage_need(stage, held, work, margin, n)
        if need.total <= gpu.available_bytes:
            return StageFit(stage, held.blocks, gpu, unswapped, n, need)
    return StageFit(stage, held.blocks, gpu, unswapped, None, stage_need(stage, held, work, margin, held.blocks))


def plan_blocks_to_swap(stages: Sequence[StageWeights], gpus: Sequence[GpuBudget], work: Workload,
                        margin: Margin = Margin()) -> SwapPlan:
    """The plan over every stage (``gpus[s]``: the tightest GPU among stage ``s``'s replicas).

    ``blocks_to_swap`` applies to every stage alike, so the number is the largest any stage needs; it
    must not exceed the swappable blocks of the smallest stage. A refusal names the numbers and what to change.
    """
    fits = tuple(fit_stage(s, held, gpu, work, margin) for s, (held, gpu) in enumerate(zip(stages, gpus, strict=True)))
    failed = [f for f in fits if f.swapped is None]
    if failed:
        return SwapPlan(fits, None, refusal(failed, work, stages))
    n = max((f.swapped or 0 for f in fits), default=0)
    short = [f for f in fits if f.blocks < n]
    if short:
        worst = max(fits, key=lambda f: f.swapped or 0)
        where = ", ".join(f"stage {f.stage} has {f.blocks}" for f in short)
        return SwapPlan(fits, None, (
            f"blocks_to_swap auto: stage {worst.stage} needs {n} blocks swapped to fit, but blocks_to_swap applies to "
            f"every stage and {where} swappable block(s). Use partition_method 'uniform' or more pipeline_stages, "
            "or free memory on that GPU."))
    return SwapPlan(fits, n)


def refusal(failed: Sequence[StageFit], work: Workload, stages: Sequence[StageWeights]) -> str:
    """Why no block swap fits, with the numbers, and what to change: stages, resolution, swap, dtype."""
    parts = []
    for f in failed:
        need = f.need
        parts.append(f"stage {f.stage} needs {gib(need.total)} with all {f.blocks} of its blocks swapped "
                     f"(weights {gib(need.weights)}, LoRA and optimizer {gib(need.lora)}, activations "
                     f"{gib(need.activations)} at {work.tokens:,} tokens x batch {work.batch_size}, margin "
                     f"{gib(need.margin)}) but {f.gpu.label} has {gib(f.gpu.available_bytes)} free")
    fixes = [f"more pipeline_stages (now {len(stages)}: each stage then holds fewer blocks)",
             "a lower resolution or fewer frames in the Dataset node, or a smaller batch_size (the activations)"]
    if not work.checkpointing:
        fixes.insert(0, "gradient_checkpointing on (without it block swap saves no memory)")
    dtype = ("training_dtype bf16 instead of fp32, or an fp8 weight_dtype in the loader node (smaller frozen weights)"
             if work.dtype_bytes >= 4 else
             "a smaller dtype for the frozen weights: an fp8 weight_dtype or a GGUF file in the loader node")
    fixes.append(dtype)
    fixes.append("free memory on that GPU (close other programs), or set blocks_to_swap to a number yourself "
                 "to try anyway (swap: up to the stage's block count)")
    return (f"blocks_to_swap auto: the model does not fit even with every block swapped: {'; '.join(parts)}. "
            f"To fit, use {'; or '.join(fixes)}.")
