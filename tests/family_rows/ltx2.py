"""LTX-2: ComfyUI's own LTXAV config class at width 64 per stream (detection pins 4096-wide video and 2048-wide
audio streams: billions of parameters), in memory. The layout keeps LTX-2's data flow: 2 audio-video blocks (a
2-stage split falls between them), the video VAE's 128 latent channels and the audio VAE's 8 x 16 latent and
the text encoder's features (the embed stage runs the model's embeddings connectors on them, as
``LTXAV.extra_conds`` does; they pad the text to their own length, so no text mask is handed on). The example is what ComfyUI's sampler hands ``apply_model``: the video and
audio latents packed into one (``latent_shapes``)."""

from __future__ import annotations

import functools

import torch

from . import Row
from .common import from_config, require_model_class

LATENT = (128, 3, 4, 5)  # the video latent [C, F, H, W]
AUDIO_FRAMES = 7  # audio latent frames: [8, 7, 16]
CAPTION = 16  # the caption width each stream's context has (3840 in the real model)


def ltx2_small(seed: int = 61):
    """0.6 M parameters: 32 heads of width 2 per stream (video and audio width 64), 2 blocks."""
    require_model_class("LTXAV")
    import comfy.supported_models

    unet = {"image_model": "ltxav", "num_layers": 2, "attention_head_dim": 2, "num_attention_heads": 32,
            "cross_attention_dim": 64, "audio_attention_head_dim": 2, "audio_num_attention_heads": 32,
            "audio_cross_attention_dim": 64, "caption_channels": CAPTION, "in_channels": 128,
            "audio_in_channels": 128, "connector_attention_head_dim": 8, "connector_num_attention_heads": 2,
            "connector_num_layers": 1}
    return from_config(comfy.supported_models.LTXAV, unet, seed=seed)


@functools.cache
def _connectors():
    """A model built alike (the same seeded weights): its embeddings connectors, which ``extra_conds`` runs."""
    return ltx2_small().model.diffusion_model


def ltx2_kwargs(cond, pooled, options, extras):
    """What ``LTXAV.extra_conds`` and the sampler hand the model: the cond through the model's embeddings connectors
    (``preprocess_text_embeds``), the frame rate and the packed streams' shapes."""
    shapes = [torch.Size((1, *LATENT)), torch.Size(extras["audio_latent"].shape)]
    with torch.no_grad():
        context = _connectors().preprocess_text_embeds(cond)
    return {"c_crossattn": context, "frame_rate": options.frame_rate, "latent_shapes": shapes}


def _extras(model, x0, g):
    """The clip's audio latent."""
    return {"audio_latent": torch.randn(1, 8, AUDIO_FRAMES, 16, generator=g)}


ROWS = [
    Row("LTX2", "ComfyUI's LTXAV config class, 64 wide per stream (detection pins 4096 / 2048), in memory",
        load=lambda comfy_root, fixture_paths: ltx2_small(), latent=LATENT, tokens=7, comfy_kwargs=ltx2_kwargs,
        extras=_extras),
]
