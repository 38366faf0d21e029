"""Lumina 2 / Z-Image beyond the generic family checks (tests/test_families.py, rows ``Lumina2`` and ``ZImage``).

- Full size: ComfyUI's detection on shapes-only (meta) state dicts of the real layouts (Lumina 2:
  dim 2304, 26 layers; Z-Image: dim 3840, 30 layers, pad tokens; never materialised) gives
  model_base.Lumina2 with ComfyUI's Lumina2 / ZImage config (flow matching, shift 6 / 3), which the
  family takes with the real text widths (Gemma-2-2B 2304, Qwen3-4B 2560).
- A micro-batch of two examples at different sigmas and captions of different lengths, as the data
  pipeline stacks them: each example's staged output equals ComfyUI's ``apply_model`` on the padded
  micro-batch (the time direction ``1 - t`` and the negated output hold per example).
- Current ComfyUI only: NewBie (a pooled CLIP vector) is refused by name.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from pipetrainer.tests.family_rows.lumina2 import ZIMAGE_CONTEXT, zimage_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for

LUMINA2_FULL = dict(patch_size=2, in_channels=16, dim=2304, n_layers=26, n_refiner_layers=2, n_heads=24, n_kv_heads=8,
                    multiple_of=256, ffn_dim_multiplier=4.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2304,
                    axes_dims=[32, 32, 32], axes_lens=[300, 512, 512], rope_theta=10000.0)
ZIMAGE_FULL = dict(patch_size=2, in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                   multiple_of=256, ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                   axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0, z_image_modulation=True,
                   time_scale=1000.0, pad_tokens_multiple=32)


def _detected_on_meta(**params):
    """ComfyUI's detection of a NextDiT state dict (shapes only), and its model_base built on meta."""
    import comfy.model_detection
    import comfy.ops
    from comfy.ldm.lumina.model import NextDiT

    state = NextDiT(device=torch.device("meta"), operations=comfy.ops.disable_weight_init, **params).state_dict()
    config = comfy.model_detection.model_config_from_unet(state, "")
    assert config is not None, "ComfyUI did not detect the state dict"
    config.set_inference_dtype(torch.bfloat16, None)
    return config, config.get_model(state, "", device=torch.device("meta"))


@pytest.mark.parametrize("layout, config_name, context, shift, refiners, layers, size", [
    (LUMINA2_FULL, "Lumina2", 2304, 6.0, 2, 26, 2.5e9),
    (ZIMAGE_FULL, "ZImage", 2560, 3.0, 2, 30, 6.0e9),
], ids=["Lumina2", "ZImage"])
def test_full_size_layouts_are_detected_and_accepted_on_shapes_only(comfy_root, layout, config_name, context, shift,
                                                                     refiners, layers, size):
    from pipetrainer.training.objective.loss import prediction_type
    from pipetrainer.training.pipelines import checks

    config, model = _detected_on_meta(**layout)
    assert type(config).__name__ == config_name
    assert type(model).__name__ == "Lumina2" and family_name_for(model) == "Lumina2"
    dm = model.diffusion_model
    adapter = adapter_for("Lumina2")
    assert checks.model_support_problems(model) == []
    assert adapter.conditioning_dims(dm) == (context, 0)
    assert prediction_type(model.model_sampling) == "flow"
    assert float(model.model_sampling.shift) == pytest.approx(shift)
    blocks = 2 * refiners + layers
    assert len(adapter.stage_layers(dm)) == blocks + 2
    assert checks.block_layout(model) == [False, False, *[True] * blocks, False]
    dim, heads, kv = layout["dim"], layout["n_heads"], layout["n_kv_heads"]
    qkv = (heads + 2 * kv) * (dim // heads)
    assert checks.lora_parameter_count(model, 16, "attention") == 16 * blocks * ((dim + qkv) + (dim + dim))
    assert sum(p.numel() for p in dm.parameters()) > size


def test_a_padded_micro_batch_at_two_sigmas_equals_comfyuis_forward(comfy_root):
    from pipetrainer.training.data.micro_batches import stack_text
    from pipetrainer.training.objective.loss import noisy_input_and_target

    model = zimage_small().model
    adapter = adapter_for("Lumina2")
    g = torch.Generator().manual_seed(6)
    x0 = model.process_latent_in(torch.randn(2, 16, 6, 7, generator=g))
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.15, 0.85])
    conds = [torch.randn(9, ZIMAGE_CONTEXT, generator=g), torch.randn(4, ZIMAGE_CONTEXT, generator=g)]
    cond = stack_text(conds, adapter.text_length([len(c) for c in conds]))
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    noisy = model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
    with torch.no_grad():
        out = adapter.first_stage_inputs(Batch(noised.network_input, noised.timestep, cond))
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        ours = model.model_sampling.calculate_denoised(sigma, out, noisy)
        theirs = model.apply_model(noisy, sigma, c_crossattn=cond, num_tokens=cond.shape[1])
        swapped = model.apply_model(noisy, sigma.flip(0), c_crossattn=cond, num_tokens=cond.shape[1])
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()
    assert (swapped - theirs).abs().max() > 1e-3 * theirs.abs().max()  # each example's own time matters


def test_newbie_is_refused_by_name(comfy_root):
    from comfy.ldm.lumina.model import NextDiT
    from pipetrainer.training.pipelines import checks

    if "clip_text_dim" not in inspect.signature(NextDiT.__init__).parameters:
        pytest.skip("this ComfyUI's NextDiT has no clip_text_dim (NewBie support came after ComfyUI 0.3.75)")
    _, model = _detected_on_meta(**LUMINA2_FULL, clip_text_dim=1024)
    problems = checks.model_support_problems(model)
    assert len(problems) == 1 and "NewBie" in problems[0]
    with pytest.raises(NotImplementedError, match="NewBie"):
        adapter_for("Lumina2").stage_layers(model.diffusion_model)
