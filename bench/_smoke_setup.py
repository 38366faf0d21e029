"""bench/gpu_smoke.py's set-up: the engine's own sequence, measured, and the memory plan's estimate beside it.

:func:`engine_group` starts a 1-rank process group (NCCL on CUDA, gloo on the CPU) for DeepSpeed's stage
module and engine when DeepSpeed is importable; :func:`build_stage` then runs the set-up the way
training/loop/engine.py's ``Trainer.setup`` does (PipeTrainer's PipelineModule left on the host, the stage
placed with its swapped blocks kept in host memory, LoRA injected, frozen, moved, the optimizer, the block
swapper, DeepSpeed's stage engine), or the same placement without DeepSpeed. :func:`plan_estimate` is the
memory plan's estimate (training/offload/memory_plan.py) for the stage, counted as the Train node counts it
(nodes/checks/memory.py), so a GPU run prints the planner's error next to the measured peak.
Torch and the pack are imported inside the functions.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

SETUPS = ("auto", "deepspeed", "plain")
LORA_INIT_BYTES = 4  # the LoRA's fp32 weights: what set-up puts on the device for them (no gradient, no state yet)


def engine_group(setup: str, device) -> tuple[bool, str]:
    """``(use DeepSpeed, why not)``: a 1-rank process group for DeepSpeed on ``device`` (once per process)."""
    if setup == "plain":
        return False, "asked for (--setup plain)"
    try:
        from pipetrainer.patches.deepspeed_shm import disable_shm_comm_build

        disable_shm_comm_build()
        import deepspeed
        import torch.distributed as dist
    except ImportError as exc:
        if setup == "deepspeed":
            raise
        return False, f"DeepSpeed is not importable ({exc})"
    if not dist.is_initialized():
        import torch

        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's accelerator device and PipelineModule go by it
        if device.type == "cuda":
            torch.cuda.set_device(device)
        rendezvous = os.path.join(tempfile.mkdtemp(prefix="gpu_smoke_"), "rendezvous")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False,
                                   verbose=False, init_method=f"file://{rendezvous}", rank=0, world_size=1)
    return True, ""


@dataclass
class Stage:
    """One case's set-up: what the steps run, and what holds it (kept alive until the case ends)."""

    layers: list
    optimizer: object
    swapper: object = None
    engine: object = None


def build_stage(layers, adapter, lora, blocks_to_swap: int, device, lr: float, use_deepspeed: bool) -> Stage:
    """The engine's set-up sequence for one 1-stage pipeline (training/loop/engine.py ``Trainer.setup``)."""
    import torch
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.offload.block_swap import BlockSwapper
    from pipetrainer.training.offload.placement import last_swappable, move_trainable, place_stage

    module = torch.nn.ModuleList(layers)
    if use_deepspeed:  # PipeTrainer's PipelineModule: left on the host (patches/deepspeed_stage_module.py)
        from pipetrainer.patches.deepspeed_stage_module import build_stage_module

        module = build_stage_module(list(layers), num_stages=1, loss_fn=torch.nn.functional.mse_loss,
                                    partition_method="uniform")
    swapped = last_swappable(layers, blocks_to_swap)
    place_stage(layers, swapped, device)
    inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex(lora.targets), lora, seed=0)
    params = freeze_all_but_lora(module)
    if move_trainable(swapped, device):  # new Parameter objects: collect them again
        params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    swapper = BlockSwapper(swapped, device).attach() if swapped else None
    engine = None
    if use_deepspeed:  # the engine leaves the stage where it is and broadcasts only the LoRA
        from pipetrainer.patches.deepspeed_stage_engine import build_stage_engine

        engine = build_stage_engine(module, optimizer, None, params, {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
            "steps_per_print": 10**9, "wall_clock_breakdown": False, "gradient_clipping": 0.0})
    return Stage(layers, optimizer, swapper, engine)


@dataclass(frozen=True)
class Estimate:
    """The memory plan's figures for one case (bytes): its estimate of the stage's peak (``need``, and
    ``need_no_margin`` without the margin, comparable with torch's allocated bytes) and what set-up should
    leave on the device: the stage minus its swapped blocks' frozen weights, plus the LoRA's weights."""

    need: int
    need_no_margin: int
    setup_resident: int


def plan_estimate(layers, adapter, dm, lora, blocks_to_swap: int, compute_bytes: int, latent_shape, text_tokens: int,
                  optimizer: str = "AdamW") -> Estimate:
    """The plan's estimate for this stage (count before LoRA injection: the node counts the bare model)."""
    from pipetrainer.nodes.checks.memory import hidden_width, stage_weights
    from pipetrainer.training.offload.memory_plan import Margin, Workload, lora_bytes_per_param, stage_need

    planned = [None, *layers]  # the engine's list: input preparation, then the stage layers
    (held,) = stage_weights(planned, [0, len(planned)], compute_bytes, adapter.lora_target_regex(lora.targets), lora)
    work = Workload(tokens=adapter.image_tokens(dm, tuple(latent_shape)) + text_tokens, hidden=hidden_width(planned),
                    dtype_bytes=compute_bytes, checkpointing=True, checkpoint_interval=1,
                    lora_bytes_per_param=lora_bytes_per_param(optimizer))
    need = stage_need(0, held, work, Margin(), blocks_to_swap)
    bare = stage_need(0, held, work, Margin(0, 0.0), blocks_to_swap)
    kept = held.block_bytes[:held.blocks - max(0, min(blocks_to_swap, held.blocks))]
    return Estimate(need.total, bare.total, held.rest_bytes + sum(kept) + held.lora_params * LORA_INIT_BYTES)
