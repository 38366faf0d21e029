"""``Validation (PipeTrainer)``: a held-out set whose loss Train LoRA plots next to the training loss.

The node only records the choice; Train LoRA splits the cache (training/data/validation.py decides which
items, by content, so every run of a dataset holds out the same ones) and the training process
evaluates the held-out items at fixed noise and fixed sigmas.
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from ..training.data.validation import distinct_items, split_items, split_problems
from ..training.spec.choices import SpecError
from ..training.spec.options import CacheItem, ValidationSpec
from .types import CATEGORY, Cache, ValidationConfig


@dataclass(frozen=True)
class ValidationChoice:
    every: int
    fraction: float
    sigmas: int
    cache: object = None  # a CacheResult of its own (a validation folder), or None: hold out a fraction

    def split(self, items: tuple[CacheItem, ...]) -> tuple[tuple[CacheItem, ...], ValidationSpec]:
        """``(training items, validation spec)``; raises :class:`SpecError` naming what to change."""
        if self.cache is not None:
            held = distinct_items(self.cache.items)
            if not held:
                raise SpecError(["The validation cache has no items: add captioned images to its dataset folder."])
            return items, ValidationSpec(items=held, every=self.every, sigmas=self.sigmas)
        train, held = split_items(items, self.fraction)
        problems = split_problems(train, held, self.fraction)
        if problems:
            raise SpecError(problems)
        return train, ValidationSpec(items=held, every=self.every, sigmas=self.sigmas)


def hold_out_note(validation: ValidationSpec, own_cache: bool, shown: int = 5) -> str:
    """The line Train LoRA shows before step 0 (and the run log keeps): which images the loss is measured on."""
    names = sorted({item.source for item in validation.items})
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    where = "from the validation cache" if own_cache else "held out of the training cache, never trained on"
    return f"validation: {len(names)} image(s) {where}, every {validation.every} steps: {listed}"


class PipeTrainerValidation(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerValidation",
            display_name="Validation Loss (PipeTrainer)",
            category=CATEGORY,
            description="Evaluates held-out images every N steps at fixed noise and fixed noise levels, so the "
                        "numbers compare across steps and across runs; plotted with the training loss.",
            inputs=[
                io.Int.Input("every_n_steps", default=50, min=1, max=1_000_000,
                             tooltip="Evaluate every N steps, at the last step, and before the first step of a "
                                     "new run (the base model's loss, where the curve starts)."),
                io.Float.Input("fraction", default=0.1, min=0.0, max=0.9, step=0.01,
                               tooltip="Share of the training cache's images held out (never trained on), chosen "
                                       "by content so every run holds out the same ones. Ignored when a "
                                       "validation cache is wired."),
                io.Int.Input("noise_levels", default=4, min=1, max=64,
                             tooltip="Fixed noise levels per held-out image, drawn once from the run's timestep "
                                     "sampling. More = a smoother curve, slower evaluation."),
                Cache.Input("cache", optional=True,
                            tooltip="Optional: a second 'Cache Latents & Text' of a validation folder (encoded "
                                    "with the same VAE and text encoder); then no training image is held out."),
            ],
            outputs=[ValidationConfig.Output(display_name="validation", tooltip="For Train LoRA's validation input.")],
        )

    @classmethod
    def execute(cls, every_n_steps: int, fraction: float, noise_levels: int, cache=None) -> io.NodeOutput:
        return io.NodeOutput(ValidationChoice(every=every_n_steps, fraction=fraction, sigmas=noise_levels, cache=cache))
