"""A tiny Gemma 3 text encoder for LTX-2, as ComfyUI's ``LTXAVTextEncoderLoader`` loads it (current ComfyUI only).

ComfyUI's LTX-2 templates load the text encoder with ``LTXAVTextEncoderLoader``: ``comfy.sd.load_clip`` of two
files, Gemma 3 12B (``text_encoders``) and the LTX-2 checkpoint (whose ``text_embedding_projection`` maps
Gemma's stacked hidden states to the model's caption width), with ``CLIPType.LTXV``. That branch of
``load_text_encoder_state_dicts`` builds ``comfy.text_encoders.lt.ltxav_te(**llama_detect, **lt.sd_detect)``
over ``Gemma3_12BModel`` (every hidden state, ``layer="all"``) with ``LTXAVGemmaTokenizer`` (BOS, no template,
left padding to 1024 tokens) and the file's SentencePiece model. The projection's widths are read from its
shape; Gemma's size is pinned (``llama.Gemma3_12B_Config``, with a 400 M-parameter SigLIP vision tower).

So the files here are real safetensors in the real key layout, loaded by the same steps as that branch
(:func:`load_ltxav_text_encoder`), with one difference: the Gemma model class is ComfyUI's with a tiny config
(:mod:`.tiny_llm`'s way: hidden 24, 6 layers, the real 5 sliding + 1 global attention pattern, one head of
Gemma's real head width 256) and a narrow vision tower (ComfyUI's ``CLIPVision`` / projector classes at width
16, swapped in after ComfyUI's own constructor ran). The SentencePiece model is :mod:`.tiny_gemma2`'s (Gemma's id
layout: pad 0, eos 1, bos 2).
"""

from __future__ import annotations

import math

import torch

from .tiny_gemma2 import spiece_model
from .tiny_llm import seeded_llm_state

HIDDEN = 24
LAYERS = 6  # Gemma 3's pattern: five sliding-window layers, then a global one
TINY_GEMMA3_CONFIG = {"vocab_size": 420, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
                      "num_hidden_layers": LAYERS, "num_attention_heads": 1, "num_key_value_heads": 1}
TINY_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 1, "num_hidden_layers": 1}
PROJECTION = "text_embedding_projection.aggregate_embed.weight"  # LTX-2's (one linear) in its checkpoint


def _tiny_gemma3_model():
    """ComfyUI's ``lt.Gemma3_12BModel`` whose transformer is ComfyUI's ``llama.Gemma3_12B`` built from the tiny config,
    its vision tower and projector rebuilt narrow by ComfyUI's own classes."""
    import comfy.clip_model
    from comfy import sd1_clip
    from comfy.text_encoders import llama, lt

    class TinyGemma3_12B(llama.Gemma3_12B):
        def __init__(self, config_dict, dtype, device, operations):
            super().__init__(config_dict, dtype, device, operations)  # the full tower is only allocated, never filled
            config = llama.Gemma3_12B_Config(**config_dict)
            config.vision_config = {**llama.GEMMA3_VISION_CONFIG, **TINY_VISION}
            self.multi_modal_projector = llama.Gemma3MultiModalProjector(config, dtype, device, operations)
            self.vision_model = comfy.clip_model.CLIPVision(config.vision_config, dtype, device, operations)

    class _Tiny(sd1_clip.SDClipModel):
        def __init__(self, *args, **kwargs):
            kwargs["textmodel_json_config"] = {**(kwargs.get("textmodel_json_config") or {}), **TINY_GEMMA3_CONFIG}
            kwargs["model_class"] = TinyGemma3_12B
            super().__init__(*args, **kwargs)

    return type("TinyGemma3_12BModel", (lt.Gemma3_12BModel, _Tiny), {})


def gemma3_state(seed: int) -> dict[str, torch.Tensor]:
    """The tiny Gemma 3 as its ``text_encoders`` file holds it: the transformer's keys (``model.*``,
    ``vision_model.*``, ``multi_modal_projector.*``) with seeded fp32 weights, and ``spiece_model``."""
    model = _tiny_gemma3_model()(device="cpu", dtype=torch.float32, layer="all")
    state = seeded_llm_state(model.transformer.state_dict(), seed, norm_center=0.0)  # Gemma's RMSNorm adds 1
    state["spiece_model"] = torch.ByteTensor(list(spiece_model()))
    return state


def projection_state(width: int, seed: int, audio_width: int | None = None) -> dict[str, torch.Tensor]:
    """The LTX-2 checkpoint's text projection of all of Gemma's hidden states: LTX-2's single linear (no bias) to
    ``width``, or with ``audio_width`` LTX-2.3's two (video ``width``, audio ``audio_width``, with biases)."""
    fan_in = HIDDEN * (LAYERS + 1)
    g = torch.Generator().manual_seed(seed)
    if audio_width is None:
        return {PROJECTION: torch.randn(width, fan_in, generator=g) / math.sqrt(fan_in)}
    out = {}
    for stream, n in (("video", width), ("audio", audio_width)):
        prefix = f"text_embedding_projection.{stream}_aggregate_embed"
        out[f"{prefix}.weight"] = torch.randn(n, fan_in, generator=g) / math.sqrt(fan_in)
        out[f"{prefix}.bias"] = 0.02 * torch.randn(n, generator=g)
    return out


def load_ltxav_text_encoder(gemma_path: str, checkpoint_path: str, embedding_directory=None):
    """``LTXAVTextEncoderLoader`` of the two files: ``comfy.sd.load_clip``'s steps for ``CLIPType.LTXV`` (read
    each file with ComfyUI's reader, detect, build the ClipTarget, ``comfy.sd.CLIP`` loading every state dict),
    with the tiny Gemma model class in place of the pinned 12 B one."""
    import comfy.sd
    import comfy.utils
    from comfy.text_encoders import lt

    clip_data = [comfy.utils.load_torch_file(p, safe_load=True) for p in (gemma_path, checkpoint_path)]
    te_models = [comfy.sd.detect_te_model(sd) for sd in clip_data]

    class Target:
        params: dict = {}
        clip = lt.ltxav_te(**comfy.sd.llama_detect(clip_data), **lt.sd_detect(clip_data),
                           text_encoder_model=_tiny_gemma3_model())
        tokenizer = lt.LTXAVGemmaTokenizer

    gemma_12b = comfy.sd.TEModel.GEMMA_3_12B  # the tiny file is detected as another Gemma 3: the first file then
    gemma_sd = clip_data[te_models.index(gemma_12b)] if gemma_12b in te_models else clip_data[0]
    tokenizer_data = {"spiece_model": gemma_sd.get("spiece_model", None)}
    parameters = sum(comfy.utils.calculate_parameters(sd) for sd in clip_data)
    return comfy.sd.CLIP(Target, embedding_directory=embedding_directory, parameters=parameters,
                         tokenizer_data=tokenizer_data, state_dict=clip_data)
