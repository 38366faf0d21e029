"""The text attention mask: cached exactly as CLIPTextEncode puts it into the conditioning.

Text encoders that return it (HunyuanVideo's LLaMA, LTX-2's Gemma, ...) make the model mask padding
tokens at sampling; the families that take it declare the optional ``attention_mask`` extra, so the
cache must write it or training would attend to padding that sampling masks. The encoder here is a
real ComfyUI ``SDClipModel`` (T5 architecture, tiny config, from the test-only node pack) with ComfyUI's
own ``return_attention_masks`` switch, the switch HunyuanVideo's text encoder sets.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

NO_VAE = SimpleNamespace(downscale_index_formula=None)  # text-only: the encoders read no VAE here
TEST_NODES = Path(__file__).resolve().parent / "custom_nodes" / "pipetrainer_test_nodes" / "__init__.py"


def _tiny_t5_clip(masks: bool):
    spec = importlib.util.spec_from_file_location("_pipetrainer_test_nodes", TEST_NODES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    clip = module.tiny_umt5_clip()
    for m in clip.cond_stage_model.modules():
        if hasattr(m, "return_attention_masks"):
            m.return_attention_masks = masks
    return clip


def test_the_cached_mask_is_the_one_clip_text_encode_gives_the_model(comfy_root):
    from pipetrainer.training.cache.encoders import TEXT_ATTENTION_MASK, ComfyEncoders, text_encoder_identity

    import nodes as comfy_nodes

    clip = _tiny_t5_clip(masks=True)
    caption = "a short caption"
    (conditioning,) = comfy_nodes.CLIPTextEncode().encode(clip, caption)
    expected = conditioning[0][1]["attention_mask"]
    cached = ComfyEncoders(NO_VAE, clip).encode_text(caption)
    assert torch.equal(cached[TEXT_ATTENTION_MASK], expected[0])
    assert 0 < int(cached[TEXT_ATTENTION_MASK].sum()) < cached[TEXT_ATTENTION_MASK].numel()  # padding masked
    assert torch.equal(cached["cond"], conditioning[0][0][0].float())
    assert text_encoder_identity(clip)["attention_mask"] is True  # caches of the mask-less encoder re-encode


def test_an_encoder_without_masks_caches_none_and_keeps_its_identity(comfy_root):
    from pipetrainer.training.cache.encoders import TEXT_ATTENTION_MASK, ComfyEncoders, text_encoder_identity

    clip = _tiny_t5_clip(masks=False)
    assert TEXT_ATTENTION_MASK not in ComfyEncoders(NO_VAE, clip).encode_text("a short caption")
    assert "attention_mask" not in text_encoder_identity(clip)
