"""Qwen-Image and Qwen-Image-Edit: ComfyUI's own QwenImage config class at hidden 32 (detection pins
3072 wide blocks, >= 380 M), in memory. The edit row carries two reference latents of other sizes
than the noisy latent, handed to ComfyUI's forward as ``ref_latents``."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config

CONTEXT = 32  # the tiny model's text width (Qwen2.5-VL's 3584 in the real model)


def qwen_image_small(**extra):
    """A 2-block Qwen-Image with 16 latent channels (the Wan 2.1 latent format it shares), ~0.1 M params."""
    import comfy.supported_models

    unet = {"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": CONTEXT,
            "axes_dims_rope": (4, 6, 6), **extra}
    return from_config(comfy.supported_models.QwenImage, unet, seed=77)


def reference_latents(model, x0, g) -> dict[str, torch.Tensor]:
    """Two processed reference latents (as the data pipeline hands them over), sizes unlike the target's."""
    from pipetrainer.training.pipelines.base import reference_extra

    shapes = [(1, 16, 1, 6, 9), (1, 16, 1, 5, 4)]
    return {reference_extra(i): model.process_latent_in(torch.randn(s, generator=g)) for i, s in enumerate(shapes)}


def edit_kwargs(cond, pooled, options, extras):
    from pipetrainer.training.pipelines.base import reference_extra

    return {"ref_latents": [extras[reference_extra(i)] for i in range(len(extras))]}


ROWS = [
    Row("QwenImage", "ComfyUI's QwenImage config class, hidden 32 (detection pins 3072), in memory",
        load=lambda comfy_root, fixture_paths: qwen_image_small(), latent=(16, 1, 7, 5), tokens=5),
    Row("QwenImage", "the same model as an edit model: two reference latents (ref_latents, index method)",
        load=lambda comfy_root, fixture_paths: qwen_image_small(), latent=(16, 1, 6, 7), tokens=4,
        extras=reference_latents, comfy_kwargs=edit_kwargs, id="QwenImageEdit"),
]
