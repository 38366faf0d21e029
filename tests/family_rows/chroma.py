"""Chroma: ComfyUI's Chroma config class at hidden 64 (detection pins hidden 3072, >= 619 M), in memory."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config


def chroma_small():
    import comfy.supported_models
    from comfy.ldm.chroma.model import ChromaParams

    unet = {"image_model": "chroma", "in_channels": 16, "out_channels": 16, "context_in_dim": 8, "hidden_size": 64,
            "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12],
            "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 32,
            "n_layers": 2}
    fields = ChromaParams.__dataclass_fields__
    unet.update({k: v for k, v in (("txt_ids_dims", []), ("vec_in_dim", None)) if k in fields})  # current ComfyUI
    return from_config(comfy.supported_models.Chroma, unet, seed=66)


def _kwargs(cond, pooled, options, extras):
    """ComfyUI's Chroma guidance when a graph sets none (``model_base.Chroma.extra_conds``): 0."""
    return {"guidance": torch.zeros(cond.shape[0])}


ROWS = [
    Row("Chroma", "ComfyUI's Chroma config class, hidden 64 (detection pins 3072), in memory",
        load=lambda comfy_root, fixture_paths: chroma_small(), latent=(4, 7, 5), tokens=5, comfy_kwargs=_kwargs),
]
