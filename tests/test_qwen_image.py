"""Qwen-Image / Qwen-Image-Edit beyond the generic family checks (tests/test_families.py, rows
``QwenImage`` and ``QwenImageEdit``).

- The trainer's own data path (cached raw latents, ``reference_0`` as the cache stores it, the
  micro-batch builder): the staged forward equals ComfyUI's ``apply_model`` with the conditioning
  ComfyUI's ``QwenImage.extra_conds`` builds from the same raw reference latent (what the
  ReferenceLatent / TextEncodeQwenImageEdit nodes hand it), and the loss target denoises, by
  ComfyUI's ``model_sampling``, back to the clean latent.
- Full size: ComfyUI's detection on a shapes-only (meta) state dict of the real layout (60 blocks,
  3072 wide, 20 B parameters never materialised) gives model_base.QwenImage, which the family takes,
  with reference extras optional; on current ComfyUI the 2511 marker makes ``reference_0`` required
  and the Layered layout is refused by name.
- Edit-2511 (current ComfyUI only: 0.3.75 cannot build it): the reference tokens' timestep-0
  modulation, against ComfyUI's forward.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from pipetrainer.tests.family_rows.qwen_image import CONTEXT, qwen_image_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for, reference_extra


def _detected_on_meta(state: dict):
    """ComfyUI's detection of a shapes-only state dict, and its model_base built on meta."""
    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet(state, "")
    assert config is not None, "ComfyUI did not detect the state dict"
    config.set_inference_dtype(torch.bfloat16, None)
    return config, config.get_model(state, "", device=torch.device("meta"))


def _full_state(**extra) -> dict:
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    network = QwenImageTransformer2DModel(num_layers=60, device=torch.device("meta"),
                                          operations=comfy.ops.disable_weight_init, **extra)
    return network.state_dict()


def _needs_argument(name: str) -> None:
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    if name not in inspect.signature(QwenImageTransformer2DModel.__init__).parameters:
        pytest.skip(f"this ComfyUI's Qwen-Image model has no {name!r} (Qwen-Image-Edit-2511 / Layered support "
                    "came after ComfyUI 0.3.75)")


def test_data_path_with_a_reference_equals_comfyuis_edit_conditioning(comfy_root):
    from pipetrainer.training.data.micro_batches import Example, MicroBatches
    from pipetrainer.training.spec.options import TimestepSpec

    model = qwen_image_small().model
    adapter = adapter_for("QwenImage")
    g = torch.Generator().manual_seed(5)
    latent, reference = torch.randn(16, 6, 8, generator=g), torch.randn(16, 10, 4, generator=g)  # as cached: [C, h, w]
    cond = torch.randn(6, CONTEXT, generator=g)
    example = Example(latent, cond, None, extras={reference_extra(0): reference},
                      latent_extra_shapes=((reference_extra(0), tuple(reference.shape)),))
    batches = MicroBatches([example], 1, 11, model, adapter, TimestepSpec(), torch.device("cpu"))
    inputs, target = batches.build(0)
    assert len(inputs) == 4  # noisy, timestep, cond, reference_0
    noisy, timestep = inputs[0], inputs[1]
    sigma = timestep  # Qwen-Image's ModelSamplingFlux: timestep = sigma
    with torch.no_grad():
        out = inputs
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        ours = model.model_sampling.calculate_denoised(sigma, out.float(), noisy)
        conds = model.extra_conds(cross_attn=cond[None], reference_latents=[reference[None, :, None]])
        theirs = model.apply_model(noisy, sigma, c_crossattn=conds["c_crossattn"].cond,
                                   ref_latents=conds["ref_latents"].cond)
        without = model.apply_model(noisy, sigma, c_crossattn=cond[None])
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()
    assert (without - theirs).abs().max() > 1e-3 * theirs.abs().max()  # the reference really conditions
    clean = model.process_latent_in(latent[None, :, None])
    denoised = model.model_sampling.calculate_denoised(sigma, target, noisy)
    assert torch.allclose(denoised, clean, atol=1e-5)


