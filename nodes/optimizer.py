"""``Optimizer (PipeTrainer)``: the optimizer, learning-rate schedule, LoRA+ and EMA, as a frozen spec part."""

from __future__ import annotations

from comfy_api.latest import io

from ..training.optim.optimizers import missing_package_problem
from ..training.spec.choices import OPTIMIZERS, SCHEDULES, SpecError
from ..training.spec.options import OptimizerSpec
from .node_problems import refuse_once
from .types import CATEGORY, OptimizerConfig


class PipeTrainerOptimizer(io.ComfyNode):
    """The optimizer, its learning-rate schedule, LoRA+ and the EMA. Every combination problem is reported
    at once, on the widgets involved, before the graph runs (:meth:`validate_inputs`)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        # New inputs go last (saved workflows store widget values by position) and are optional (an API
        # workflow saved before them still validates, with their defaults).
        return io.Schema(
            node_id="PipeTrainerOptimizer",
            display_name="Optimizer (PipeTrainer)",
            category=CATEGORY,
            inputs=[
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="AdamW",
                               tooltip="AdamW; AdamW8bit and Adafactor (less memory); Prodigy (own step size: "
                                       "learning_rate 1.0); Lion (3-10x lower learning rate); CAME; "
                                       "AdamWScheduleFree (no schedule). README: Optimizer."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1.0, step=1e-6,
                               tooltip="Peak learning rate (Prodigy: 1.0)."),
                io.Float.Input("weight_decay", default=0.01, min=0.0, max=1.0, step=0.001,
                               tooltip="Decoupled weight decay on the adapter's matrices (never on 1-D weights)."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100000,
                             tooltip="Steps of linear warm-up to the learning rate: step k runs at (k+1)/warmup_steps "
                                     "of it. Must be fewer than the Train node's steps."),
                io.Combo.Input("schedule", options=list(SCHEDULES), default="constant",
                               tooltip="After warm-up: constant, or decay linearly / along a cosine / along cosines "
                                       "that restart (cycles) down to min_lr_ratio x the rate. Schedule-free "
                                       "optimizers take constant."),
                io.Float.Input("min_lr_ratio", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Where a decaying schedule ends, as a fraction of the learning rate."),
                io.Int.Input("cycles", default=1, min=1, max=1000, optional=True,
                             tooltip="cosine_with_restarts: how many cosine cycles after the warm-up."),
                io.Float.Input("lora_plus_ratio", default=0.0, min=0.0, max=1000.0, step=0.5, optional=True,
                               tooltip="LoRA+: lora_B learns at this multiple of the learning rate (16 is usual). "
                                       "0 or 1 = off. Not with Prodigy."),
                io.Float.Input("ema_decay", default=0.0, min=0.0, max=0.99999, step=0.0001, optional=True,
                               tooltip="Also save an exponential moving average of the adapter weights as "
                                       "<name>_ema.safetensors next to the LoRA (0.999 is usual). 0 = off."),
            ],
            outputs=[OptimizerConfig.Output(display_name="optimizer", tooltip="Optimizer settings for Train LoRA.")],
        )

    @classmethod
    def validate_inputs(cls, optimizer: str | None = None, learning_rate: float | None = None,
                        schedule: str | None = None, min_lr_ratio: float | None = 0.0, cycles: int | None = 1,
                        lora_plus_ratio: float | None = 0.0, ema_decay: float | None = 0.0) -> bool | str:
        """The inputs that combine (ComfyUI skips its own range and choice checks of them, which
        :meth:`OptimizerSpec.problems` makes), reported once on the node (nodes/node_problems.py). A linked
        input has no value yet (None): then :meth:`execute` checks; an absent optional one has its default.
        warmup_steps against the run's steps: the Train node."""
        values = (optimizer, learning_rate, schedule, min_lr_ratio, cycles, lora_plus_ratio, ema_decay)
        if any(v is None for v in values):
            return True
        spec = OptimizerSpec(name=optimizer, lr=learning_rate, schedule=schedule, min_lr_ratio=min_lr_ratio,
                             cycles=cycles, lora_plus_ratio=lora_plus_ratio, ema_decay=ema_decay)
        problems = spec.problems()
        missing = missing_package_problem(optimizer)
        if missing:
            problems.append(missing)
        return refuse_once(problems)

    @classmethod
    def execute(cls, optimizer: str, learning_rate: float, weight_decay: float, warmup_steps: int,
                schedule: str, min_lr_ratio: float = 0.0, cycles: int = 1, lora_plus_ratio: float = 0.0,
                ema_decay: float = 0.0) -> io.NodeOutput:
        spec = OptimizerSpec(name=optimizer, lr=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps,
                             schedule=schedule, min_lr_ratio=min_lr_ratio, cycles=cycles,
                             lora_plus_ratio=lora_plus_ratio, ema_decay=ema_decay)
        problems = spec.problems()
        if problems:
            raise SpecError(problems)
        return io.NodeOutput(spec)
