"""A tiny MiniMax-H3 text encoder (Qwen3-VL language model + vision tower) built from ComfyUI's own classes.

MiniMax-H3 conditions on Qwen3-VL-32B (truncated to 50 layers, 5120 wide); ComfyUI builds it from fixed dataclass
defaults with a 1152-wide, 27-block vision tower, so no small file loads through ``CLIPLoader``. This builds the
``comfy.sd.CLIP`` ComfyUI builds for CLIP type ``minimax`` (tokenizer ``comfy.text_encoders.minimax.MiniMaxH3Tokenizer``
with the Qwen2 tokenizer ComfyUI ships; text model ``MiniMaxH3TEModel`` driving ``MiniMaxQwen3VL``, which also
returns ``minimax_token_tags``) with a small config: hidden 24 (the Qwen3-VL width of the tiny H3 in
tests/family_rows/minimax_h3.py), two decoder layers of one head (ComfyUI fixes the head width at 128 and the
interleaved 3-axis rotary split), and a vision tower of ComfyUI's ``Qwen3VLVisionModel`` class 32 wide with two
blocks, each feeding a DeepStack merger (ComfyUI builds it 1152 wide, so the lines that make the model are the one
thing not inherited). The token embedding keeps the real vocabulary; ComfyUI's ``MiniMaxH3ImageToVideo`` tokenizes
and encodes images and text with it exactly as with the real model.
"""

from __future__ import annotations

from .tiny_llm import build_clip

TINY_H3_TEXT_CONFIG = {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 1, "num_key_value_heads": 1}
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "depth": 2, "num_heads": 2,
               "deepstack_visual_indexes": [0, 1]}


def _classes():
    """ComfyUI's classes, imported when called (ComfyUI is importable only inside its process)."""
    import torch
    from comfy import sd1_clip
    from comfy.text_encoders import llama, minimax, qwen3vl

    class TinyMiniMaxQwen3VL(minimax.MiniMaxQwen3VL):
        """ComfyUI's MiniMax-H3 Qwen3-VL with a narrow vision tower; preprocessing and forward are ComfyUI's."""

        def __init__(self, config_dict, dtype, device, operations):
            torch.nn.Module.__init__(self)
            config = llama.Qwen3VL_32BConfig(**config_dict)
            self.num_layers = config.num_hidden_layers
            self.model = llama.Llama2_(config, device=device, dtype=dtype, ops=operations)
            vision = {**qwen3vl.QWEN3VL_VISION_COMMON, **TINY_VISION, "out_hidden_size": config.hidden_size}
            self.visual = qwen3vl.Qwen3VLVisionModel(vision, device=device, dtype=dtype, ops=operations)
            self.dtype = dtype

    class TinyMiniMaxH3ClipModel(minimax.MiniMaxH3ClipModel):
        """As ComfyUI's ``MiniMaxH3ClipModel`` (its token tags included), with the tiny config."""

        def __init__(self, device="cpu", layer="last", layer_idx=None, dtype=None, model_options={}):  # noqa: B006
            sd1_clip.SDClipModel.__init__(
                self, device=device, layer="last", layer_idx=None, textmodel_json_config=dict(TINY_H3_TEXT_CONFIG),
                dtype=dtype, special_tokens={"pad": 151643}, layer_norm_hidden_state=False,
                model_class=TinyMiniMaxQwen3VL, enable_attention_masks=False, return_attention_masks=False,
                model_options=model_options)

    class TinyMiniMaxH3TEModel(minimax.MiniMaxH3TEModel):
        def __init__(self, device="cpu", dtype=None, model_options={}):  # noqa: B006
            sd1_clip.SD1ClipModel.__init__(self, device=device, dtype=dtype, name="qwen3vl_32b",
                                           clip_model=TinyMiniMaxH3ClipModel, model_options=model_options)

    return TinyMiniMaxH3TEModel, minimax.MiniMaxH3Tokenizer


def tiny_minimax_h3_clip(seed: int = 5120, embedding_directory=None):
    """A ``comfy.sd.CLIP`` of ComfyUI's MiniMax-H3 text encoder at width 24, with seeded weights."""
    model_class, tokenizer_class = _classes()
    return build_clip(model_class, tokenizer_class, seed, norm_center=1.0, embedding_directory=embedding_directory)
