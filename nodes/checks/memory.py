"""``blocks_to_swap`` auto: the memory plan's facts read from ComfyUI's MODEL, the cache and the GPUs.

The plan itself is pure arithmetic (training/offload/memory_plan.py). Here the Train node learns, at
queue time, what each pipeline stage will hold: the family's stage layers are built over the loaded
model (thin wrappers adopting its own modules; nothing is moved or copied), split as DeepSpeed will
split them (equal layer counts, or its parameter-balanced split reproduced in training/offload/stages.py),
and each layer's frozen tensors are counted in the bytes a rank stores them in: float weights in the
compute dtype (the rank loads "default" weights in it), fp8 and quantized (GGUF, per-layer) weights at
their own size. The LoRA parameters per stage come from the adapter type's size rule
(training/adapters/size.py), the tokens from the cached latent and text shapes, the hidden width from the
blocks' Linears, and each rank's free memory from NVML (nodes/checks/gpus.py) plus what ComfyUI's loaded
models hold on its own GPU, which the Train node unloads before it starts the run.

With previews connected on a GPU, the Train node also states what a preview needs (ComfyUI's own sizes:
the MODEL as loaded, ``memory_required`` for the preview's latent, the VAE's decode estimate) next to what
the plan leaves free on ComfyUI's device, where previews render (training/offload/preview_memory.py), and
which ``gpus`` / ``--default-device`` keep previews off the training GPUs when they do not fit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...training.offload.memory_plan import (
    GpuBudget,
    Margin,
    StageWeights,
    Workload,
    lora_bytes_per_param,
    plan_blocks_to_swap,
    stage_need,
)
from ...training.offload.preview_memory import PreviewFit, PreviewNeed, gpu_advice
from ...training.offload.stages import balanced_boundaries, is_swappable, uniform_boundaries
from ...training.spec.options import BLOCKS_TO_SWAP_AUTO, LoraSpec, OptimizerSpec, TrainSpec
from .gpus import GpuInfo

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

    from ...training.cache.store import CacheResult

CPU_NOTE = "blocks_to_swap auto: training runs on the CPU, where swapping saves nothing: 0 (block swap off)."
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def unknown_memory_problem(gpus: Sequence[GpuInfo]) -> str | None:
    """Auto cannot plan for a GPU whose free memory could not be read (no NVML for it)."""
    unread = [g for g in gpus if not g.memory_read]
    if not unread:
        return None
    names = "; ".join(g.describe() for g in unread)
    return (f"blocks_to_swap is auto (-1) but the free memory of {names} cannot be read, so no memory plan can be "
            "made. Install pynvml in ComfyUI's Python ('pip install pynvml') and restart ComfyUI, or set "
            "blocks_to_swap to a number (0 = off).")


def stage_budgets(rank_gpus: Sequence[int], visible: Sequence[GpuInfo], stages: int, data_parallel: int,
                  releasable: dict[int, int] | None = None) -> list[GpuBudget]:
    """The tightest GPU of each stage's replicas (global rank = stage x data_parallel + replica)."""
    by_index = {g.index: g for g in visible}
    releasable = releasable or {}
    out = []
    for s in range(stages):
        budgets = [GpuBudget(f"GPU {g} ({by_index[g].name})", by_index[g].free_bytes, releasable.get(g, 0))
                   for g in rank_gpus[s * data_parallel:(s + 1) * data_parallel]]
        out.append(min(budgets, key=lambda b: b.available_bytes))
    return out


def comfyui_releasable() -> dict[int, int]:
    """Bytes ComfyUI's loaded models (and its allocator's cache) hold on its own GPU: the Train node
    unloads them (``unload_all_models``, ``soft_empty_cache``) before the ranks start."""
    import comfy.model_management as mm
    import torch

    device = mm.get_torch_device()
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    held = sum(int(lm.model_loaded_memory()) for lm in mm.current_loaded_models
               if lm.model is not None and getattr(lm.device, "type", "") == "cuda"
               and (lm.device.index if lm.device.index is not None else index) == index)
    if torch.cuda.is_initialized():
        held += max(0, torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))
    return {index: held}


# ---- what each stage holds ------------------------------------------------------------------------
def tensor_bytes(tensor, compute_bytes: int) -> int:
    """Bytes a rank stores ``tensor`` in: plain 16/32-bit floats in the compute dtype, others as they are
    (fp8, GGUF's uint8 blocks; a quantized wrapper by the plain tensors under it)."""
    import torch

    from ...training.offload.subclass import is_plain, split

    if is_plain(tensor) and tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return tensor.numel() * compute_bytes
    pieces = None if is_plain(tensor) else split(tensor)
    if pieces is not None:
        return sum(p.numel() * p.element_size() for p in pieces[0])
    return tensor.numel() * tensor.element_size()


