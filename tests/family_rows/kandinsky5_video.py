"""Kandinsky 5 video: ComfyUI's own Kandinsky5 (video) config class at width 32, in memory (detection pins
widths of billions of parameters). The layout keeps what the video data flow needs: the 33 input channels per
pixel (16 latent, 16 image, 1 mask: ``visual_embed_dim`` 132 with patch (1, 2, 2), as the Lite and Pro video
models), 2 text and 2 visual blocks (a 2-stage split can fall inside either list), the video models' default
rope scale (1, 2, 2), a pooled vector (CLIP-L's 768 in the real model) and 3 latent frames.

ComfyUI gets the conditioning its sampler gives text-to-video: ``Kandinsky5.extra_conds`` of the noise and the
pooled vector (``c_concat``: zero image channels and a zero mask; ``y``). Image-to-video (``first_frame_clean``)
is checked against ``Kandinsky5ImageToVideo``'s conds in tests/test_kandinsky5_video.py.
"""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

CONTEXT, POOLED = 16, 8  # Qwen2.5-VL 7B's 3584 and CLIP-L's 768 in the real model
LATENT = (16, 3, 6, 8)  # 3 latent frames (9 pixel frames), even sides


def kandinsky5_video_small(seed: int = 53):
    """0.07 M parameters: width 32 (2 heads of 16, rotary axes 4 + 6 + 6), time width 16, feed-forward 64."""
    require_model_class("Kandinsky5")
    import comfy.supported_models

    unet = {"image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": CONTEXT,
            "in_text_dim2": POOLED, "time_dim": 16, "model_dim": 32, "ff_dim": 64, "visual_embed_dim": 132,
            "patch_size": (1, 2, 2), "num_text_blocks": 2, "num_visual_blocks": 2, "axes_dims": (4, 6, 6)}
    return from_config(comfy.supported_models.Kandinsky5, unet, seed=seed)


def comfy_conds(model, noise: torch.Tensor, pooled: torch.Tensor, **node_conds) -> dict:
    """What ComfyUI's sampler hands ``apply_model`` besides the text: ``Kandinsky5.extra_conds`` of the noise,
    the pooled vector and the conditioning node's values (``time_dim_replace``, ``concat_mask``)."""
    conds = model.extra_conds(noise=noise, device=torch.device("cpu"), pooled_output=pooled, **node_conds)
    return {name: cond.cond for name, cond in conds.items()}


_LOADED: list = []  # the newest loaded model: its extra_conds is the oracle of the row's ComfyUI kwargs


def _load(comfy_root, fixture_paths):
    patcher = kandinsky5_video_small()
    _LOADED[:] = [patcher.model]
    return patcher


def _kwargs(cond, pooled, options, extras):
    return comfy_conds(_LOADED[-1], torch.zeros(1, *LATENT), pooled)


ROWS = [
    Row("Kandinsky5Video", "ComfyUI's Kandinsky5 (video) config class, width 32 (detection pins 1792 / 4096), "
        "in memory; text-to-video", load=_load, latent=LATENT, tokens=5, comfy_kwargs=_kwargs),
]
