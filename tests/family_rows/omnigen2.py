"""OmniGen2 and OmniGen2 with references: ComfyUI's own Omnigen2 config class at width 32 (detection pins
hidden size 2520 and 32 layers, about 4 B parameters), in memory. The latent has odd sides (padded to the
patch size and cropped by ComfyUI's forward); the edit row carries two reference latents of other sizes than
the noisy latent, one with odd sides, handed to ComfyUI's forward as ``ref_latents``."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

CONTEXT = 24  # Qwen2.5-VL-3B's 2048 in the real model
REFERENCE_SHAPES = ((16, 6, 4), (16, 5, 7))


def omnigen2_small(seed: int = 41):
    """OmniGen2's layout (grouped-query attention, 1 refiner of each kind, 2 layers, timestep scale 1000) at
    width 32 (2 heads of 16, 1 kv head), 0.11 M parameters."""
    require_model_class("Omnigen2")
    import comfy.supported_models

    unet = {"image_model": "omnigen2", "patch_size": 2, "in_channels": 16, "out_channels": None, "hidden_size": 32,
            "num_layers": 2, "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 1,
            "multiple_of": 16, "ffn_dim_multiplier": None, "norm_eps": 1e-5, "axes_dim_rope": [4, 6, 6],
            "axes_lens": [300, 512, 512], "text_feat_dim": CONTEXT, "timestep_scale": 1000.0}
    return from_config(comfy.supported_models.Omnigen2, unet, seed=seed)


def reference_latents(model, x0, g) -> dict[str, torch.Tensor]:
    """Two processed reference latents (as the data pipeline hands them over), sizes unlike the target's."""
    from pipetrainer.training.pipelines.base import reference_extra

    return {reference_extra(i): model.process_latent_in(torch.randn(1, *s, generator=g))
            for i, s in enumerate(REFERENCE_SHAPES)}


def _kwargs(cond, pooled, options, extras):
    """What ComfyUI's Omnigen2.extra_conds gives for a caption without padding: its length as num_tokens."""
    return {"num_tokens": cond.shape[1]}


def _edit_kwargs(cond, pooled, options, extras):
    from pipetrainer.training.pipelines.base import reference_extra

    return {**_kwargs(cond, pooled, options, extras),
            "ref_latents": [extras[reference_extra(i)] for i in range(len(extras))]}


ROWS = [
    Row("Omnigen2", "ComfyUI's Omnigen2 config class, width 32 (detection pins 2520), in memory",
        load=lambda comfy_root, fixture_paths: omnigen2_small(), latent=(16, 7, 5), tokens=5, comfy_kwargs=_kwargs),
    Row("Omnigen2", "the same model with two reference latents (ref_latents), as an edit",
        load=lambda comfy_root, fixture_paths: omnigen2_small(), latent=(16, 6, 8), tokens=4,
        extras=reference_latents, comfy_kwargs=_edit_kwargs, id="Omnigen2Edit"),
]
