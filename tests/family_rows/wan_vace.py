"""Wan 2.1 VACE: ComfyUI's own WAN21_Vace config class at width 64, in memory (detection pins UMT5-XXL's
4096-wide text input). 4 main blocks and 2 VACE blocks: ComfyUI's mapping puts VACE block 0 after main
block 0 and block 1 after main block 2, so a plain main block sits between and after them, and a 2-stage
split can cut while the control tokens are still carried. ``vace_in_dim`` 96 as the releases (32 latent
channels of the inactive and reactive control video, 64 of the folded mask).

The control conditioning is ComfyUI's: ``WAN21_Vace.extra_conds`` of two streams of seeded raw control
latents and seeded soft masks (what two chained ``WanVaceToVideo`` nodes hand it) gives ``vace_context``
``[B, 2, 96, F, H, W]``, the row's extra as the cache stores it; ComfyUI's ``apply_model`` gets that
``vace_context`` and ``vace_strength`` [1.0, 1.0]. Two streams, so the generic checks (LoRA gradients, stage
split) cover the ``[N * B, L, dim]`` control tokens crossing a stage boundary. How the
control clip becomes those latents and that mask is checked against ``WanVaceToVideo`` itself in
tests/test_wan_vace.py.
"""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

CONTEXT = 16  # UMT5-XXL's 4096 in the real model
LATENT = (16, 3, 6, 8)  # 3 latent frames (9 pixel frames), even sides
VACE_IN = 96


def wan_vace_small(seed: int = 61):
    """0.40 M parameters: width 64 (2 heads of 32), feed-forward 128, 4 main and 2 VACE blocks."""
    require_model_class("WAN21_Vace")
    import comfy.supported_models

    unet = {"image_model": "wan2.1", "model_type": "vace", "patch_size": (1, 2, 2), "in_dim": 16, "dim": 64,
            "ffn_dim": 128, "freq_dim": 256, "text_dim": CONTEXT, "out_dim": 16, "num_heads": 2, "num_layers": 4,
            "vace_layers": 2, "vace_in_dim": VACE_IN, "eps": 1e-6}
    return from_config(comfy.supported_models.WAN21_Vace, unet, seed=seed)


STREAMS = 2  # control streams, as two chained WanVaceToVideo nodes give


def vace_context(model, frames: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """``[B, N, 96, F, H, W]``: ``WAN21_Vace.extra_conds``' vace_context of N control videos' raw latents
    (each ``[B, 32, F, H, W]``, inactive then reactive) and folded masks (each ``[B, 64, F, H, W]``)."""
    conds = model.extra_conds(noise=torch.zeros(frames[0].shape[0], 16, *frames[0].shape[2:]),
                              device=torch.device("cpu"), vace_frames=frames, vace_mask=masks)
    return conds["vace_context"].cond


def _extras(model, x0, g):
    frames = [torch.randn(x0.shape[0], 32, *x0.shape[2:], generator=g) for _ in range(STREAMS)]
    masks = [torch.rand(x0.shape[0], 64, *x0.shape[2:], generator=g) for _ in range(STREAMS)]
    return {"vace_context": vace_context(model, frames, masks)}


def _kwargs(cond, pooled, options, extras):
    return {"vace_context": extras["vace_context"], "vace_strength": [1.0] * extras["vace_context"].shape[1]}


ROWS = [
    Row("WanVace", "ComfyUI's WAN21_Vace config class, width 64 (detection pins text 4096), in memory; 4 main + "
        "2 VACE blocks, two seeded control streams", load=lambda comfy_root, fixture_paths: wan_vace_small(),
        latent=LATENT, tokens=5, extras=_extras, comfy_kwargs=_kwargs),
]
