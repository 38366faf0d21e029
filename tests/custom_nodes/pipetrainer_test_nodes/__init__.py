"""Test-only ComfyUI nodes: a tiny UMT5-shaped text encoder for the video-model end-to-end tests.

Wan (and every video family) takes UMT5-XXL's 4096-wide text. ComfyUI's ``CLIPLoader`` builds UMT5
from a fixed json config (5.7 B parameters), so no small file can load through it. This node builds
the same kind of ``comfy.sd.CLIP`` from ComfyUI's own classes (``comfy.sd1_clip.SD1ClipModel`` /
``SDClipModel`` driving ``comfy.text_encoders.t5.T5``, as ``comfy/text_encoders/wan.py`` does) with a
small config: d_model 4096 (what the diffusion model's text embedding takes), one UMT5 layer, tiny
attention and feed-forward widths. The UMT5 tokenizer travels inside the real weights file, so this
uses the smallest tokenizer ComfyUI ships offline: ByT5's (384 ids, ``comfy/text_encoders/byt5_tokenizer``),
which keeps the 4096-wide embedding at 1.6 M parameters. Weights are seeded (deterministic) and built
at load; 1.9 M parameters in all.

Only servers started with this folder as an extra ``custom_nodes`` path load it
(``devkit.host.extra_custom_nodes_args``); the pack itself never registers it.
"""

from __future__ import annotations

import math
import os
import sys

TINY_UMT5_CONFIG = {
    "d_ff": 16,
    "d_kv": 8,
    "d_model": 4096,
    "dense_act_fn": "gelu_pytorch_tanh",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "umt5",
    "num_heads": 1,
    "num_layers": 1,
    "relative_attention_num_buckets": 32,
    "vocab_size": 384,  # ByT5: 3 specials + 256 bytes + 125 sentinels
}
MIN_TOKENS = 32  # the real UMT5 tokenizer pads to 512; a short pad keeps the test cache small


def _classes():
    """ComfyUI's classes, imported when the node runs (ComfyUI is importable only inside the server)."""
    import comfy.text_encoders.t5
    from comfy import sd1_clip
    from transformers import ByT5Tokenizer

    tokenizer_path = os.path.join(os.path.dirname(os.path.realpath(comfy.text_encoders.t5.__file__)),
                                  "byt5_tokenizer")

    class TinyUMT5Model(sd1_clip.SDClipModel):
        def __init__(self, device="cpu", layer="last", layer_idx=None, dtype=None, model_options={}):  # noqa: B006
            super().__init__(device=device, layer=layer, layer_idx=layer_idx, textmodel_json_config=dict(TINY_UMT5_CONFIG),
                             dtype=dtype, special_tokens={"end": 1, "pad": 0}, model_class=comfy.text_encoders.t5.T5,
                             enable_attention_masks=True, zero_out_masked=True, model_options=model_options)

    class TinyUMT5Tokenizer(sd1_clip.SDTokenizer):
        def __init__(self, embedding_directory=None, tokenizer_data={}):  # noqa: B006
            super().__init__(tokenizer_path, pad_with_end=False, embedding_size=4096, embedding_key="umt5xxl",
                             tokenizer_class=ByT5Tokenizer, has_start_token=False, pad_to_max_length=False,
                             max_length=99999999, min_length=MIN_TOKENS, pad_token=0, tokenizer_data=tokenizer_data)

    class TinyWanTokenizer(sd1_clip.SD1Tokenizer):
        def __init__(self, embedding_directory=None, tokenizer_data={}):  # noqa: B006
            super().__init__(embedding_directory=embedding_directory, tokenizer_data=tokenizer_data,
                             clip_name="umt5xxl", tokenizer=TinyUMT5Tokenizer)

    class TinyWanTEModel(sd1_clip.SD1ClipModel):
        def __init__(self, device="cpu", dtype=None, model_options={}):  # noqa: B006
            super().__init__(device=device, dtype=dtype, model_options=model_options, name="umt5xxl",
                             clip_model=TinyUMT5Model)

    return TinyWanTEModel, TinyWanTokenizer


def _seeded_state(state: dict, seed: int) -> dict:
    """Weights of a trained network's scale: matrices ~ 1/sqrt(fan in), norms near 1, biases small."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(state):
        t = state[name]
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if "layer_norm" in name:
            value = 1.0 + 0.1 * noise
        elif name.endswith("shared.weight"):
            value = noise  # token embeddings of unit scale, as T5's are
        elif t.ndim >= 2:
            value = noise / math.sqrt(t.shape[-1])
        else:
            value = 0.02 * noise
        out[name] = value.to(t.dtype)
    return out


def tiny_umt5_clip(seed: int = 4096, embedding_directory=None):
    """A ``comfy.sd.CLIP`` whose model is UMT5-shaped at width 4096 (one layer), with seeded weights."""
    import comfy.sd

    model_class, tokenizer_class = _classes()

    class Target:
        params: dict = {}
        clip = model_class
        tokenizer = tokenizer_class

    clip = comfy.sd.CLIP(target=Target, embedding_directory=embedding_directory, parameters=1_900_000)
    state = clip.cond_stage_model.state_dict()
    missing, unexpected = clip.load_sd(_seeded_state(state, seed), full_model=True)
    if missing or unexpected:
        raise RuntimeError(f"tiny UMT5: missing {missing}, unexpected {unexpected}")
    return clip


class TinyUMT5Loader:
    """Test node: the tiny UMT5-shaped text encoder as a CLIP, in place of CLIPLoader type 'wan'."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 4096, "min": 0, "max": 2**31 - 1,
                                              "tooltip": "Seed of the random weights."})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "PipeTrainer/tests"
    DESCRIPTION = "Test only: a 1.9 M-parameter UMT5-shaped (4096-wide) text encoder with seeded weights."

    def load(self, seed: int):
        import folder_paths

        return (tiny_umt5_clip(seed, folder_paths.get_folder_paths("embeddings")),)


NODE_CLASS_MAPPINGS = {"PipeTrainerTestTinyUMT5Loader": TinyUMT5Loader}
NODE_DISPLAY_NAME_MAPPINGS = {"PipeTrainerTestTinyUMT5Loader": "Tiny UMT5 Loader (test)"}


# The tiny LLM text encoders (Gemma 2, Mistral 3, Qwen3, Qwen2.5-VL; LTX-2's Gemma 3) live in modules of their own.
# Their nodes register when this folder is imported as a package (ComfyUI, or pytest through ``pipetrainer``);
# a test that executes this file alone for ``tiny_umt5_clip`` (not in sys.modules, no package) gets the UMT5 node only.
if __name__ in sys.modules:
    from . import tiny_gemma2, tiny_ltx2, tiny_mistral, tiny_qwen3, tiny_qwen25vl

    for _module in (tiny_gemma2, tiny_ltx2, tiny_mistral, tiny_qwen3, tiny_qwen25vl):
        NODE_CLASS_MAPPINGS.update(_module.NODE_CLASS_MAPPINGS)
        NODE_DISPLAY_NAME_MAPPINGS.update(_module.NODE_DISPLAY_NAME_MAPPINGS)
