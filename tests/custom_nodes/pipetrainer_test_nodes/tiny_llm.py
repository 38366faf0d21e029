"""What the tiny LLM text encoders (Gemma 2, Mistral 3, Qwen3, Qwen2.5-VL) share: ComfyUI's own encoder classes with only the
transformer's size changed, seeded weights, and a real ``comfy.sd.CLIP`` around them.

The real encoders' classes hard-code their transformer config (``textmodel_json_config={}`` = the full
2-4 B model). Rather than re-declaring them (and drifting from the host's templates, hidden-layer
choice, special tokens and attention-mask switches), :func:`with_config` subclasses ComfyUI's own class
and changes exactly one argument on its way to ``SDClipModel``: the config, merged over what the class
passes (Flux.2's pruned Mistral passes a layer count, which survives). :func:`with_clip_model` does the
same one level up for the ``SD1ClipModel`` that names the inner model (Z-Image's ``ZImageTEModel`` has
no ``clip_model`` parameter of its own). The resulting classes are subclasses of ComfyUI's, so every
``isinstance`` and every overridden method (Flux.2's stacking of three hidden layers) stays ComfyUI's.

``head_dim`` is a class attribute of ComfyUI's configs, not a field: it stays at the real model's (128
or 256), so a tiny encoder has one attention head of the real head width over a tiny hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def with_config(model_class: type, config: Mapping[str, object]) -> type:
    """A subclass of ComfyUI's ``SDClipModel`` subclass ``model_class`` whose transformer is built from
    ``config`` (merged over the config the class itself passes)."""
    from comfy import sd1_clip

    class _TinyConfig(sd1_clip.SDClipModel):
        def __init__(self, *args, **kwargs):
            kwargs["textmodel_json_config"] = {**(kwargs.get("textmodel_json_config") or {}), **config}
            super().__init__(*args, **kwargs)

    return type(f"Tiny{model_class.__name__}", (model_class, _TinyConfig), {})


def with_clip_model(te_class: type, clip_model: type) -> type:
    """A subclass of ComfyUI's ``SD1ClipModel`` subclass ``te_class`` whose inner model is ``clip_model``."""
    from comfy import sd1_clip

    class _TinyInner(sd1_clip.SD1ClipModel):
        def __init__(self, *args, **kwargs):
            kwargs["clip_model"] = clip_model
            super().__init__(*args, **kwargs)

    return type(f"Tiny{te_class.__name__}", (te_class, _TinyInner), {})


def seeded_llm_state(state: Mapping[str, torch.Tensor], seed: int, norm_center: float) -> dict[str, torch.Tensor]:
    """Weights of a trained network's scale for a ComfyUI LLaMA-style state dict: token embeddings of
    unit scale, matrices (and a vision tower's patch convolution) ~ 1/sqrt(fan in), norm weights near
    ``norm_center`` (1, or 0 where the norm adds 1 itself: Gemma's ``rms_norm_add``; Qwen2.5-VL's vision
    merger calls its norm ``ln_q``), anything else small. One generator, names sorted: the same seed
    gives the same weights on every host with the same state-dict layout."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(state):
        t = state[name]
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if "norm" in name or "ln_q" in name:
            value = norm_center + 0.1 * noise
        elif "embed_tokens" in name:
            value = noise
        elif t.ndim >= 2:
            value = noise / math.sqrt(math.prod(t.shape[1:]))
        else:
            value = 0.02 * noise
        out[name] = value.to(t.dtype)
    return out


def build_clip(te_class: type, tokenizer_class: type, seed: int, norm_center: float, *,
               tokenizer_data: Mapping[str, object] | None = None, embedding_directory=None):
    """A ``comfy.sd.CLIP`` of ``te_class`` / ``tokenizer_class`` (what ComfyUI's CLIPLoader puts in its
    ClipTarget), with seeded weights loaded through ``CLIP.load_sd`` as the loader does."""
    import comfy.sd

    class Target:
        params: dict = {}
        clip = te_class
        tokenizer = tokenizer_class

    clip = comfy.sd.CLIP(target=Target, embedding_directory=embedding_directory,
                         tokenizer_data=dict(tokenizer_data or {}), parameters=1_000_000)
    state = clip.cond_stage_model.state_dict()
    missing, unexpected = clip.load_sd(seeded_llm_state(state, seed, norm_center), full_model=True)
    if missing or unexpected:
        raise RuntimeError(f"tiny {te_class.__name__}: missing {missing}, unexpected {unexpected}")
    return clip


def seed_input(default: int) -> dict:
    """The loader nodes' one input."""
    return {"required": {"seed": ("INT", {"default": default, "min": 0, "max": 2**31 - 1,
                                          "tooltip": "Seed of the random weights."})}}