def _tensors(layer) -> dict[int, object]:
    from torch import nn

    if not isinstance(layer, nn.Module):
        return {}
    return {id(t): t for t in (*layer.parameters(), *layer.buffers())}


def partition_weight(layer) -> int:
    """What DeepSpeed's "parameters" split counts for a layer: its floating-point plain parameters (the
    trainer flags exactly those trainable while DeepSpeed partitions; training/quant/guards.py)."""
    import torch
    from torch import nn

    if not isinstance(layer, nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.dtype.is_floating_point and type(p.data) is torch.Tensor)


def stage_boundaries(layers: Sequence[object], stages: int, method: str) -> list[int]:
    if stages <= 1:
        return [0, len(layers)]
    if method == "uniform":
        return uniform_boundaries(len(layers), stages)
    return balanced_boundaries([partition_weight(layer) for layer in layers], stages)


def layer_lora_params(layer, regex: str, lora: LoraSpec) -> int:
    from ...training.adapters.size import adapter_parameter_count
    from ...training.pipelines.targets import layer_targets

    names = layer_targets(layer, regex)
    shapes = [(int(m.in_features), int(m.out_features)) for m in (layer.get_submodule(n) for n in names)]
    return adapter_parameter_count(lora, shapes)


def stage_weights(layers: Sequence[object], boundaries: Sequence[int], compute_bytes: int, regex: str,
                  lora: LoraSpec) -> list[StageWeights]:
    """Each stage's blocks, other bytes, layer count and LoRA parameters (shared tensors counted once)."""
    out = []
    for a, b in zip(boundaries[:-1], boundaries[1:], strict=False):
        seen: set[int] = set()
        blocks, rest, lora_params = [], 0, 0
        for layer in layers[a:b]:
            fresh = {k: t for k, t in _tensors(layer).items() if k not in seen}
            seen.update(fresh)
            size = sum(tensor_bytes(t, compute_bytes) for t in fresh.values())
            if is_swappable(layer):
                blocks.append(size)
            else:
                rest += size
            lora_params += layer_lora_params(layer, regex, lora) if hasattr(layer, "comfy_path") else 0
        out.append(StageWeights(tuple(blocks), rest, b - a, lora_params))
    return out


def hidden_width(layers: Sequence[object]) -> int:
    """The blocks' hidden width: the commonest input width of their Linears (ties: the wider)."""
    widths = Counter(int(m.in_features) for layer in layers if is_swappable(layer)
                     for m in layer.modules() if hasattr(m, "in_features") and hasattr(m, "out_features"))
    return max(widths.items(), key=lambda kv: (kv[1], kv[0]))[0] if widths else 0


def example_tokens(adapter, dm, cache: CacheResult) -> int:
    """The most tokens one cached example sends through a block: image or video patches (with its
    reference images') plus its text tokens."""
    from ...training.pipelines.base import REFERENCE_PREFIX
    from .preflight import read_cached_shapes

    shapes = read_cached_shapes(tuple(getattr(cache, "items", ())))
    image = 0
    for entry, latent in shapes.latents.items():
        refs = [s for name, s in shapes.extras.get(entry, {}).items() if name.startswith(REFERENCE_PREFIX)]
        image = max(image, sum(adapter.image_tokens(dm, tuple(s)) for s in (latent, *refs)))
    text = max((c[-2] for c in shapes.conds.values() if len(c) >= 2), default=0)
    return image + text


# ---- auto --------------------------------------------------------------------------------------------
def plan_facts(model: ModelPatcher, cache: CacheResult, lora: LoraSpec, optimizer: OptimizerSpec,
               train: TrainSpec) -> tuple[list[StageWeights], Workload]:
    """What each stage holds and the workload that sets its activations, for this model and run."""
    from ...training.pipelines.base import adapter_for
    from ...training.pipelines.checks import model_inputs
    from ...training.pipelines.targets import preset_regex, run_target_regex

    inputs = model_inputs(model.model)
    adapter, dm = adapter_for(inputs.family), model.model.diffusion_model
    layers = [None, *adapter.stage_layers(dm)]  # the engine's list: input preparation, then the stage layers
    boundaries = stage_boundaries(layers, train.pipeline_stages, train.partition_method)
    try:
        regex = run_target_regex(adapter, dm, lora)
    except ValueError:  # a bad block range or a preset the family lacks is its own preflight problem
        regex = preset_regex(adapter, lora.targets)
    compute = COMPUTE_BYTES.get(train.dtype, 4)
    held = stage_weights(layers, boundaries, compute, regex, lora)
    work = Workload(tokens=example_tokens(adapter, dm, cache), hidden=hidden_width(layers),
                    batch_size=train.batch_size, grad_accum=train.grad_accum, stages=train.pipeline_stages,
                    dtype_bytes=compute, checkpointing=train.gradient_checkpointing,
                    checkpoint_interval=train.checkpoint_interval,
                    lora_bytes_per_param=lora_bytes_per_param(optimizer.name, optimizer.ema_decay > 0))
    return held, work


