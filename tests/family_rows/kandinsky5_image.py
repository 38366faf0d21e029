"""Kandinsky 5 Image: ComfyUI's own Kandinsky5Image config class at width 32 (detection pins model width 2560 and
the 3584-wide Qwen2.5-VL context: billions of parameters), in memory. The layout keeps what Kandinsky 5's data
flow needs: 2 text blocks and 2 visual blocks (so a 2-stage split can fall inside either list), a pooled vector
(CLIP-L's 768 in the real model), the image model's rope scale (1, 1, 1), the Flux VAE's 16 latent channels and
patch (1, 2, 2); even latent sides, as ComfyUI's forward needs (it pads odd ones but never crops its output)."""

from __future__ import annotations

from . import Row
from .common import from_config, require_model_class

CONTEXT, POOLED = 16, 8  # Qwen2.5-VL 7B's 3584 and CLIP-L's 768 in the real model


def kandinsky5_image_small(seed: int = 51):
    """0.06 M parameters: width 32 (2 heads of 16, rotary axes 4 + 6 + 6), time width 16, feed-forward 64."""
    require_model_class("Kandinsky5Image")
    import comfy.supported_models

    unet = {"image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": CONTEXT,
            "in_text_dim2": POOLED, "time_dim": 16, "model_dim": 32, "ff_dim": 64, "visual_embed_dim": 64,
            "patch_size": (1, 2, 2), "num_text_blocks": 2, "num_visual_blocks": 2, "axes_dims": (4, 6, 6),
            "rope_scale_factor": (1.0, 1.0, 1.0)}
    return from_config(comfy.supported_models.Kandinsky5Image, unet, seed=seed)


def _kwargs(cond, pooled, options, extras):
    return {"y": pooled}


ROWS = [
    Row("Kandinsky5Image", "ComfyUI's Kandinsky5Image config class, width 32 (detection pins 2560), in memory",
        load=lambda comfy_root, fixture_paths: kandinsky5_image_small(), latent=(16, 8, 6), tokens=5,
        comfy_kwargs=_kwargs),
]