def test_full_size_qwen_image_is_detected_and_accepted_on_shapes_only(comfy_root):
    from pipetrainer.training.pipelines import checks

    config, model = _detected_on_meta(_full_state())
    assert type(model).__name__ == "QwenImage" and family_name_for(model) == "QwenImage"
    dm = model.diffusion_model
    adapter = adapter_for("QwenImage")
    assert checks.model_support_problems(model) == []
    assert adapter.conditioning_dims(dm) == (3584, 0)
    assert model.latent_format.latent_channels == 16 and adapter.geometry(dm).video
    assert len(adapter.stage_layers(dm)) == 60 + 2
    assert checks.block_layout(model) == [False, False, *[True] * 60, False]
    extras = adapter.extras(dm)
    assert reference_extra(0) in extras and not any(spec.required for spec in extras.values())
    assert all(spec.is_latent and spec.source == "latent" for spec in extras.values())
    # rank 16 over the attention: 8 projections of 3072 x 3072 per block
    assert checks.lora_parameter_count(model, 16, "attention") == 16 * 60 * 8 * (3072 + 3072)
    assert sum(p.numel() for p in dm.parameters()) > 19e9
    assert float(model.model_sampling.shift) == pytest.approx(1.15)  # Flux-style mu, shared with ComfyUI


def test_qwen_image_edit_2511_requires_a_reference_and_layered_is_refused(comfy_root):
    _needs_argument("default_ref_method")
    from pipetrainer.training.pipelines import checks

    _, model = _detected_on_meta({**_full_state(default_ref_method="index_timestep_zero")})
    assert model.diffusion_model.default_ref_method == "index_timestep_zero"
    extras = adapter_for("QwenImage").extras(model.diffusion_model)
    assert extras[reference_extra(0)].required and not extras[reference_extra(1)].required
    assert checks.model_support_problems(model) == []

    _needs_argument("use_additional_t_cond")
    _, layered = _detected_on_meta(_full_state(use_additional_t_cond=True, default_ref_method="negative_index"))
    problems = checks.model_support_problems(layered)
    assert len(problems) == 1 and "Layered" in problems[0]
    with pytest.raises(NotImplementedError, match="Layered"):
        adapter_for("QwenImage").stage_layers(layered.diffusion_model)


def test_edit_2511_reference_tokens_at_timestep_zero_equal_comfyuis_forward(comfy_root):
    _needs_argument("default_ref_method")
    from pipetrainer.training.objective.loss import noisy_input_and_target

    model = qwen_image_small(default_ref_method="index_timestep_zero").model
    adapter = adapter_for("QwenImage")
    g = torch.Generator().manual_seed(8)
    x0 = model.process_latent_in(torch.randn(2, 16, 1, 6, 5, generator=g))
    refs = [model.process_latent_in(torch.randn(2, 16, 1, 4, 7, generator=g))]
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.4, 0.9])
    cond = torch.randn(2, 3, CONTEXT, generator=g)
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    noisy = model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1, 1), noise, x0)
    batch = Batch(noised.network_input, noised.timestep, cond, extras={reference_extra(0): refs[0]})
    with torch.no_grad():
        out = adapter.first_stage_inputs(batch)
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        ours = model.model_sampling.calculate_denoised(sigma, out, noisy)
        theirs = model.apply_model(noisy, sigma, c_crossattn=cond, ref_latents=refs)
        plain_index = model.apply_model(noisy, sigma, c_crossattn=cond, ref_latents=refs, ref_latents_method="index")
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()
    assert (plain_index - theirs).abs().max() > 1e-3 * theirs.abs().max()  # timestep zero really differs


def test_preflight_checks_cached_references_against_the_model(comfy_root):
    import dataclasses

    from pipetrainer.training.pipelines import checks

    inputs = checks.model_inputs(qwen_image_small().model)
    shapes = checks.CachedShapes(latents={"a": (16, 1, 16, 16)}, conds={"t": (5, CONTEXT)}, pooled={"t": 0},
                                 unreadable=(), extras={"a": {reference_extra(0): (16, 12, 20)}},
                                 items=(("photo.png", "a", "t"),))
    assert checks.cache_vs_model_problems(shapes, inputs) == []
    assert checks.cache_vs_model_problems(dataclasses.replace(shapes, extras={}), inputs) == []  # optional
    wrong = dataclasses.replace(shapes, extras={"a": {reference_extra(0): (4, 12, 20)}})  # another VAE's latent
    problems = checks.cache_vs_model_problems(wrong, inputs)
    assert len(problems) == 1 and reference_extra(0) in problems[0] and "photo.png" in problems[0]
