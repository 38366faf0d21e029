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
from pipetrainer.tests.family_rows.common import load_detected
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


def _row(family: str, latent: tuple[int, ...], comfy_kwargs=None) -> Row:
    extra = {"comfy_kwargs": comfy_kwargs} if comfy_kwargs else {}
    return Row(family, "smallest detectable model, stock loader (slow tier)", load=None, latent=latent, tokens=3,
               **extra)


CASES = {
    "QwenImage": Case(_qwen_image, "QwenImage", (3.0e8, 4.5e8), _row("QwenImage", (16, 1, 4, 4))),
    "Lumina2": Case(_lumina2, "Lumina2", (3.5e8, 5.0e8), _row("Lumina2", (16, 4, 4), _num_tokens)),
    "ZImage": Case(_zimage, "ZImage", (7.5e8, 1.0e9), _row("Lumina2", (16, 4, 4), _num_tokens)),
    "Chroma": Case(_chroma, "Chroma", (4.5e8, 7.0e8), _row("Chroma", (16, 4, 4), _no_guidance)),
    # 40 x 36: ComfyUI's sin-cos table degenerates below (H + W) / 2 = 33 latent pixels (tests/family_rows/pixart.py)
    "PixArtSigma": Case(_pixart_sigma, "PixArtSigma", (3.0e7, 5.0e7), _row("PixArt", (4, 40, 36))),
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
        assert type(patcher.model.model_config).__name__ == case.config
        assert family_name_for(model) == case.row.family
        adapter = adapter_for(case.row.family)
        assert adapter.conditioning_dims(model.diffusion_model)[0] in (CONTEXT, 3584, 4096)  # Qwen2.5-VL's, T5-XXL's
        options = adapter.options_type()
        noisy, sigma, cond, pooled, noised, extras, clean = _example(case.row, model)
        with torch.no_grad():
            out = _staged(adapter, adapter.stage_layers(model.diffusion_model), noised, cond, pooled, options,
                          extras, clean)
        assert out.shape == noisy.shape
        ours = model.model_sampling.calculate_denoised(sigma, out.float(), noisy)
        theirs = _comfy_denoised(model, noisy, sigma, cond, pooled, case.row, options, extras)
        assert torch.isfinite(theirs).all()
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()
        dtype = next(model.diffusion_model.parameters()).dtype
        print(f"{name}: {count / 1e6:.0f} M params loaded as {dtype}: write {written - started:.1f} s, "
              f"load {loaded - written:.1f} s, check {time.monotonic() - loaded:.1f} s")
    finally:
        path.unlink(missing_ok=True)
        gc.collect()
