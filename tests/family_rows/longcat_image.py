"""LongCat-Image: ComfyUI's own LongCatImage config class at hidden 64 (detection pins the 3584-wide Qwen2.5-VL
context and the real hidden size), in memory.

LongCat's layout as ComfyUI's detection sets it (text rotary positions along axes 1 and 2, no guidance
embedding, no pooled vector) at tiny sizes: 1 double + 1 single block, so a 2-stage split falls between the
block kinds. The odd 7 x 5 latent exercises Flux's padding and crop; the 5 text tokens are the rope shift
``LongCatImage._apply_model`` puts on the image rows and columns.
"""

from __future__ import annotations

from . import Row
from .common import from_config, require_model_class

LONGCAT_CONTEXT = 16  # Qwen2.5-VL's 3584 in the real model


def longcat_image_small(seed: int = 31):
    """ComfyUI's LongCatImage config class, hidden 64, 2 heads: 0.19 M parameters."""
    require_model_class("LongCatImage")
    import comfy.supported_models
    from pipetrainer.devkit.fixtures import flux_params

    unet = {"image_model": "flux", **flux_params(
        in_channels=4, out_channels=4, vec_in_dim=None, context_in_dim=LONGCAT_CONTEXT, hidden_size=64,
        mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000,
        patch_size=2, qkv_bias=True, guidance_embed=False, txt_ids_dims=[1, 2])}
    return from_config(comfy.supported_models.LongCatImage, unet, seed=seed)


ROWS = [
    Row("LongCat", "ComfyUI's LongCatImage config class, hidden 64 (detection pins 3584-wide text), in memory",
        load=lambda comfy_root, fixture_paths: longcat_image_small(), latent=(4, 7, 5), tokens=5),
]
