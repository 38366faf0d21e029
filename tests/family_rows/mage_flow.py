"""Mage-Flow and Mage-Flow-Edit: ComfyUI's own MageFlow config class at width 32 (detection pins 24 heads of
128, about 4 B parameters), in memory. The latent keeps Flux 2's 128 channels (Mage's VAE, ComfyUI's
``Flux2`` latent format) and odd sides, which Mage's centred rotary positions treat unlike Qwen-Image's; the
edit row carries two reference latents of other sizes than the noisy latent, handed to ComfyUI's forward as
``ref_latents``."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

CONTEXT = 24  # Qwen3-VL-4B's 2560 in the real model
REFERENCE_SHAPES = ((128, 6, 4), (128, 5, 7))


def mage_flow_small(seed: int = 31):
    """2 of Qwen-Image's blocks at width 32 (2 heads of 16), 0.1 M parameters (mostly the 128-channel input and output projections)."""
    require_model_class("MageFlow")
    import comfy.supported_models

    unet = {"image_model": "mage_flow", "in_channels": 128, "out_channels": 128, "num_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": CONTEXT,
            "axes_dims_rope": (4, 6, 6)}
    return from_config(comfy.supported_models.MageFlow, unet, seed=seed)


def reference_latents(model, x0, g) -> dict[str, torch.Tensor]:
    """Two processed reference latents (as the data pipeline hands them over), sizes unlike the target's."""
    from pipetrainer.training.pipelines.base import reference_extra

    return {reference_extra(i): model.process_latent_in(torch.randn(1, *s, generator=g))
            for i, s in enumerate(REFERENCE_SHAPES)}


def edit_kwargs(cond, pooled, options, extras):
    from pipetrainer.training.pipelines.base import reference_extra

    return {"ref_latents": [extras[reference_extra(i)] for i in range(len(extras))]}


ROWS = [
    Row("MageFlow", "ComfyUI's MageFlow config class, width 32 (detection pins 3072), in memory",
        load=lambda comfy_root, fixture_paths: mage_flow_small(), latent=(128, 7, 5), tokens=5),
    Row("MageFlow", "the same model as an edit model: two reference latents (ref_latents)",
        load=lambda comfy_root, fixture_paths: mage_flow_small(), latent=(128, 6, 7), tokens=4,
        extras=reference_latents, comfy_kwargs=edit_kwargs, id="MageFlowEdit"),
]
