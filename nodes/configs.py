"""``LoRA Adapter`` and ``Optimizer``: small config nodes that produce frozen spec parts."""

from __future__ import annotations

import importlib.util

from comfy_api.latest import io

from ..training.spec import OPTIMIZERS, SCHEDULES, TARGET_PRESETS, LoraSpec, OptimizerSpec
from .types import CATEGORY, LoraConfig, OptimizerConfig


class PipeTrainerLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerLoRA",
            display_name="LoRA Adapter",
            category=CATEGORY,
            inputs=[
                io.Int.Input("rank", default=16, min=1, max=512, tooltip="LoRA rank (size of the low-rank update)."),
                io.Float.Input("alpha", default=16.0, min=0.01, max=1024.0, step=0.01,
                               tooltip="LoRA alpha; the update is scaled by alpha / rank. Free, not tied to rank."),
                io.Float.Input("dropout", default=0.0, min=0.0, max=0.9, step=0.01,
                               tooltip="Dropout on the LoRA input during training."),
                io.Combo.Input("targets", options=list(TARGET_PRESETS), default="attention_mlp",
                               tooltip="Which Linears get LoRA: attention only, attention + MLP, or every "
                                       "Linear of the transformer blocks (the family decides the names)."),
            ],
            outputs=[LoraConfig.Output(display_name="lora", tooltip="LoRA settings for Train LoRA.")],
        )

    @classmethod
    def execute(cls, rank: int, alpha: float, dropout: float, targets: str) -> io.NodeOutput:
        return io.NodeOutput(LoraSpec(rank=rank, alpha=alpha, dropout=dropout, targets=targets))


class PipeTrainerOptimizer(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerOptimizer",
            display_name="Optimizer",
            category=CATEGORY,
            inputs=[
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="AdamW",
                               tooltip="AdamW, or AdamW8bit (bitsandbytes) to save optimizer memory."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1.0, step=1e-6,
                               tooltip="Peak learning rate."),
                io.Float.Input("weight_decay", default=0.01, min=0.0, max=1.0, step=0.001,
                               tooltip="Decoupled weight decay on the LoRA weights."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100000,
                             tooltip="Steps of linear warm-up from 0 to the learning rate."),
                io.Combo.Input("schedule", options=list(SCHEDULES), default="constant",
                               tooltip="After warm-up: keep the rate constant or decay it along a cosine."),
            ],
            outputs=[OptimizerConfig.Output(display_name="optimizer", tooltip="Optimizer settings for Train LoRA.")],
        )

    @classmethod
    def validate_inputs(cls, optimizer: str, **_) -> bool | str:
        if optimizer == "AdamW8bit" and importlib.util.find_spec("bitsandbytes") is None:
            return "AdamW8bit needs bitsandbytes: run 'pip install bitsandbytes' in ComfyUI's Python, or choose AdamW."
        return True

    @classmethod
    def execute(cls, optimizer: str, learning_rate: float, weight_decay: float, warmup_steps: int,
                schedule: str) -> io.NodeOutput:
        return io.NodeOutput(OptimizerSpec(name=optimizer, lr=learning_rate, weight_decay=weight_decay,
                                           warmup_steps=warmup_steps, schedule=schedule))
