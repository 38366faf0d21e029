"""``Timestep Sampling (PipeTrainer)``: how Train LoRA draws noise levels; unconnected = the model's own."""

from __future__ import annotations

from comfy_api.latest import io

from ..training.spec.choices import LOSS_WEIGHTINGS, TIMESTEP_DISTRIBUTIONS, TIMESTEP_SHIFTS
from ..training.spec.options import TimestepSpec
from .node_problems import refuse_once
from .types import CATEGORY, TimestepConfig


class PipeTrainerTimesteps(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerTimesteps",
            display_name="Timestep Sampling (PipeTrainer)",
            category=CATEGORY,
            description="How training picks noise levels. Without this node Train LoRA uses uniform + the "
                        "model's own shift: the noise levels the model's sampler visits.",
            inputs=[
                io.Combo.Input("distribution", options=list(TIMESTEP_DISTRIBUTIONS), default="uniform",
                               tooltip="uniform: every point of the schedule equally often; logit_normal: "
                                       "favour the middle (SD3 paper), shaped by logit_mean / logit_std."),
                io.Combo.Input("shift", options=list(TIMESTEP_SHIFTS), default="model",
                               tooltip="model: the model's own shift (or a ModelSampling* node's before Train); "
                                       "none; fixed: shift_value; resolution: grows with image size (Flux-style, "
                                       "base_shift to max_shift)."),
                io.Float.Input("shift_value", default=3.0, min=0.01, max=100.0, step=0.01,
                               tooltip="The shift with shift = fixed (higher = more high-noise steps)."),
                io.Float.Input("logit_mean", default=0.0, min=-5.0, max=5.0, step=0.01,
                               tooltip="logit_normal: mean of the normal before the sigmoid (>0 = noisier)."),
                io.Float.Input("logit_std", default=1.0, min=0.01, max=5.0, step=0.01,
                               tooltip="logit_normal: spread of the normal before the sigmoid."),
                io.Float.Input("base_shift", default=0.5, min=-5.0, max=5.0, step=0.01,
                               tooltip="resolution: mu at 256 image tokens (shift = e^mu)."),
                io.Float.Input("max_shift", default=1.15, min=-5.0, max=5.0, step=0.01,
                               tooltip="resolution: mu at 4096 image tokens (1024x1024 for Flux)."),
                io.Float.Input("sigma_min", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Train only noise levels at or above this (e.g. a Wan 2.2 high-noise expert)."),
                io.Float.Input("sigma_max", default=1.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Train only noise levels at or below this (e.g. a Wan 2.2 low-noise expert)."),
                io.Combo.Input("loss_weighting", options=list(LOSS_WEIGHTINGS), default="none", optional=True,
                               tooltip="Flow models: scale each item's loss by its noise level (SD3's schemes). "
                                       "none: all alike; cosmap favours the middle; sigma_sqrt is huge at low "
                                       "noise. Validation stays unweighted."),
            ],
            outputs=[TimestepConfig.Output(display_name="timesteps", tooltip="For Train LoRA's timesteps input.")],
        )

    @classmethod
    def validate_inputs(cls, sigma_min: float = 0.0, sigma_max: float = 1.0) -> bool | str:
        """The sigma range, reported once on the node (nodes/node_problems.py)."""
        return refuse_once(TimestepSpec(sigma_min=sigma_min, sigma_max=sigma_max).problems())

    @classmethod
    def execute(cls, distribution: str, shift: str, shift_value: float, logit_mean: float, logit_std: float,
                base_shift: float, max_shift: float, sigma_min: float, sigma_max: float,
                loss_weighting: str = "none") -> io.NodeOutput:
        return io.NodeOutput(TimestepSpec(
            distribution=distribution, logit_mean=logit_mean, logit_std=logit_std, shift=shift,
            shift_value=shift_value, base_shift=base_shift, max_shift=max_shift,
            sigma_min=sigma_min, sigma_max=sigma_max, loss_weighting=loss_weighting))
