"""``Preview Settings (PipeTrainer)``: what the Train node renders every N steps, as a frozen value.

The settings are the stock KSampler's (seed, steps, cfg, sampler, scheduler) plus the empty latent's
size and the prompts, with the graph's CLIP and VAE: the Train node renders each new LoRA file with
exactly these through ComfyUI's own code (nodes/run/previews.py), so a preview is what the user gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import comfy.samplers
from comfy_api.latest import io

from .types import CATEGORY

PreviewConfig = io.Custom("PIPETRAINER_PREVIEWS")


@dataclass(frozen=True)
class PreviewSettings:
    clip: Any
    vae: Any
    prompts: tuple[str, ...]
    negative: str = ""
    width: int = 512
    height: int = 512
    frames: int = 1
    steps: int = 20
    seed: int = 0
    cfg: float = 1.0
    sampler_name: str = "euler"
    scheduler: str = "simple"
    every_n_steps: int = 100


def split_prompts(text: str) -> tuple[str, ...]:
    """One prompt per non-empty line."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def preview_save_every(save_every: int, every_n_steps: int) -> int:
    """The Train node's effective ``save_every`` with previews on: a LoRA file is written at every preview
    step (and still at every ``save_every`` step the user asked for)."""
    return math.gcd(save_every, every_n_steps) if save_every else every_n_steps


class PipeTrainerPreviewSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerPreviewSettings",
            display_name="Preview Settings (PipeTrainer)",
            category=CATEGORY,
            description="Sample images while training: every N steps the Train node loads that step's LoRA with "
                        "ComfyUI's own LoRA loader onto its model and samples these prompts with the stock "
                        "KSampler code, then decodes with this VAE. A preview is exactly what the LoRA gives in "
                        "ComfyUI.",
            inputs=[
                io.Clip.Input("clip", tooltip="Text encoder for the prompts (the one you will sample with)."),
                io.Vae.Input("vae", tooltip="VAE that decodes the previews; also gives the latent size."),
                io.String.Input("prompts", multiline=True, default="a photo of sks",
                                tooltip="One prompt per line, one preview image each. Encoded exactly as typed: "
                                        "add your model's text template (Lumina 2's system prompt, the Dataset's "
                                        "prompt_prefix) in front of each line."),
                io.String.Input("negative", multiline=True, default="",
                                tooltip="Negative prompt for every preview (used when cfg > 1)."),
                io.Int.Input("width", default=512, min=16, max=8192, step=8, tooltip="Preview width in pixels."),
                io.Int.Input("height", default=512, min=16, max=8192, step=8, tooltip="Preview height in pixels."),
                io.Int.Input("frames", default=1, min=1, max=1024,
                             tooltip="Video models: frames per preview (as the family's empty video latent "
                                     "counts them). Image models ignore it."),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="Sampler steps, as on the KSampler."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=False,
                             tooltip="Noise seed, the same for every preview so they can be compared."),
                io.Float.Input("cfg", default=1.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale, as on the KSampler."),
                io.Combo.Input("sampler_name", options=list(comfy.samplers.KSampler.SAMPLERS), default="euler",
                               tooltip="Sampler, as on the KSampler."),
                io.Combo.Input("scheduler", options=list(comfy.samplers.KSampler.SCHEDULERS), default="simple",
                               tooltip="Scheduler, as on the KSampler."),
                io.Int.Input("every_n_steps", default=100, min=1, max=1_000_000,
                             tooltip="Render previews every N training steps and at the end. Each preview "
                                     "step also saves the LoRA file (and a small checkpoint) at that step."),
            ],
            outputs=[PreviewConfig.Output(display_name="previews",
                                          tooltip="To the 'previews' input of 'Train LoRA (PipeTrainer)'.")],
        )

    @classmethod
    def validate_inputs(cls, prompts: str | None = None) -> bool | str:
        if isinstance(prompts, str) and not split_prompts(prompts):
            return "prompts is empty: write at least one prompt (one per line)."
        return True

    @classmethod
    def execute(cls, clip, vae, prompts: str, negative: str, width: int, height: int, frames: int, steps: int,
                seed: int, cfg: float, sampler_name: str, scheduler: str, every_n_steps: int) -> io.NodeOutput:
        return io.NodeOutput(PreviewSettings(
            clip=clip, vae=vae, prompts=split_prompts(prompts), negative=negative, width=width, height=height,
            frames=frames, steps=steps, seed=seed, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
            every_n_steps=every_n_steps))
