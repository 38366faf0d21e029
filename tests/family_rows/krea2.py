"""Krea 2: ComfyUI's own Krea2 config class at width 32 (detection pins head size 128 and a 12 x 2560-wide
text stack: billions of parameters), in memory. The layout keeps what Krea 2's data flow needs: the text
fusion transformer over a stack of 3 text layers (12 in the real model), grouped-query attention (2 query
heads, 1 key/value head), 2 single-stream blocks (so a 2-stage split falls between them), and Qwen-Image's
16-channel latent format (5-D, one frame); the odd latent sides exercise ComfyUI's padding and crop."""

from __future__ import annotations

from . import Row
from .common import from_config, require_model_class

TXT_LAYERS, TXT_DIM = 3, 16  # 12 x 2560 in the real model


def krea2_small(seed: int = 5):
    """0.08 M parameters (the 128-wide SwiGLU MLPs are the least ComfyUI's rounding allows)."""
    require_model_class("Krea2")
    import comfy.supported_models

    unet = {"image_model": "krea2", "features": 32, "tdim": 32, "heads": 2, "kvheads": 1, "multiplier": 1,
            "layers": 2, "patch": 2, "channels": 16, "txtdim": TXT_DIM, "txtlayers": TXT_LAYERS, "txtheads": 2,
            "txtkvheads": 2}
    return from_config(comfy.supported_models.Krea2, unet, seed=seed)


ROWS = [
    Row("Krea2", "ComfyUI's Krea2 config class, width 32 (detection pins 128-wide heads), in memory",
        load=lambda comfy_root, fixture_paths: krea2_small(), latent=(16, 1, 7, 5), tokens=5),
]
