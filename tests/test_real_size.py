"""Slow tier: the smallest *detectable* model of each family whose detection pins full-size dims, loaded
through ComfyUI's stock loader, passes the generic staged-forward check.

The fast rows (tests/family_rows/) build tiny models from ComfyUI's config classes, bypassing
detection; this tier closes that gap for the families whose smallest detectable model stays under
1 B parameters (Flux, SDXL, HiDream and Flux.2 dev do not fit this machine's tier). Each case writes a
seeded random bf16 file of the real layout with the fewest blocks and the narrowest widths detection
reads from the shapes (the widths it pins stay full size), loads it with
``comfy.sd.load_diffusion_model`` (no missing or unexpected keys), checks the detected config class
and family, and compares the family adapter's staged forward with ``BaseModel.apply_model`` at the
smallest latent, as tests/test_families.py does. Files live in a temporary folder and are deleted.

What each file holds (0.3.75's detection; current ComfyUI detects the same files):

- Qwen-Image: 1 transformer block; everything but the block count and input channels is pinned
  (hidden 3072, Qwen2.5-VL context 3584).
- Lumina 2: dim 2304 (pins 24 heads / 8 KV heads), 1 layer plus the 2 + 2 refiners detection assumes;
  the text width is read from the shapes (32 here).
- Z-Image: dim 3840 (pins 30 heads, modulation, pad tokens), 1 layer plus 2 + 2 refiners, text width 32.
- Chroma: hidden 3072 (24 heads, axes 16/56/56 pinned) and the pinned 5-layer guidance approximator;
  1 double and 1 single block, text width 32.
- PixArt Sigma: hidden 1152 and 16 heads pinned, T5-XXL's 4096-wide caption projection (not read from the
  shapes), 1 block (AuraFlow, dim 3072 pinned, would be 0.5 B for 1 double and 1 single block: left to the fast rows).
- Cosmos Predict2 text-to-image: width 256 (read from the shapes; the model's default 16 heads, AdaLN-LoRA 256 pinned), T5's 1024-wide
  cross-attention pinned, 10 blocks (0.3.75 counts no blocks outside widths 2048 and 5120: the model's default 10;
  current ComfyUI counts them): 23 M.
- HunyuanImage 2.1: hidden 128 (heads of 128 pinned: 1 head, axes 64/64), 64 channels in 1 x 1 patches, guidance
  embedding, 1 double and 1 single block, text width 32, no ByT5 mapper: 1.5 M.

Current ComfyUI only (0.3.75 has no such model class: the case skips there, naming it):

- Krea 2: 128-wide heads, 20 text heads and the 256-wide time embedding pinned; width 128 (1 head, 1 KV head),
  1 block, a 2-layer x 320-wide text stack (read from the shapes; its 2 + 2 fusion blocks are fixed): 6 M.
- Mage-Flow: Qwen-Image's block at the pinned 3072 (24 heads), the 2560-wide text norm and 128 output channels
  detection keys on, 1 block: 378 M.
- Ideogram 4: 18 heads of 256, MLP 12288, adaLN 512 and the 13 x 4096-wide text projection pinned; 1 layer, 128
  input channels: 558 M (1.1 GB, the largest file here).
- Anima: Cosmos Predict2's layout at width 256 and 1 block (counted) with the pinned 1024-wide 6-layer LLM adapter
  and its 32128-token embedding: 137 M.
- Kandinsky 5 Image: model width 2560 (detection keys the image config on it), the 3584-wide text and 768-wide pooled
  inputs pinned; time width 16, feed-forward 16, 1 text and 1 visual block: 89 M.
- Kandinsky 5 video: width 64 (one head of 64: any width but 2560 is the video config), 132-wide visual embedding,
  time width 16, feed-forward 16, 1 text and 1 visual block, 3 latent frames (text-to-video ``c_concat``): 0.3 M.
- LongCat-Image: Flux's layout at hidden 128 (heads of 128 pinned: 1 head), the 3584-wide text detection keys it on,
  no guidance, 1 double and 1 single block: 1.4 M.

Left out: ErnieImage (detection pins everything: the full 8.0 B model) and OmniGen2 (32 layers at width 2520
pinned: 2.8 B). HunyuanVideo 1.5's smallest detectable file (3.3 M) is already a fast row
(tests/family_rows/hunyuan_video15.py, ``HunyuanVideo15Detected``).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.family_rows import Row
from pipetrainer.tests.family_rows.common import load_detected, require_model_class
from pipetrainer.training.pipelines.base import adapter_for, family_name_for

CONTEXT = 32  # the text width where detection reads it from the shapes


def _qwen_image() -> dict:
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(num_layers=1, device=torch.device("meta"),
                                       operations=comfy.ops.disable_weight_init).state_dict()


def _next_dit(**params) -> dict:
    import comfy.ops
    from comfy.ldm.lumina.model import NextDiT

    return NextDiT(device=torch.device("meta"), operations=comfy.ops.disable_weight_init, **params).state_dict()


def _lumina2() -> dict:
    return _next_dit(patch_size=2, in_channels=16, dim=2304, n_layers=1, n_refiner_layers=2, n_heads=24, n_kv_heads=8,
                     multiple_of=256, ffn_dim_multiplier=4.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=CONTEXT,
                     axes_dims=[32, 32, 32], axes_lens=[300, 512, 512], rope_theta=10000.0)


def _zimage() -> dict:
    return _next_dit(patch_size=2, in_channels=16, dim=3840, n_layers=1, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                     multiple_of=256, ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=CONTEXT,
                     axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0, z_image_modulation=True,
                     time_scale=1000.0, pad_tokens_multiple=32)


def _chroma() -> dict:
    from comfy.ldm.chroma.model import Chroma, ChromaParams

    params = dict(in_channels=64, out_channels=64, context_in_dim=CONTEXT, hidden_size=3072, mlp_ratio=4.0,
                  num_heads=24, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
                  qkv_bias=True, in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5)
    fields = ChromaParams.__dataclass_fields__  # current ComfyUI's dataclass has more required fields
    params.update({k: v for k, v in (("txt_ids_dims", []), ("vec_in_dim", None)) if k in fields})
    with torch.device("meta"):
        return Chroma(operations=torch.nn, **params).state_dict()


def _pixart_sigma() -> dict:
    import comfy.ops
    from comfy.ldm.pixart.pixartms import PixArtMS

    return PixArtMS(depth=1, hidden_size=1152, num_heads=16, caption_channels=4096, model_max_length=300,
                    micro_condition=False, device=torch.device("meta"),
                    operations=comfy.ops.disable_weight_init).state_dict()


def _from_config(config: str, unet: dict, model_class: str | None = None) -> dict:
    """The meta state dict of ComfyUI's ``config`` class built from ``unet``, the config detection reads from
    the file (the class merges in what it pins); skips where this ComfyUI lacks the family."""
    require_model_class(model_class or config)
    import comfy.supported_models

    model = getattr(comfy.supported_models, config)(dict(unet)).get_model({}, device=torch.device("meta"))
    return model.diffusion_model.state_dict()


def _krea2() -> dict:
    # head width 128, 20 text heads and a 256-wide time embedding are pinned; the rest is read from the shapes
    return _from_config("Krea2", {"image_model": "krea2", "features": 128, "channels": 16, "patch": 2, "layers": 1,
                                  "heads": 1, "kvheads": 1, "txtlayers": 2, "txtdim": 320})


def _mage_flow() -> dict:
    return _from_config("MageFlow", {"image_model": "mage_flow", "in_channels": 128, "num_layers": 1})


def _ideogram4() -> dict:
    return _from_config("Ideogram4", {"image_model": "ideogram4", "in_channels": 128, "num_layers": 1})


def _cosmos(image_model: str, blocks: int) -> dict:
    unet = {"image_model": image_model, "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
            "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 256,
            "concat_padding_mask": True, "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d",
            "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
            "use_adaln_lora": True, "adaln_lora_dim": 256, "num_blocks": blocks, "extra_per_block_abs_pos_emb": False,
            "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
            "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0, "extra_t_extrapolation_ratio": 1.0,
            "rope_enable_fps_modulation": False}
    if image_model == "anima":
        return _from_config("Anima", unet)
    return _from_config("CosmosT2IPredict2", unet, "CosmosPredict2")


def _kandinsky5_image() -> dict:
    return _from_config("Kandinsky5Image", {
        "image_model": "kandinsky5", "model_dim": 2560, "axes_dims": (32, 48, 48), "rope_scale_factor": (1.0, 1.0, 1.0),
        "time_dim": 16, "ff_dim": 16, "visual_embed_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 1})


def _kandinsky5_video() -> dict:
    # any width but the image model's 2560 is the video config; heads of 64 (axes 16/24/24) outside 1792 / 4096
    return _from_config("Kandinsky5", {"image_model": "kandinsky5", "model_dim": 64, "time_dim": 16, "ff_dim": 16,
                                       "visual_embed_dim": 132, "num_text_blocks": 1, "num_visual_blocks": 1})


_LOADED: list = []  # the model under test: its extra_conds is the oracle of a video row's ComfyUI kwargs


def _kandinsky5_video_kwargs(cond, pooled, options, extras) -> dict:
    from pipetrainer.tests.family_rows.kandinsky5_video import comfy_conds

    return comfy_conds(_LOADED[-1], torch.zeros(1, *KANDINSKY5_VIDEO_LATENT), pooled)


KANDINSKY5_VIDEO_LATENT = (16, 3, 4, 4)


def _hunyuan_image() -> dict:
    unet = {"image_model": "hunyuan_video", "in_channels": 64, "patch_size": [1, 1], "out_channels": 64,
            "vec_in_dim": None, "axes_dim": [64, 64], "meanflow": False, "context_in_dim": CONTEXT, "hidden_size": 128,
            "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1, "theta": 256, "qkv_bias": True,
            "byt5": False, "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None,
            "meanflow_sum": False}
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    fields = HunyuanVideoParams.__dataclass_fields__  # 0.3.75 has no meanflow_sum
    return _from_config("HunyuanImage21", {k: v for k, v in unet.items() if k in fields or k == "image_model"})


def _longcat_image() -> dict:
    # the 3584-wide text (what makes it LongCat) and the 16/56/56 axes (heads of 128) are pinned
    return _from_config("LongCatImage", {
        "image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 1, "mlp_ratio": 4.0, "theta": 10000,
        "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [1, 2], "in_channels": 16, "hidden_size": 128,
        "context_in_dim": 3584, "patch_size": 2, "vec_in_dim": None, "depth": 1, "depth_single_blocks": 1,
        "guidance_embed": False, "yak_mlp": False, "txt_norm": False})


def _guidance(cond, pooled, options, extras) -> dict:
    return {"guidance": torch.full((cond.shape[0],), options.guidance)}


def _pooled(cond, pooled, options, extras) -> dict:
    return {"y": pooled}


def _anima_extras(model, x0, g):
    from pipetrainer.tests.family_rows.cosmos_predict2 import _anima_extras

    return _anima_extras(model, x0, g)


def _anima_kwargs(cond, pooled, options, extras):
    from pipetrainer.tests.family_rows.cosmos_predict2 import _anima_kwargs

    return _anima_kwargs(cond, pooled, options, extras)


def _num_tokens(cond, pooled, options, extras) -> dict:
    return {"num_tokens": cond.shape[1]}


def _no_guidance(cond, pooled, options, extras) -> dict:
    return {"guidance": torch.zeros(cond.shape[0])}


@dataclass(frozen=True)
class Case:
    """One family's smallest detectable file: its meta layout, what ComfyUI must detect, the generic row."""

    layout: Callable[[], dict]
    config: str  # the comfy.supported_models class detection must pick
    params: tuple[float, float]  # the parameter count's bounds (what the module docstring promises)
    row: Row
    context: int = CONTEXT  # the text width the adapter reads from the loaded model


