"""Flux.2 beyond the generic family checks (tests/test_families.py, row ``Flux2``).

- Text: ComfyUI's ``Flux2.extra_conds`` left-pads a cond to 512 tokens; in a micro-batch of captions
  of different lengths each example gets exactly the cond ``extra_conds`` makes of its caption alone,
  and the output ComfyUI's ``apply_model`` computes with it.
- Klein (no guidance embedding) runs through the same layers.
- Current ComfyUI only: a 1 M-parameter Flux.2 (dev and Klein layouts) goes through ComfyUI's real
  detection and loader and trains like its ``apply_model`` (0.3.75 pins 48 heads, so nothing small loads).
- Full size on a shapes-only (meta) state dict: ComfyUI detects FLUX.2 dev (both hosts) and Klein 4B
  (current ComfyUI; 0.3.75 pins 48 heads, so it cannot build Klein at all) as model_base.Flux2, and
  the family accepts them, with the shared modulation Linears in ``all_linear`` only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pipetrainer.devkit.fixtures import flux_params
from pipetrainer.tests.family_rows.flux2 import flux2_small
from pipetrainer.tests.test_chroma import detected_on_meta
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for
from pipetrainer.training.pipelines.flux import FluxOptions


def _flux2_full(**params) -> torch.nn.Module:
    """A full-size Flux.2 network on the meta device (keys and shapes only)."""
    from comfy.ldm.flux.model import Flux, FluxParams

    full = dict(in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360, hidden_size=6144,
                mlp_ratio=3.0, num_heads=48, depth=8, depth_single_blocks=48, axes_dim=[32, 32, 32, 32], theta=2000,
                patch_size=1, qkv_bias=False, guidance_embed=True, global_modulation=True, mlp_silu_act=True,
                ops_bias=False)
    full.update(params)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
        full["txt_ids_dims"] = [3]
    with torch.device("meta"):
        return Flux(image_model="flux2", operations=torch.nn, **flux_params(**full))


def _staged(model, adapter, noisy, sigma, cond, options):
    from pipetrainer.training.objective.loss import noisy_input_and_target

    ms = model.model_sampling
    network_input = ms.calculate_input(sigma.view(-1, 1, 1, 1), noisy)
    timestep = noisy_input_and_target(ms, noisy, noisy, sigma).timestep
    out = tuple(adapter.first_stage_inputs(Batch(network_input, timestep, cond, None, options=options)))
    for layer in adapter.stage_layers(model.diffusion_model):
        out = layer(out)
    return ms.calculate_denoised(sigma, out, noisy)


@pytest.mark.parametrize("guidance_embed", [True, False], ids=["dev", "klein"])
def test_short_captions_are_left_padded_to_512_tokens_like_comfyui(comfy_root, guidance_embed):
    from pipetrainer.training.data.micro_batches import stack_text

    model = flux2_small(guidance_embed=guidance_embed).model
    adapter = adapter_for("Flux2")
    options = FluxOptions(guidance=2.5)
    g = torch.Generator().manual_seed(5)
    noisy = torch.randn(2, 8, 4, 6, generator=g)
    sigma = torch.tensor([0.4, 0.9])
    captions = [torch.randn(6, 16, generator=g), torch.randn(2, 16, generator=g)]
    cond = stack_text(captions, adapter.text_length([len(c) for c in captions]))
    with torch.no_grad():
        ours = _staged(model, adapter, noisy, sigma, cond, options)
        for i, caption in enumerate(captions):
            conds = model.extra_conds(cross_attn=caption[None], noise=noisy[i:i + 1], device="cpu", guidance=options.guidance,
                                      pooled_output=None)
            assert conds["c_crossattn"].cond.shape[1] == 512
            kwargs = {k: v.cond for k, v in conds.items() if k != "c_crossattn"}
            alone = model.apply_model(noisy[i:i + 1], sigma[i:i + 1], c_crossattn=conds["c_crossattn"].cond, **kwargs)
            assert torch.allclose(ours[i:i + 1], alone, rtol=0, atol=1e-5 * alone.abs().max().item())
        # The text tokens the first stage gets are exactly ComfyUI's padded cond of each caption.
        first = adapter.first_stage_inputs(Batch(noisy, sigma, cond, None, options=options))[2]
        for i, caption in enumerate(captions):
            assert torch.equal(first[i], model.extra_conds(cross_attn=caption[None], device="cpu", pooled_output=None,
                                                           noise=noisy[i:i + 1])["c_crossattn"].cond[0])


def _accepts(model, hidden: int, blocks: int) -> None:
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.pipelines.targets import model_targets

    assert type(model).__name__ == "Flux2" and family_name_for(model) == "Flux2"
    assert checks.model_support_problems(model) == []
    adapter = adapter_for("Flux2")
    dm = model.diffusion_model
    assert len(adapter.stage_layers(dm)) == blocks + 2
    shared = {"double_stream_modulation_img.lin", "double_stream_modulation_txt.lin", "single_stream_modulation.lin"}
    assert shared <= set(model_targets(dm, adapter.lora_target_regex("all_linear")))
    assert not shared & set(model_targets(dm, adapter.lora_target_regex("attention_mlp")))
    assert dm.hidden_size == hidden


def test_full_size_flux2_dev_is_detected_and_accepted_on_shapes_only(comfy_root):
    _, model = detected_on_meta(_flux2_full())
    _accepts(model, hidden=6144, blocks=8 + 48)
    assert adapter_for("Flux2").conditioning_dims(model.diffusion_model) == (15360, 0)
    assert model.diffusion_model.params.guidance_embed
    assert float(model.model_sampling.shift) == 2.02  # ModelSamplingFlux's mu from the Flux2 config


def test_full_size_flux2_klein_is_detected_and_accepted_on_shapes_only(comfy_root):
    from comfy.ldm.flux.model import FluxParams

    if "txt_ids_dims" not in {f.name for f in dataclasses.fields(FluxParams)}:
        pytest.skip("ComfyUI 0.3.75 pins Flux.2 at 48 heads: it cannot build Klein (hidden 3072) at all")
    _, model = detected_on_meta(_flux2_full(hidden_size=3072, num_heads=24, depth=5, depth_single_blocks=20,
                                            context_in_dim=7680, guidance_embed=False))
    _accepts(model, hidden=3072, blocks=5 + 20)
    assert not model.diffusion_model.params.guidance_embed
    assert adapter_for("Flux2").conditioning_dims(model.diffusion_model) == (7680, 0)


@pytest.mark.parametrize("guidance_embed", [True, False], ids=["dev", "klein"])
def test_tiny_flux2_loaded_by_comfyuis_detection_trains_like_comfyui(comfy_root, guidance_embed):
    """Current ComfyUI derives the head count from the width, so a 1 M-parameter Flux.2 (one 128-wide
    head) goes through its real detection and loader; the staged forward equals its ``apply_model``."""
    import comfy.sd
    from comfy.ldm.flux.model import FluxParams

    if "txt_ids_dims" not in {f.name for f in dataclasses.fields(FluxParams)}:
        pytest.skip("ComfyUI 0.3.75 pins Flux.2 at 48 heads: no small Flux.2 loads")
    from comfy.ldm.flux.model import Flux
    from pipetrainer.tests.family_rows.common import collect_warnings

    torch.manual_seed(0)
    network = Flux(image_model="flux2", operations=torch.nn, **flux_params(
        in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=64, hidden_size=128, mlp_ratio=3.0,
        num_heads=1, depth=1, depth_single_blocks=1, axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1,
        qkv_bias=False, guidance_embed=guidance_embed, global_modulation=True, mlp_silu_act=True, ops_bias=False,
        txt_ids_dims=[3]))
    with collect_warnings() as warnings:
        patcher = comfy.sd.load_diffusion_model_state_dict(network.state_dict())
    assert not [w for w in warnings if "missing" in w or "unexpected" in w], warnings
    model = patcher.model
    assert type(model).__name__ == "Flux2" and family_name_for(model) == "Flux2"
    assert model.diffusion_model.params.guidance_embed == guidance_embed
    assert sum(p.numel() for p in model.diffusion_model.parameters()) < 1.5e6
    model.diffusion_model.float()
    adapter = adapter_for("Flux2")
    options = FluxOptions(guidance=4.0)
    g = torch.Generator().manual_seed(6)
    noisy = torch.randn(1, 128, 3, 5, generator=g)
    sigma = torch.tensor([0.6])
    caption = torch.randn(1, 4, 64, generator=g)
    with torch.no_grad():
        ours = _staged(model, adapter, noisy, sigma, caption, options)
        conds = model.extra_conds(cross_attn=caption, noise=noisy, device="cpu", guidance=options.guidance, pooled_output=None)
        theirs = model.apply_model(noisy, sigma, **{k: v.cond for k, v in conds.items()})
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item()), (ours - theirs).abs().max()
