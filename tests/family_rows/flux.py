"""FLUX.1: ComfyUI's own Flux config class at hidden 64 (detection pins 3072), in memory."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config


def flux_small():
    import comfy.supported_models
    from pipetrainer.devkit.fixtures import flux_params

    unet = {"image_model": "flux", **flux_params(
        in_channels=4, out_channels=4, vec_in_dim=8, context_in_dim=8, hidden_size=64, mlp_ratio=2.0, num_heads=2,
        depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2, qkv_bias=True,
        guidance_embed=True)}
    return from_config(comfy.supported_models.Flux, unet, seed=64)


def _kwargs(cond, pooled, options, extras):
    return {"y": pooled, "guidance": torch.full((cond.shape[0],), options.guidance)}


ROWS = [
    Row("Flux", "ComfyUI's Flux config class, hidden 64 (detection pins 3072), in memory",
        load=lambda comfy_root, fixture_paths: flux_small(), latent=(4, 7, 5), tokens=5, comfy_kwargs=_kwargs),
]