def _row(family: str, latent: tuple[int, ...], comfy_kwargs=None, extras=None, tokens: int = 3) -> Row:
    extra = {"comfy_kwargs": comfy_kwargs} if comfy_kwargs else {}
    if extras:
        extra["extras"] = extras
    return Row(family, "smallest detectable model, stock loader (slow tier)", load=None, latent=latent,
               tokens=tokens, **extra)


CASES = {
    "QwenImage": Case(_qwen_image, "QwenImage", (3.0e8, 4.5e8), _row("QwenImage", (16, 1, 4, 4)), 3584),
    "Lumina2": Case(_lumina2, "Lumina2", (3.5e8, 5.0e8), _row("Lumina2", (16, 4, 4), _num_tokens)),
    "ZImage": Case(_zimage, "ZImage", (7.5e8, 1.0e9), _row("Lumina2", (16, 4, 4), _num_tokens)),
    "Chroma": Case(_chroma, "Chroma", (4.5e8, 7.0e8), _row("Chroma", (16, 4, 4), _no_guidance)),
    # 40 x 36: ComfyUI's sin-cos table degenerates below (H + W) / 2 = 33 latent pixels (tests/family_rows/pixart.py)
    "PixArtSigma": Case(_pixart_sigma, "PixArtSigma", (3.0e7, 5.0e7), _row("PixArt", (4, 40, 36)), 4096),
    "Krea2": Case(_krea2, "Krea2", (1e6, 1e7), _row("Krea2", (16, 1, 4, 4)), 640),
    "MageFlow": Case(_mage_flow, "MageFlow", (3.0e8, 4.5e8), _row("MageFlow", (128, 4, 4)), 2560),
    "Ideogram4": Case(_ideogram4, "Ideogram4", (5.0e8, 6.0e8), _row("Ideogram4", (128, 4, 4)), 53248),
    "Anima": Case(lambda: _cosmos("anima", 1), "Anima", (1.0e8, 2.0e8),
                  _row("Anima", (16, 1, 4, 4), _anima_kwargs, _anima_extras, tokens=5), 1024),
    # 10 blocks: 0.3.75's detection counts no blocks outside widths 2048 and 5120 (the model's default 10)
    "CosmosPredict2": Case(lambda: _cosmos("cosmos_predict2", 10), "CosmosT2IPredict2", (1e7, 5e7),
                           _row("CosmosPredict2", (16, 1, 4, 4)), 1024),
    "Kandinsky5Image": Case(_kandinsky5_image, "Kandinsky5Image", (5e7, 1.5e8),
                            _row("Kandinsky5Image", (16, 4, 4), _pooled), 3584),
    "HunyuanImage21": Case(_hunyuan_image, "HunyuanImage21", (1e5, 1e7), _row("HunyuanImage", (64, 4, 4), _guidance)),
    "Kandinsky5Video": Case(_kandinsky5_video, "Kandinsky5", (1e5, 1e6),
                            _row("Kandinsky5Video", KANDINSKY5_VIDEO_LATENT, _kandinsky5_video_kwargs), 3584),
    "LongCatImage": Case(_longcat_image, "LongCatImage", (1e6, 2e7), _row("LongCat", (16, 4, 4)), 3584),
}


