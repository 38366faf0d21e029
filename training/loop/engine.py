"""The training loop on one rank: a DeepSpeed pipeline over the family's stage layers.

A single-GPU (or CPU) run is a 1-stage pipeline; there is no second code path. Each step ends with an
all-reduce of a stop flag so every rank stops at the same step and saves collectively.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint

from ...patches.deepspeed_pipe_backward import use_single_backward
from ...patches.deepspeed_stage_engine import build_stage_engine
from ...patches.deepspeed_stage_module import build_stage_module
from ..adapters.init_lora import check_init_lora, read_init_file
from ..adapters.inject import freeze_all_but_lora, inject_lora
from ..adapters.kinds import adapter_kind
from ..adapters.lora_file import atomic_save, family_metadata, link_or_copy, stage_lora_tensors, step_lora_name
from ..cache.reader import read_totals
from ..data.micro_batches import MicroBatches, load_examples
from ..data.regularization import MixedMicroBatches, regularization_seed
from ..data.validation import ValidationBatches, evaluation_due
from ..model.model_source import finish_loading
from ..model.partition import describe, log_lines, require_lora_on_every_stage, write_plan
from ..model.stage_weights import DeferredWeights, foreign_module_paths, resident_bytes, unshared_tensors
from ..objective.loss import mse_loss
from ..objective.timesteps import family_timesteps
from ..offload.block_swap import BlockSwapper
from ..offload.placement import last_swappable, move_trainable, place_stage
from ..offload.stages import blocks_to_swap_problem, swappable_per_stage
from ..optim.clipping import GlobalNormClipping
from ..optim.optimizers import StageOptimizer, build_stage_optimizer, ema_path
from ..pipelines.base import adapter_for, family_name_for
from ..pipelines.options import parse_family_options
from ..pipelines.targets import run_target_regex
from ..process.events import EventWriter, stop_path
from ..process.process_util import process_alive
from ..quant.guards import set_float_weights_trainable
from ..spec.choices import SpecError
from ..spec.run_spec import RunSpec
from .collectives import any_rank_requests_stop, gather_objects_to_rank0, wait_for_all_ranks
from .health import check_lora_update, check_loss
from .resume import (
    apply_changed_hyperparameters,
    check_resume,
    recorded_spec,
    restore_rng_states,
    resume_problem,
    save_checkpoint_spec,
    save_rng_states,
    seed_rank_rngs,
    write_saved_marker,
)
from .tensorboard_log import TensorBoardLog

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
    load_group: object = None  # a long-timeout group: waiting for slower ranks to load is not a hang


def build_optimizer(spec: RunSpec, named_params) -> StageOptimizer:
    """The stage's optimizer, LR schedule and EMA (training/optim/optimizers.py) for its trainable
    ``(name, parameter)`` pairs: names decide LoRA+ and the weight-decay groups."""
    return build_stage_optimizer(spec.optimizer, named_params, spec.train.steps)


def deepspeed_config(spec: RunSpec, data_parallel: int) -> dict:
    t = spec.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * data_parallel,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Clipping is ours (training/optim/clipping.py): DeepSpeed's clips each pipeline stage by its own norm.
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
        self.clipping: GlobalNormClipping | None = None  # its last_norm is the step's grad norm
        self.family_metadata: dict[str, str] = {}  # LoRA metadata of the family's options (set up)

    # ---- set-up --------------------------------------------------------------------------------
    def setup(self, patcher, deferred: DeferredWeights | None = None) -> None:
        """Build this rank's stage. With ``deferred`` (the rank's normal path) only this stage's frozen
        weights are loaded (training/model/stage_weights.py); without it the patcher holds every weight."""
        spec, ctx = self.spec, self.ctx
        if spec.resume_from:  # before any work: a checkpoint of other settings must not be continued
            problem = resume_problem(spec)
            if problem:
                raise ValueError(problem)
        model = patcher.model
        self.family = family_name_for(model)
        self.adapter = adapter_for(self.family)
        self.family_options, problems = parse_family_options(self.family, self.adapter.options_type,
                                                             spec.family_options)
        if problems:
            raise SpecError(problems)
        dm = model.diffusion_model
        self.family_metadata = family_metadata(self.adapter, dm, self.family_options)
        timesteps = family_timesteps(spec.train.timesteps, self.adapter, dm, self.family_options)
        # DeepSpeed's "parameters" partitioning counts trainable parameters only: let it see the base
        # weights as trainable while it partitions, then freeze them (LoRA is injected afterwards).
        # Integer (GGUF) and QuantizedTensor weights cannot require grad: only float ones are flagged.
        set_float_weights_trainable(dm, True)
        stage_layers = self.adapter.stage_layers(dm)
        for layer in stage_layers:  # gloo/NCCL send only contiguous tensors across stage boundaries
            layer.register_forward_hook(_contiguous_outputs)
        layers = [_inputs_need_grad, *stage_layers]
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        # DeepSpeed's PipelineModule, left on the host: the stage is placed below, after loading, with the
        # swapped blocks kept off the device (patches/deepspeed_stage_module.py).
        self.module = build_stage_module(
            layers,
            num_stages=spec.train.pipeline_stages,
            loss_fn=mse_loss,
            partition_method="parameters" if spec.train.partition_method == "parameters" else "uniform",
            activation_checkpoint_interval=spec.train.checkpoint_interval if spec.train.gradient_checkpointing else 0,
            activation_checkpoint_func=checkpoint,
            dynamic_shape=True,
        )
        set_float_weights_trainable(dm, False)
        regex = run_target_regex(self.adapter, dm, spec.lora)  # the preset within the LoRA Adapter's blocks
        if spec.lora.init_lora:  # the whole model's targets: a stage sees only its own
            check_init_lora(read_init_file(spec.lora.init_lora), spec.lora, dm, regex)
        self.boundaries = [int(p) for p in self.module.parts]
        self.plan = describe(layers, self.boundaries, regex)
        require_lora_on_every_stage(self.plan, spec.lora.targets)
        swap_problem = blocks_to_swap_problem(spec.train.blocks_to_swap, swappable_per_stage(layers, self.boundaries))
        if swap_problem:  # every rank sees the whole split, so all raise together
            raise ValueError(swap_problem)
        local = [(int(name), layer) for name, layer in self.module.named_children() if name.isdigit()]
        self.layer_paths = {i: dict(getattr(layer, "comfy_paths", {})) for i, layer in local}
        local_layers = [layer for _, layer in local]
        self.foreign_paths = foreign_module_paths(layers, {i for i, _ in local})
        if deferred is not None:
            finish_loading(patcher, deferred, self.foreign_paths)
        unshared = unshared_tensors(local, dm)
        if unshared:  # a family's layer holds a tensor loading does not fill: it would train on garbage
            raise RuntimeError(f"{len(unshared)} tensor(s) of the {self.family} stage layers are not the model's "
                               f"own, which loading fills: {', '.join(unshared[:5])}. The family adapter must adopt "
                               "them (StageLayer.adopt, adopt_tensor), not copy them.")
        wait_for_all_ranks(ctx.load_group)  # the next collectives have the (shorter) training timeout
        # Swapped blocks keep their frozen weights in host memory from the start: only the rest of the
        # stage (and, after injection, every LoRA) goes to the device, so the stage never sits whole there.
        swapped = last_swappable(local_layers, spec.train.blocks_to_swap)
        place_stage(local_layers, swapped, ctx.device)
        self.lora_count = inject_lora(local, regex, spec.lora, spec.train.seed)
        params = freeze_all_but_lora(self.module)
        if move_trainable(swapped, ctx.device):  # new Parameter objects: collect them again
            params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError(
                f"No LoRA target matched on pipeline stage {self.module.stage_id} (preset {spec.lora.targets!r}, "
                f"layers {sorted(self.layer_paths)}): choose a wider target preset or fewer pipeline stages."
            )
        self.optim = build_optimizer(spec, [(n, p) for n, p in self.module.named_parameters() if p.requires_grad])
        optimizer, scheduler = self.optim.optimizer, self.optim.scheduler
        self.block_swapper = BlockSwapper(swapped, ctx.device).attach() if swapped else None
        # The engine leaves the stage where it is and broadcasts only the LoRA (patches/deepspeed_stage_engine.py).
        self.engine = build_stage_engine(self.module, optimizer, scheduler, params,
                                         deepspeed_config(spec, data_parallel=self.data_parallel))
        use_single_backward(self.engine)
        if spec.train.max_grad_norm > 0:
            self.clipping = GlobalNormClipping(spec.train.max_grad_norm, self.engine.grid.get_pipe_parallel_group())
            optimizer.register_step_pre_hook(self.clipping)
        self.scheduler = scheduler
        self.batches = MicroBatches(
            self._examples(model), spec.train.batch_size, spec.train.seed, model, self.adapter,
            timesteps, ctx.device,
            replica=self.engine.grid.data_parallel_id, replicas=self.data_parallel,
            family_options=self.family_options,
        )
        self.feed = self._with_regularization(model, timesteps)  # what the steps draw from
        self.validation = self._validation_batches(model)
        seed_rank_rngs(spec.train.seed, ctx.rank)  # LoRA dropout; a resumed run restores the saved states
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
                broadcast_tensors_stage0=self.engine.broadcast_tensors, trainable_tensors_stage0=len(params),
            )

    def _examples(self, model) -> list:
        """The cached examples this stage uses: inputs on the first stage, targets (latents only) on the
        last, nothing in between (DeepSpeed loads micro-batches on those two stages only)."""
        stages = self.spec.train.pipeline_stages
        first, last = self.stage_id == 0, self.stage_id == stages - 1
        examples = []
        if first or last:
            text_dtype = model.manual_cast_dtype or model.get_dtype()
            examples = load_examples(self.spec.items, text=first, text_dtype=text_dtype)
        dm = model.diffusion_model
        self.ctx.events.emit(
            "stage_memory", rank=self.ctx.rank, stage=self.stage_id, examples=len(examples), text=first,
            cache_reads=read_totals(),
            local_bytes=resident_bytes(self.module),
            foreign_bytes=sum(resident_bytes(dm.get_submodule(p)) for p in self.foreign_paths),
        )
        return examples

    def _with_regularization(self, model, timesteps) -> MicroBatches | MixedMicroBatches:
        """The training micro-batches, with the regularization images mixed in when the run has them
        (their own stream and seed; examples read on the first and last stage only, like training's)."""
        reg = self.spec.regularization
        if not reg.enabled:
            return self.batches
        first, last = self.stage_id == 0, self.stage_id == self.spec.train.pipeline_stages - 1
        examples = []
        if first or last:
            examples = load_examples(reg.items, text=first, text_dtype=model.manual_cast_dtype or model.get_dtype())
        b = self.batches
        stream = MicroBatches(examples, b.batch_size, regularization_seed(self.spec.train.seed), model, self.adapter,
                              timesteps, self.ctx.device, replica=b.replica, replicas=b.replicas,
                              family_options=self.family_options)
        return MixedMicroBatches(b, stream, reg.ratio, reg.weight)

    def _validation_batches(self, model) -> ValidationBatches | None:
        """The held-out micro-batches (examples read on the first and last stage only, like training's)."""
        val = self.spec.validation
        if not val.enabled:
            return None
        first, last = self.stage_id == 0, self.stage_id == self.spec.train.pipeline_stages - 1
        examples = []
        if first or last:
            examples = load_examples(val.items, text=first, text_dtype=model.manual_cast_dtype or model.get_dtype())
        return ValidationBatches(examples, val.sigmas, self.batches)

    def _evaluate(self, board: TensorBoardLog) -> None:
        """The validation loss of the current LoRA, the same value on every rank (DeepSpeed's forward-only
        schedule; every replica evaluates the whole held-out set, so no reduction across replicas)."""
        count = len(self.spec.validation.items) * self.spec.validation.sigmas
        loss = float(self.engine.eval_batch(iter(self.validation), num_micro_batches=count))
        check_loss(loss, self.step, self.spec.optimizer.lr)
        if self.ctx.rank == 0:
            self.ctx.events.emit("validation", step=self.step, loss=loss, examples=count)
            board.scalars(self.step, {"loss/validation": loss})

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
        data = self.feed.iterate(self.step * ga)
        started = time.monotonic()
        first_step = self.step
        if ctx.rank == 0:
            resumed = f"resumed from step {first_step}; " if first_step else ""
            ctx.events.emit("phase", phase="first_step", step=first_step, total=spec.train.steps,
                            resumed_from=first_step,
                            text=f"{resumed}step {first_step}/{spec.train.steps}: first step (warming up)")
        board = TensorBoardLog.open(self.run_dir, self._note) if ctx.rank == 0 else TensorBoardLog()
        if self.validation is not None and first_step == 0:
            self._evaluate(board)  # the base model's loss: where the curve starts
        while self.step < spec.train.steps:
            t0 = time.monotonic()
            loss = float(self.engine.train_batch(data_iter=data))
            self.step += 1
            self.step_times.append(time.monotonic() - t0)
            check_loss(loss, self.step, spec.optimizer.lr)  # the same value on every rank: all stop here
            if ctx.rank == 0:
                now = time.monotonic()
                done = self.step - first_step
                rate = done / max(now - started, 1e-9)
                lr = self.optim.current_lr()
                grad_norm = self.clipping.last_norm if self.clipping is not None else None
                ctx.events.emit(
                    "step", step=self.step, total=spec.train.steps, loss=loss,
                    lr=lr, step_time=now - t0, it_s=rate, grad_norm=grad_norm,
                    eta_s=(spec.train.steps - self.step) / rate if rate > 0 else None,
                )
                board.scalars(self.step, {"loss/train": loss, "lr": lr, "grad_norm": grad_norm,
                                          "step_time_s": now - t0})
            if self.validation is not None and evaluation_due(self.step, spec.validation.every, spec.train.steps):
                self._evaluate(board)
            if self._stop_requested():
                board.close()
                self.save(final=False)
                return "stopped"
            every = spec.train.save_every
            if every and self.step % every == 0 and self.step < spec.train.steps:
                self.save(final=False)
        board.close()
        self.save(final=True)
        return "finished"

    def _note(self, text: str) -> None:
        """Tell the user once, in the run log and the events, about something worth knowing."""
        print(f"[pipetrainer] {text}", flush=True)
        self.ctx.events.emit("notice", text=text)

    def _stop_requested(self) -> bool:
        """True on every rank if any rank saw the stop file or lost its parent."""
        local = stop_path(self.run_dir).exists() or (self.spec.parent_pid > 0 and not process_alive(self.spec.parent_pid))
        return any_rank_requests_stop(local, None, self.ctx.device)

    # ---- saving --------------------------------------------------------------------------------
    def _gathered_lora(self) -> dict[str, torch.Tensor] | None:
        parts = gather_objects_to_rank0(stage_lora_tensors(self.module, self.layer_paths, self.spec.lora))
        if parts is None:
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
            "format": adapter_kind(s.lora.adapter).file_format, "adapter": s.lora.adapter,
            "save_dtype": s.lora.save_dtype, **self.family_metadata,
        }

    def save(self, final: bool) -> None:
        """Collective: checkpoint (LoRA + optimizer, all stages) and the LoRA file."""
        tag = f"step{self.step:07d}"
        ckpt_dir = self.run_dir / CHECKPOINT_DIR
        # Before DeepSpeed's files, so a checkpoint DeepSpeed calls complete always has them.
        save_rng_states(ckpt_dir / tag, self.ctx.rank, self.ctx.device)
        self.optim.save_state(ckpt_dir / tag, self.ctx.rank)  # the EMA, if on
        if self.ctx.rank == 0:
            save_checkpoint_spec(ckpt_dir / tag, self.spec)
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": self.step},
                                    exclude_frozen_parameters=True)
        # Inside: schedule-free's averaged weights (training weights restored bitwise after); the files
        # are written inside too, because the gathered tensors may share the parameters' storage.
        with self.optim.lora_weights():
            tensors = self._gathered_lora()
            if self.ctx.rank == 0:
                check_lora_update(tensors, self.step, self.spec.optimizer.lr,
                                  adapter_kind(self.spec.lora.adapter).zero_init_suffixes)
                path, copies = self._write_lora(tensors, final)
        if self.optim.ema is not None:
            with self.optim.ema_weights():
                ema = self._gathered_lora()
                if self.ctx.rank == 0:
                    atomic_save(ema, ema_path(path), {**self.metadata(), "ema_decay": str(self.optim.ema.decay)})
        if self.ctx.rank != 0:
            return
        write_saved_marker(ckpt_dir / tag, self.step, str(path))  # last: the checkpoint is complete
        self.ctx.events.emit("saved", path=str(path), step=self.step, final=final, checkpoint=str(ckpt_dir / tag),
                             copies=copies, ema=str(ema_path(path)) if self.optim.ema is not None else None)

    def _write_lora(self, tensors: dict[str, torch.Tensor], final: bool) -> tuple[Path, list[str]]:
        """Rank 0: write the LoRA file; return its path and the names it was linked or copied to."""
        # One file, several names (hard links, else copies): the final one at lora_output; each save,
        # named by run and step, where the stock LoraLoader lists it (step_loras_dir) and in the run dir.
        name = step_lora_name(self.spec.lora_output, self.run_dir, self.step)
        named = [Path(d) / name for d in (self.spec.step_loras_dir, self.run_dir / "loras") if str(d)]
        path = atomic_save(tensors, self.spec.lora_output if final else named[0], self.metadata())
        return path, [str(link_or_copy(path, other)) for other in named if other != path]

    def _apply_new_optimizer_settings(self, checkpoint: str) -> None:
        """After loading a checkpoint of other optimizer settings: put this run's into the optimizer."""
        earlier = recorded_spec(checkpoint)
        if earlier is None:  # check_resume refuses a checkpoint without a readable record
            raise RuntimeError(f"Checkpoint {checkpoint} has no readable record of its optimizer settings.")
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        before = build_optimizer(earlier, named).optimizer.param_groups
        after = build_optimizer(self.spec, named).optimizer.param_groups
        changed = apply_changed_hyperparameters(self.optim.optimizer, self.optim.scheduler, before, after)
        if changed and self.ctx.rank == 0:
            print(f"[pipetrainer] continuing with the new optimizer settings: {', '.join(changed)}", flush=True)

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
        check = check_resume(self.spec)  # refusals were raised in setup, before any work
        if check.warnings:  # changed settings: the loaded optimizer and schedule take the new ones
            self._apply_new_optimizer_settings(checkpoint)
        warning = check.warning_text if self.ctx.rank == 0 else ""
        if warning:
            print(f"[pipetrainer] warning: {warning}", flush=True)
            self.ctx.events.emit("warning", about="resume", step=self.step, text=warning)
        if not self.optim.load_state(ckpt, self.ctx.rank) and self.ctx.rank == 0:  # the EMA, if on
            self._note(f"checkpoint {checkpoint} holds no EMA (its run had ema_decay 0): the EMA starts from "
                       f"the weights of step {self.step}.")
        # Last: nothing after this may draw from the RNGs before the next step, as in an uninterrupted run.
        if not restore_rng_states(ckpt, self.ctx.rank, self.ctx.device) and self.spec.lora.dropout > 0:
            print(f"[pipetrainer] checkpoint {checkpoint} holds no RNG state for rank {self.ctx.rank} (written "
                  f"before they were saved): LoRA dropout draws after step {self.step} differ from an "
                  "uninterrupted run.", flush=True)
