"""Ernie-Image: ComfyUI's own ErnieImage config class at hidden 32 (detection pins nothing but the family, so
ComfyUI builds the defaults: hidden 4096, 36 blocks, about 8 B parameters), in memory.

The layout keeps what Ernie-Image's data flow needs: image patches then projected text in one sequence (text
24 wide, so ``text_proj`` exists as on the real 3072-wide model), the modulation shared by the blocks, the
3-axis rotary table over (index, row, column) and 2 blocks, so a 2-stage split falls between them. 8 latent
channels stand in for the Flux.2 VAE's 128; the 5 x 7 latent has odd sides (patch 1, as detection builds it).
The row skips on a ComfyUI without ``model_base.ErnieImage`` (0.3.75), naming the class."""

from __future__ import annotations

from . import Row
from .common import from_config, require_model_class

ERNIE_CONTEXT = 24  # Ministral-3 3B's 3072 in the real model


def ernie_image_small(seed: int = 5):
    """0.03 M parameters: hidden 32 (2 heads of 16, rotary axes 4 + 6 + 6), 2 blocks, MLP 64."""
    import comfy.supported_models

    unet = {"image_model": "ernie", "hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
            "ffn_hidden_size": 64, "in_channels": 8, "out_channels": 8, "patch_size": 1,
            "text_in_dim": ERNIE_CONTEXT, "rope_theta": 256, "rope_axes_dim": (4, 6, 6)}
    return from_config(comfy.supported_models.ErnieImage, unet, seed=seed)


def _load(comfy_root, fixture_paths):
    require_model_class("ErnieImage")
    return ernie_image_small()


ROWS = [
    Row("ErnieImage", "ComfyUI's ErnieImage config class, hidden 32 (detection builds 4096), in memory",
        load=_load, latent=(8, 5, 7), tokens=5),
]
