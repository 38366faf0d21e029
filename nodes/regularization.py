"""``Regularization Images (PipeTrainer)``: prior images mixed into training, with their own loss weight.

The node only records the choice; Train LoRA checks the cache against the model (nodes/checks/preflight.py)
and puts it into the run spec, and the training process interleaves whole micro-batches of it with the
training images (training/data/regularization.py: which micro-batches, and why that keeps resume exact).
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from ..training.spec.choices import SpecError
from ..training.spec.options import RegularizationSpec
from .types import CATEGORY, Cache

RegularizationConfig = io.Custom("PIPETRAINER_REGULARIZATION")


@dataclass(frozen=True)
class RegularizationChoice:
    cache: object  # the CacheResult of a second Dataset -> Cache chain
    weight: float
    ratio: float

    def spec(self) -> RegularizationSpec:
        """The run spec's part; raises :class:`SpecError` naming what to change."""
        items = tuple(getattr(self.cache, "items", ()))
        if not items:
            raise SpecError(["The regularization cache has no items: add captioned images to its dataset folder "
                             "and run its 'Cache Latents & Text' again."])
        spec = RegularizationSpec(items=items, weight=self.weight, ratio=self.ratio)
        problems = spec.problems()
        if problems:
            raise SpecError(problems)
        return spec


class PipeTrainerRegularization(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerRegularization",
            display_name="Regularization Images (PipeTrainer)",
            category=CATEGORY,
            description="Prior-preservation images (e.g. generic images of the class) trained alongside the "
                        "dataset, so the LoRA learns the subject without forgetting the class. Whole "
                        "micro-batches come from them at the given ratio; their loss is scaled by weight.",
            inputs=[
                Cache.Input("cache", tooltip="A second 'Cache Latents & Text' of the regularization folder, "
                                             "encoded with the same VAE and text encoder as the training cache."),
                io.Float.Input("weight", default=1.0, min=0.0, max=100.0, step=0.05,
                               tooltip="Scale of their loss: 1.0 weighs a regularization image like a training "
                                       "image, 0 adds nothing to the gradient."),
                io.Float.Input("ratio", default=0.5, min=0.01, max=0.99, step=0.01,
                               tooltip="Share of micro-batches drawn from the regularization images (0.5: every "
                                       "other one). A micro-batch is all training or all regularization images."),
            ],
            outputs=[RegularizationConfig.Output(display_name="regularization",
                                                 tooltip="For Train LoRA's regularization input.")],
        )

    @classmethod
    def execute(cls, cache, weight: float, ratio: float) -> io.NodeOutput:
        return io.NodeOutput(RegularizationChoice(cache=cache, weight=weight, ratio=ratio))
