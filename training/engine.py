"""The training loop on one rank: a DeepSpeed pipeline over the family's stage layers.

A single-GPU (or CPU) run is a 1-stage pipeline; there is no second code path. Each step ends with an
all-reduce of a stop flag so every rank stops at the same step and saves collectively.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ..patches.deepspeed_pipe_backward import use_single_backward
from .clipping import GlobalNormClipping
from .data import MicroBatches, load_examples
from .events import EventWriter, stop_path
from .lora_file import atomic_save, lora_state_dict
from .lora_inject import freeze_all_but_lora, inject_lora, named_lora_parameters
from .loss import mse_loss
from .offload.block_swap import swap_last_blocks
from .offload.stages import blocks_to_swap_problem, swappable_per_stage
from .partition import describe, log_lines, require_lora_on_every_stage, write_plan
from .pipelines.base import adapter_for, family_name_for
from .process_util import process_alive
from .spec import RunSpec

CHECKPOINT_DIR = "checkpoints"


def _inputs_need_grad(inputs):
    """First pipeline layer: float inputs get a grad path so every tensor sent between stages has one."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)


def _contiguous_outputs(module, args, outputs):
    if isinstance(outputs, tuple):
        return tuple(t.contiguous() for t in outputs)
    return outputs.contiguous()


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    events: EventWriter


def build_optimizer(spec: RunSpec, params: list[torch.nn.Parameter]):
    o = spec.optimizer
    if o.name == "AdamW":
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == "AdamW8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:  # pragma: no cover - depends on the platform
            raise RuntimeError("AdamW8bit needs bitsandbytes: pip install bitsandbytes, or choose AdamW.") from exc
        opt = bnb.optim.AdamW8bit(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    else:
        raise ValueError(f"Unknown optimizer {o.name!r}")
    total, warmup = spec.train.steps, o.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if o.schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def deepspeed_config(spec: RunSpec, data_parallel: int) -> dict:
    t = spec.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * data_parallel,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Clipping is ours (training/clipping.py): DeepSpeed's clips each pipeline stage by its own norm.
        "gradient_clipping": 0.0,
    }