def plan_for_model(model: ModelPatcher, cache: CacheResult, lora: LoraSpec, optimizer: OptimizerSpec,
                   train: TrainSpec, budgets: Sequence[GpuBudget], margin: Margin = Margin()):
    """The :class:`~...training.offload.memory_plan.SwapPlan` of this model and run on these stage budgets."""
    held, work = plan_facts(model, cache, lora, optimizer, train)
    return plan_blocks_to_swap(held, budgets, work, margin)


def resolve_auto(model: ModelPatcher, cache: CacheResult, lora: LoraSpec, optimizer: OptimizerSpec,
                 train: TrainSpec, device: str, gpus: str = "",
                 visible: Sequence[GpuInfo] | None = None) -> tuple[int, str, list[str]]:
    """``(blocks_to_swap, note, problems)`` for a Train node whose ``blocks_to_swap`` is auto.

    A number other than auto comes back as it is. On the CPU auto is 0, with a plain note. A setup the
    preflight refuses anyway (no trainable family, a bad ``gpus`` input) gets 0 and no problem of its own.
    """
    if train.blocks_to_swap != BLOCKS_TO_SWAP_AUTO:
        return train.blocks_to_swap, "", []
    if device != "cuda":
        return 0, CPU_NOTE, []
    from ...training.pipelines import checks as family_checks
    from .gpus import visible_gpus
    from .launch import resolve_gpus

    if family_checks.model_inputs(model.model) is None or family_checks.model_support_problems(model.model):
        return 0, "", []
    visible = list(visible_gpus() if visible is None else visible)
    ranks = train.pipeline_stages * train.data_parallel
    rank_gpus, problems = resolve_gpus(gpus, ranks, device, visible)
    if problems or len(rank_gpus) != ranks:
        return 0, "", []
    by_index = {g.index: g for g in visible}
    unknown = unknown_memory_problem([by_index[g] for g in dict.fromkeys(rank_gpus)])
    if unknown:
        return 0, "", [unknown]
    budgets = stage_budgets(rank_gpus, visible, train.pipeline_stages, train.data_parallel, comfyui_releasable())
    plan = plan_for_model(model, cache, lora, optimizer, train, budgets)
    if plan.problem:
        return 0, "", [plan.problem]
    return int(plan.blocks_to_swap or 0), plan.text(), []


