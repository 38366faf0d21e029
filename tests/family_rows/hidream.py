"""HiDream I1 (ComfyUI 0.3.75 and current): ComfyUI's own HiDream config class at width 32 (detection pins 20
heads of 128, 4096-wide T5 and Llama states and 48 blocks: 17 B parameters), in memory. The layout keeps what
HiDream's data flow needs: 2 double-stream blocks and 1 single-stream block (so a 2-stage split falls between
blocks of each kind and at the switch), 3 routed SwiGLU experts of which 2 are active per token plus the
shared expert, a stack of 3 Llama layers read through ``llama_layers`` (one repeated, as the real model
repeats layer 31), the 2048-wide pooled CLIP vector ComfyUI's text encoder gives, and Flux's 16-channel
latent format; the odd latent sides exercise ComfyUI's padding and crop."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

LLAMA = "conditioning_llama3"
TEXT, LLAMA_WIDTH, LLAMA_LAYERS, LLAMA_TOKENS = 16, 16, 3, 4  # 4096, 4096, 32, 128 in the real model
POOLED = 2048  # CLIP-L + CLIP-G pooled, as ComfyUI's HiDream text encoder gives it


def hidream_small(seed: int = 53):
    """0.48 M parameters (the 256-wide SwiGLU experts are the least ComfyUI's rounding allows)."""
    require_model_class("HiDream")
    import comfy.supported_models

    unet = {"image_model": "hidream", "attention_head_dim": 16, "axes_dims_rope": [8, 4, 4],
            "caption_channels": [TEXT, LLAMA_WIDTH], "max_resolution": [128, 128], "in_channels": 16,
            "llama_layers": [0, 2, 2], "num_attention_heads": 2, "num_routed_experts": 3,
            "num_activated_experts": 2, "num_layers": 2, "num_single_layers": 1, "out_channels": 16,
            "patch_size": 2, "text_emb_dim": POOLED}
    return from_config(comfy.supported_models.HiDream, unet, seed=seed)


def _llama(model, x0, g):
    return {LLAMA: torch.randn(1, LLAMA_LAYERS, LLAMA_TOKENS, LLAMA_WIDTH, generator=g)}


def _kwargs(cond, pooled, options, extras):
    """What ``HiDream.extra_conds`` hands the model: the pooled vector as ``y`` and the Llama layers."""
    return {"y": pooled, "encoder_hidden_states_llama3": extras[LLAMA]}


ROWS = [
    Row("HiDream", "ComfyUI's HiDream config class, width 32, 3 experts (2 active), in memory",
        load=lambda comfy_root, fixture_paths: hidream_small(), latent=(16, 7, 5), tokens=5,
        comfy_kwargs=_kwargs, extras=_llama),
]
