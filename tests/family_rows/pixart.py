"""PixArt Sigma and PixArt Alpha: ComfyUI's own PixArtSigma and PixArtAlpha config classes at hidden size 48
(detection pins 1152: about 21 M parameters a block), in memory.

The latent is 40 x 36: PixArt needs even sides (ComfyUI's position table and un-patchify take ``H // 2``
patches), and ComfyUI derives the sin-cos table's ``base_size`` and ``pe_interpolation`` from
``round((H + W) / 2 / 64)``, which is 0 below 32 latent pixels (a degenerate table): 38 gives 1, a real
table. The Alpha row adds the size and aspect-ratio micro-conditions, which ComfyUI computes from the
latent's size exactly as the trainer does (no width or height in the conditioning)."""

from __future__ import annotations

from . import Row
from .common import from_config

PIXART_CONTEXT = 40  # T5-XXL's 4096 in the real model


def _unet(model: str, micro: bool) -> dict:
    return {"image_model": model, "patch_size": 2, "in_channels": 4, "hidden_size": 48, "depth": 2, "num_heads": 2,
            "caption_channels": PIXART_CONTEXT, "model_max_length": 8, "micro_condition": micro}


def pixart_sigma_small(seed: int = 13):
    """0.12 M parameters: 2 blocks, learned sigma (8 output channels), no micro-conditions."""
    import comfy.supported_models

    return from_config(comfy.supported_models.PixArtSigma, _unet("pixart_sigma", False), seed=seed)


def pixart_alpha_small(seed: int = 23):
    """PixArt Sigma's layout plus Alpha's size and aspect-ratio embedders: 0.13 M parameters."""
    import comfy.supported_models

    return from_config(comfy.supported_models.PixArtAlpha, _unet("pixart_alpha", True), seed=seed)


ROWS = [
    Row("PixArt", "ComfyUI's PixArtSigma config class, hidden 48 (detection pins 1152), in memory",
        load=lambda comfy_root, fixture_paths: pixart_sigma_small(), latent=(4, 40, 36), tokens=5, id="PixArtSigma"),
    Row("PixArt", "ComfyUI's PixArtAlpha config class, hidden 48 (detection pins 1152), in memory",
        load=lambda comfy_root, fixture_paths: pixart_alpha_small(), latent=(4, 40, 36), tokens=5, id="PixArtAlpha"),
]