def _write_random_bf16(layout: dict, path: Path, seed: int) -> int:
    """Seeded bf16 values of a trained network's scale (as devkit.fixtures does: matrices ~ 1/sqrt(fan in),
    norm weights near 1, the rest small), one generator per tensor, drawn in bf16: nothing is held in
    fp32. Returns the parameter count."""
    from safetensors.torch import save_file

    tensors = {}
    for i, name in enumerate(sorted(layout)):
        shape = layout[name].shape
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100_003 + i), dtype=torch.bfloat16)
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if name.endswith((".weight", ".scale")) and "norm" in leaf:
            t.mul_(0.1).add_(1.0)
        elif name.endswith(".weight") and t.ndim >= 2:
            t.mul_(1.0 / math.sqrt(math.prod(shape[1:])))
        else:
            t.mul_(0.02)
        tensors[name] = t
    save_file(tensors, str(path))
    return sum(t.numel() for t in tensors.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_smallest_detectable_model_loads_through_the_stock_loader_and_stages_exactly(name, comfy_root, tmp_path):
    from pipetrainer.tests.test_families import _comfy_denoised, _example, _staged

    case = CASES[name]
    started = time.monotonic()
    path = tmp_path / f"{name}-smallest.safetensors"
    count = _write_random_bf16(case.layout(), path, seed=len(name))
    written = time.monotonic()
    assert case.params[0] < count < case.params[1], count
    try:
        patcher = load_detected(path)
        loaded = time.monotonic()
        model = patcher.model
        _LOADED[:] = [model]
        assert type(patcher.model.model_config).__name__ == case.config
        assert family_name_for(model) == case.row.family
        adapter = adapter_for(case.row.family)
        assert adapter.conditioning_dims(model.diffusion_model)[0] == case.context
        options = adapter.options_type()
        noisy, sigma, cond, pooled, noised, extras, clean, shapes = _example(case.row, model)
        with torch.no_grad():
            out = _staged(adapter, adapter.stage_layers(model.diffusion_model), noised, cond, pooled, options,
                          extras, clean, shapes=shapes)
        assert out.shape == noisy.shape
        ours = model.model_sampling.calculate_denoised(sigma, out.float(), noisy)
        theirs = _comfy_denoised(model, noisy, sigma, cond, pooled, case.row, options, extras)
        assert torch.isfinite(theirs).all()
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()
        dtype = next(model.diffusion_model.parameters()).dtype
        print(f"{name}: {count / 1e6:.2f} M params loaded as {dtype}: write {written - started:.1f} s, "
              f"load {loaded - written:.1f} s, check {time.monotonic() - loaded:.1f} s")
    finally:
        path.unlink(missing_ok=True)
        _LOADED.clear()
        gc.collect()