class Trainer:
    """Owns the pipeline engine of one rank and runs the steps."""

    def __init__(self, spec: RunSpec, ctx: RankContext):
        self.spec = spec
        self.ctx = ctx
        self.run_dir = Path(spec.run_dir)
        self.step = 0
        self.step_times: list[float] = []

    # ---- set-up --------------------------------------------------------------------------------
    def setup(self, patcher) -> None:
        import deepspeed
        from deepspeed.pipe import PipelineModule

        spec, ctx = self.spec, self.ctx
        model = patcher.model
        self.family = family_name_for(model)
        self.adapter = adapter_for(self.family)
        dm = model.diffusion_model
        # DeepSpeed's "parameters" partitioning counts trainable parameters only: let it see the base
        # weights as trainable while it partitions, then freeze them (LoRA is injected afterwards).
        dm.requires_grad_(True)
        stage_layers = self.adapter.stage_layers(dm)
        for layer in stage_layers:  # gloo/NCCL send only contiguous tensors across stage boundaries
            layer.register_forward_hook(_contiguous_outputs)
        layers = [_inputs_need_grad, *stage_layers]
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self.module = PipelineModule(
            layers=layers,
            num_stages=spec.train.pipeline_stages,
            loss_fn=mse_loss,
            partition_method="parameters" if spec.train.partition_method == "parameters" else "uniform",
            activation_checkpoint_interval=spec.train.checkpoint_interval if spec.train.gradient_checkpointing else 0,
            activation_checkpoint_func=checkpoint,
            dynamic_shape=True,
        )
        dm.requires_grad_(False)
        regex = self.adapter.lora_target_regex(spec.lora.targets)
        self.boundaries = [int(p) for p in self.module.parts]
        self.plan = describe(layers, self.boundaries, regex)
        require_lora_on_every_stage(self.plan, spec.lora.targets)
        swap_problem = blocks_to_swap_problem(spec.train.blocks_to_swap, swappable_per_stage(layers, self.boundaries))
        if swap_problem:  # every rank sees the whole split, so all raise together
            raise ValueError(swap_problem)
        local = [(int(name), layer) for name, layer in self.module.named_children() if name.isdigit()]
        self.layer_paths = {i: dict(getattr(layer, "comfy_paths", {})) for i, layer in local}
        self.module.to(ctx.device)
        self.lora_count = inject_lora(local, regex, spec.lora, spec.train.seed)
        params = freeze_all_but_lora(self.module)
        if not params:
            raise RuntimeError(
                f"No LoRA target matched on pipeline stage {self.module.stage_id} (preset {spec.lora.targets!r}, "
                f"layers {sorted(self.layer_paths)}): choose a wider target preset or fewer pipeline stages."
            )
        optimizer, scheduler = build_optimizer(spec, params)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.module, optimizer=optimizer, lr_scheduler=scheduler,
            model_parameters=params, config=deepspeed_config(spec, data_parallel=self.data_parallel),
        )
        use_single_backward(self.engine)
        # After deepspeed.initialize, which moves the whole module to the device: only then can blocks leave it.
        self.block_swapper = swap_last_blocks([layer for _, layer in local], spec.train.blocks_to_swap, ctx.device)
        if spec.train.max_grad_norm > 0:
            optimizer.register_step_pre_hook(
                GlobalNormClipping(spec.train.max_grad_norm, self.engine.grid.get_pipe_parallel_group()))
        self.scheduler = scheduler
        self.batches = MicroBatches(
            load_examples(spec.items), spec.train.batch_size, spec.train.seed, model, self.adapter,
            spec.train.timestep_sampling, ctx.device,
            replica=self.engine.grid.data_parallel_id, replicas=self.data_parallel,
        )
        if spec.resume_from:
            self._load_checkpoint(spec.resume_from)
        if ctx.rank == 0:
            write_plan(self.run_dir, self.plan, spec.train.partition_method, {
                "pipeline_stages": spec.train.pipeline_stages, "data_parallel": self.data_parallel,
                "checkpoint_interval": spec.train.checkpoint_interval if spec.train.gradient_checkpointing else 0,
            })
            for line in log_lines(self.plan):
                print(f"[pipetrainer] {line}", flush=True)
            ctx.events.emit(
                "setup", family=self.family, lora_modules_stage0=self.lora_count,
                partition=self.boundaries, stages=[list(p.layers) for p in self.plan], layers=len(layers),
                world_size=ctx.world_size, data_parallel=self.data_parallel, resumed_step=self.step,
                swapped_blocks_stage0=self.block_swapper.block_names() if self.block_swapper else [],
            )

    @property
    def data_parallel(self) -> int:
        return self.ctx.world_size // self.spec.train.pipeline_stages

    @property
    def stage_id(self) -> int:
        return int(self.module.stage_id)

    @property
    def seconds_per_step(self) -> float | None:
        """Mean wall time of the steps after the first (which pays one-off start-up costs)."""
        times = self.step_times[1:] or self.step_times
        return sum(times) / len(times) if times else None

    # ---- loop ----------------------------------------------------------------------------------
    def train(self) -> str:
        """Run to the last step or until asked to stop; return "finished" or "stopped"."""
        spec, ctx = self.spec, self.ctx
        ga = spec.train.grad_accum
        data = self.batches.iterate(self.step * ga)
        started = time.monotonic()
        first_step = self.step
        while self.step < spec.train.steps:
            t0 = time.monotonic()
            loss = self.engine.train_batch(data_iter=data)
            self.step += 1
            self.step_times.append(time.monotonic() - t0)
            if ctx.rank == 0:
                now = time.monotonic()
                done = self.step - first_step
                rate = done / max(now - started, 1e-9)
                ctx.events.emit(
                    "step", step=self.step, total=spec.train.steps, loss=float(loss),
                    lr=float(self.scheduler.get_last_lr()[0]), step_time=now - t0, it_s=rate,
                    eta_s=(spec.train.steps - self.step) / rate if rate > 0 else None,
                )
            if self._stop_requested():
                self.save(final=False)
                return "stopped"
            every = spec.train.save_every
            if every and self.step % every == 0 and self.step < spec.train.steps:
                self.save(final=False)
        self.save(final=True)
        return "finished"

    def _stop_requested(self) -> bool:
        """True on every rank if any rank saw the stop file or lost its parent."""
        local = stop_path(self.run_dir).exists() or (self.spec.parent_pid > 0 and not process_alive(self.spec.parent_pid))
        flag = torch.tensor([1.0 if local else 0.0])
        if dist.is_initialized() and self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ---- saving --------------------------------------------------------------------------------
    def _gathered_lora(self) -> dict[str, torch.Tensor] | None:
        mine = lora_state_dict(named_lora_parameters(self.module), self.layer_paths, self.spec.lora.alpha)
        if self.ctx.world_size == 1:
            return mine
        parts = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.ctx.rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged

    def metadata(self) -> dict[str, object]:
        s = self.spec
        return {
            "pipetrainer.version": "1", "family": self.family, "rank": str(s.lora.rank),
            "alpha": str(s.lora.alpha), "targets": s.lora.targets, "steps": str(self.step),
            "base_model": Path(s.model.path).name, "base_model_fingerprint": s.model.fingerprint,
            "weight_dtype": s.model.weight_dtype, "spec_hash": s.training_hash(),
            "format": "diffusion_model.<ComfyUI module>.lora_A/lora_B/alpha",
        }

    def save(self, final: bool) -> None:
        """Collective: checkpoint (LoRA + optimizer, all stages) and the LoRA file."""
        tag = f"step{self.step:07d}"
        ckpt_dir = self.run_dir / CHECKPOINT_DIR
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": self.step},
                                    exclude_frozen_parameters=True)
        tensors = self._gathered_lora()
        if self.ctx.rank != 0:
            return
        if final:
            path = Path(self.spec.lora_output)
        else:
            path = self.run_dir / "loras" / f"{Path(self.spec.lora_output).stem}-{tag}.safetensors"
        atomic_save(tensors, path, self.metadata())
        self.ctx.events.emit("saved", path=str(path), step=self.step, final=final, checkpoint=str(ckpt_dir / tag))

    def _load_checkpoint(self, checkpoint: str) -> None:
        ckpt = Path(checkpoint)
        advice = ("it is incomplete or from a run with other settings; resume from another checkpoint "
                  "or start without resume")
        try:
            _, client = self.engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_module_strict=False)
        except Exception as exc:  # DeepSpeed asserts (no message) on missing stage files
            raise RuntimeError(f"Could not load the checkpoint {checkpoint} on pipeline stage {self.stage_id} "
                               f"({type(exc).__name__}: {exc}): {advice}.") from exc
        if client is None:
            raise RuntimeError(f"Could not load the checkpoint {checkpoint}: {advice}.")
        self.step = int(client["step"])