# ---- previews on ComfyUI's GPU -------------------------------------------------------------------------
def comfyui_gpu() -> int | None:
    """ComfyUI's own CUDA device number (where previews render), or None when it computes on the CPU."""
    import comfy.model_management as mm
    import torch

    device = mm.get_torch_device()
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def preview_latent_shape(vae, width: int, height: int, frames: int) -> tuple[int, ...]:
    """The shape of the empty latent a preview samples (nodes/run/previews.py ``empty_latent``)."""
    ratio = vae.downscale_ratio
    if isinstance(ratio, tuple):  # video VAEs: (frames -> latent frames, height ratio, width ratio)
        frames_of, rh, rw = ratio
        return (1, int(vae.latent_channels), int(frames_of(frames)), height // rh, width // rw)
    return (1, int(vae.latent_channels), height // ratio, width // ratio)


def largest_layer_bytes(module, compute_bytes: int) -> int:
    """The largest weight + bias of one layer in the compute dtype: what ComfyUI's lowvram loading casts
    onto the GPU for a layer it left off (a quantized weight by its logical shape)."""
    import math

    largest = 0
    for m in module.modules():
        tensors = [t for t in (getattr(m, "weight", None), getattr(m, "bias", None)) if hasattr(t, "shape")]
        size = sum(math.prod(getattr(t, "tensor_shape", None) or t.shape) for t in tensors)
        largest = max(largest, size * compute_bytes)
    return largest


def preview_need(model: ModelPatcher, settings, lora_file_bytes: int = 0) -> PreviewNeed:
    """What a preview of ``settings`` (PreviewSettings) needs on the GPU, from ComfyUI's own sizes and
    formulas (training/offload/preview_memory.py says which)."""
    import math

    import comfy.model_management as mm

    base = model.model
    shape = preview_latent_shape(settings.vae, settings.width, settings.height, settings.frames)
    batch = 1 if math.isclose(settings.cfg, 1.0) else 2  # cfg 1: ComfyUI skips the uncond pass
    reserve, floor = int(mm.extra_reserved_memory()), int(mm.minimum_inference_memory())
    sampled = int(base.memory_required([shape[0] * batch, *shape[1:]]))
    one = int(base.memory_required(list(shape)))
    compute = base.manual_cast_dtype or base.get_dtype()
    vae = settings.vae
    try:
        decode = int(vae.patcher.model_size()) + int(vae.memory_used_decode(shape, vae.vae_dtype))
    except (AttributeError, TypeError, IndexError):  # a VAE without ComfyUI's estimate: its weights at least
        decode = int(getattr(getattr(vae, "patcher", None), "model_size", lambda: 0)())
    size = f"{settings.width}x{settings.height}" + (f"x{settings.frames}" if len(shape) == 5 else "")
    return PreviewNeed(weights=int(model.model_size()) + lora_file_bytes, sampling=max(floor, sampled + reserve),
                       decode=decode,
                       lowvram_weights=largest_layer_bytes(base.diffusion_model, mm.dtype_size(compute)),
                       lowvram_sampling=max(floor, one + reserve), size=size)


def preview_fit(model: ModelPatcher, cache: CacheResult, lora: LoraSpec, optimizer: OptimizerSpec, train: TrainSpec,
                rank_gpus: Sequence[int], previews, visible: Sequence[GpuInfo], comfy_gpu: int,
                releasable: dict[int, int] | None = None, margin: Margin = Margin()) -> PreviewFit | None:
    """A preview on GPU ``comfy_gpu`` beside the run's plan (``train.blocks_to_swap``: a number, or auto,
    planned here); None when ComfyUI's device is not among ``visible``."""
    by_index = {g.index: g for g in visible}
    info = by_index.get(comfy_gpu)
    if info is None:
        return None
    releasable = releasable or {}
    held, work = plan_facts(model, cache, lora, optimizer, train)
    lora_file = sum(s.lora_params for s in held) * (4 if lora.save_dtype == "fp32" else 2)
    need = preview_need(model, previews, lora_file)
    rank = next((r for r, g in enumerate(rank_gpus) if g == comfy_gpu), None)
    stage = None if rank is None else rank // max(1, train.data_parallel)
    swap = train.blocks_to_swap
    if swap == BLOCKS_TO_SWAP_AUTO:
        budgets = stage_budgets(rank_gpus, visible, train.pipeline_stages, train.data_parallel, releasable)
        swap = plan_blocks_to_swap(held, budgets, work, margin).blocks_to_swap or 0
    left = None
    if info.memory_read:
        left = info.free_bytes + releasable.get(comfy_gpu, 0)
        if stage is not None:
            left -= stage_need(stage, held[stage], work, margin, swap).total
    advice = gpu_advice(comfy_gpu, rank_gpus, [g.index for g in visible])
    return PreviewFit(f"GPU {comfy_gpu} ({info.name})", need, left, rank, stage, swap, advice)


def preview_notes(model: ModelPatcher, cache: CacheResult, spec, previews, visible: Sequence[GpuInfo] | None = None,
                  comfy_gpu: int | None = None, releasable: dict[int, int] | None = None) -> list[str]:
    """The Train node's line on previews next to the plan (for its notes and the run log): none without
    previews or on the CPU. ``spec`` is the built RunSpec (blocks_to_swap resolved, the ranks' GPUs in
    ``spec.launch.gpus``). A line that cannot be worked out is left off (logged): it never stops a run."""
    if previews is None or spec.device != "cuda":
        return []
    try:
        from .gpus import visible_gpus

        fit = preview_fit(model, cache, spec.lora, spec.optimizer, spec.train, spec.launch.gpus, previews,
                          list(visible_gpus() if visible is None else visible),
                          comfyui_gpu() if comfy_gpu is None else comfy_gpu,
                          comfyui_releasable() if releasable is None else releasable)
    except Exception:  # noqa: BLE001 - a note, never a reason not to train
        import logging

        logging.exception("[PipeTrainer] could not estimate the previews' GPU memory")
        return []
    return [fit.text()] if fit is not None else []
