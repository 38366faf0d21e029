"""Wan beyond text-to-video: TI2V-5B with a clean first frame, A14B expert ranges, image-to-video concat.

The oracles are ComfyUI's own code: ``WAN22.process_timestep`` with the sampler's noise mask, the
``WanImageToVideo`` node with a real (narrow) Wan VAE followed by ``WAN21.extra_conds``, and the
model's ``model_sampling`` schedule. The generic checks of these layouts are rows of
tests/test_families.py (tests/family_rows/wan_video.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from pipetrainer.tests.family_rows.wan_video import ROWS, i2v_concat_mask
from pipetrainer.training.pipelines.base import Batch, adapter_for

ROW = {row.name: row for row in ROWS}


def _load(name, comfy_root, fixture_paths):
    return ROW[name].load(comfy_root, fixture_paths).model


def _staged(adapter, dm, batch):
    out = adapter.first_stage_inputs(batch)
    for layer in adapter.stage_layers(dm):
        out = layer(out)
    return out


def test_ti2v_first_frame_clean_equals_comfyui_with_a_noise_mask(comfy_root, fixture_paths):
    """First latent frame clean, its tokens at timestep 0, as ComfyUI samples Wan22ImageToVideoLatent."""
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.wan import WanOptions

    model = _load("Wan22-TI2V", comfy_root, fixture_paths)
    assert type(model).__name__ == "WAN22"
    adapter = adapter_for("Wan")
    g = torch.Generator().manual_seed(4)
    x0 = model.process_latent_in(torch.randn(1, 48, 3, 6, 10, generator=g))
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.6])
    cond = torch.randn(1, 7, 4096, generator=g)
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    options = WanOptions(first_frame_clean=True)
    batch = Batch(noised.network_input, noised.timestep, cond, options=options, clean=x0)
    with torch.no_grad():
        ours = _staged(adapter, model.diffusion_model, batch)
        plain = _staged(adapter, model.diffusion_model, Batch(noised.network_input, noised.timestep, cond))

    # ComfyUI: the sampler's inpaint step puts the (unscaled, WAN22.scale_latent_inpaint) clean latent
    # where the noise mask is 0; WAN22.process_timestep turns the mask into per-frame timesteps.
    mask = torch.ones(1, 1, 3, 6, 10)
    mask[:, :, 0] = 0.0
    x_in = noised.network_input * mask + x0 * (1 - mask)
    with torch.no_grad():
        theirs = model.apply_model(x_in, sigma, c_crossattn=cond, denoise_mask=mask)
    ours_denoised = model.model_sampling.calculate_denoised(sigma, ours.float(), x_in)
    assert torch.allclose(ours_denoised, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    assert (ours - plain).abs().max() > 1e-3  # the clean frame and its timestep really change the output

    weight = adapter.loss_mask((48, 3, 6, 10), options)
    assert weight.shape == (1, 3, 1, 1) and weight.flatten().tolist() == [0.0, 1.0, 1.0]
    assert adapter.loss_mask((48, 1, 6, 10), options) is None  # an image: text-to-image, nothing clean
    assert adapter.loss_mask((48, 3, 6, 10), WanOptions()) is None


def test_i2v_concat_equals_what_wanimagetovideo_builds(comfy_root, fixture_paths):
    """The cache recipe for ``concat_latent`` (VAE latent of the first frame followed by gray frames)
    gives the adapter the channels ComfyUI's WanImageToVideo + WAN21.concat_cond give the model."""
    from comfy_extras.nodes_wan import WanImageToVideo
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.encoders import latent_layout

    model = _load("Wan21-I2V", comfy_root, fixture_paths)
    vae = tiny_wan21_vae()
    length, height, width = 5, 32, 48
    start = torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(8))
    cond = torch.randn(1, 7, 4096, generator=torch.Generator().manual_seed(9))
    node = WanImageToVideo.execute([[cond, {}]], [[cond, {}]], vae, width, height, length, 1, start_image=start)
    positive, _, latent = node.result if hasattr(node, "result") else node
    values = positive[0][1]
    noise = torch.randn(latent["samples"].shape, generator=torch.Generator().manual_seed(10))
    theirs = model.extra_conds(noise=noise, device=torch.device("cpu"), cross_attn=cond,
                               concat_latent_image=values["concat_latent_image"],
                               concat_mask=values["concat_mask"])["c_concat"].cond

    # What the cache stores for an I2V item: the raw VAE latent of [first frame, gray, gray, ...].
    pixels = torch.cat([start, torch.full((length - 1, height, width, 3), 0.5)])
    raw = latent_layout(vae.encode(pixels).to(torch.float32), length)
    assert raw.shape == noise.shape[1:]
    processed = model.process_latent_in(raw[None])  # the trainer's is_latent step
    t = model.model_sampling.timestep(torch.tensor([0.5]))
    x, *_ = adapter_for("Wan").first_stage_inputs(Batch(noise, t, cond, extras={"concat_latent": processed}))
    assert x.shape[1] == model.diffusion_model.in_dim
    assert torch.equal(x[:, :16], noise)
    assert torch.allclose(x[:, 16:], theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)
    assert torch.equal(i2v_concat_mask(noise), values["concat_mask"])


def _expert_sigmas(model, options, n=20_000):
    from pipetrainer.training.objective.timesteps import family_timesteps, sample_sigmas
    from pipetrainer.training.spec.options import TimestepSpec

    spec = family_timesteps(TimestepSpec(), adapter_for("Wan"), model.diffusion_model, options)
    return spec, sample_sigmas(n, spec, torch.Generator().manual_seed(0), model.model_sampling)


@pytest.mark.parametrize(("name", "boundary"), [("Wan22-I2V", 0.9), ("Wan22-TI2V", 0.875)])
def test_expert_presets_restrict_sigmas_to_the_experts_range(name, boundary, comfy_root, fixture_paths):
    """High noise: the model's schedule above the boundary; low noise: below it (the Wan 2.2 split)."""
    from pipetrainer.training.pipelines.wan import WanOptions

    model = _load(name, comfy_root, fixture_paths)
    schedule = model.model_sampling.sigmas.double()
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    for expert, keep in (("high_noise", schedule >= boundary), ("low_noise", schedule <= boundary)):
        spec, sigmas = _expert_sigmas(model, WanOptions(expert=expert))
        assert (spec.sigma_min, spec.sigma_max) == ((boundary, 1.0) if expert == "high_noise" else (0.0, boundary))
        inside = (sigmas >= boundary) if expert == "high_noise" else (sigmas <= boundary)
        assert bool(inside.all())
        got = torch.quantile(sigmas.double(), q)
        assert torch.allclose(got, torch.quantile(schedule[keep], q), atol=0.01), (expert, got)
    spec, _ = _expert_sigmas(model, WanOptions(expert="low_noise", expert_boundary=0.5))
    assert spec.sigma_max == 0.5


def test_expert_and_boundary_are_in_the_lora_metadata(comfy_root, fixture_paths, tmp_path):
    from pipetrainer.training.adapters.lora_file import atomic_save, family_metadata
    from pipetrainer.training.pipelines.options import parse_family_options
    from pipetrainer.training.pipelines.wan import WanOptions
    from safetensors import safe_open

    model = _load("Wan22-I2V", comfy_root, fixture_paths)
    options, problems = parse_family_options("Wan", WanOptions, {"expert": "high_noise"})
    assert problems == []
    meta = family_metadata(adapter_for("Wan"), model.diffusion_model, options)
    path = atomic_save({"x": torch.zeros(1)}, tmp_path / "lora.safetensors", meta)
    with safe_open(str(path), "pt") as f:
        saved = f.metadata()
    assert saved["wan.expert"] == "high_noise" and float(saved["wan.expert_boundary"]) == 0.9
    assert json.loads(saved["family_options"])["expert"] == "high_noise"
    assert "wan.expert" not in family_metadata(adapter_for("Wan"), model.diffusion_model, WanOptions())
    assert parse_family_options("Wan", WanOptions, {"expert": "middle"})[1]
    assert parse_family_options("Wan", WanOptions, {"expert_boundary": 0.9})[1]  # no expert chosen


def test_unsupported_wan_layouts_are_refused_by_name(comfy_root, fixture_paths):
    """A Fun-control layout (48 input channels for 16 out) is not the I2V concat the adapter builds."""
    import torch.nn as nn
    from comfy.ldm.wan.model import WanModel

    dm = WanModel(model_type="i2v", patch_size=(1, 2, 2), in_dim=48, dim=128, ffn_dim=256, freq_dim=256,
                  text_dim=64, out_dim=16, num_heads=1, num_layers=1, device="meta", operations=nn)
    problems = adapter_for("Wan").support_problems(dm)
    assert problems and "48 input channels" in problems[0]


def test_a_clean_first_frame_on_an_image_to_video_model_is_refused():
    from pipetrainer.training.pipelines.wan import WanOptions

    x = torch.zeros(1, 16, 3, 4, 4)
    batch = Batch(x, torch.ones(1), torch.zeros(1, 2, 8), extras={"concat_latent": x}, clean=x,
                  options=WanOptions(first_frame_clean=True))
    with pytest.raises(ValueError, match="leave first_frame_clean off"):
        adapter_for("Wan").first_stage_inputs(batch)


def test_cache_frame_buckets_follow_the_vaes_temporal_rule(comfy_root):
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.buckets import frame_bucket
    from pipetrainer.training.cache.encoders import vae_frame_step

    assert vae_frame_step(tiny_wan21_vae()) == 4
    assert [frame_bucket(n, 100, 8) for n in (1, 8, 9, 16, 17, 30)] == [1, 1, 9, 9, 17, 25]
    assert [frame_bucket(n, 33, 1) for n in (1, 2, 7)] == [1, 2, 7]
    assert vae_frame_step(object()) == 4  # an image VAE: the common 4k+1 buckets


@pytest.mark.slow
def test_ti2v_expert_run_trains_with_a_clean_first_frame_and_records_the_expert(comfy_root, fixture_paths, tmp_path):
    """The real process tree with Wan options: a TI2V high-noise-expert run with a clean first frame trains
    (finite, changing losses; a non-zero LoRA), and its file says which expert and boundary it is."""
    import dataclasses
    import math

    from pipetrainer.devkit.fixtures_video import WAN22_TI2V_FILE
    from pipetrainer.tests.family_rows.common import cache_items
    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.training.spec.options import LoraSpec
    from safetensors import safe_open

    row = ROW["Wan22-TI2V"]
    model = _load("Wan22-TI2V", comfy_root, fixture_paths)  # builds the detected file once
    file = comfy_root / "models" / "diffusion_models" / WAN22_TI2V_FILE
    items = cache_items(row, model, tmp_path / "cache")
    spec = make_spec(file, items, tmp_path / "run", comfy_root, steps=3, pipeline_stages=1,
                     lora=LoraSpec(rank=4, alpha=4.0, targets="attention_mlp"))
    spec = dataclasses.replace(spec, family_options={"first_frame_clean": True, "expert": "high_noise"})
    code, events = run_training(spec.validated())
    assert code == 0, [e for e in events if e["type"] == "error"]
    got = losses(events)
    assert len(got) == 3 and all(math.isfinite(v) for v in got) and len(set(got)) > 1
    with safe_open(spec.lora_output, "pt") as f:
        meta = f.metadata()
        assert any(f.get_tensor(k).abs().max() > 0 for k in f.keys() if k.endswith("lora_B.weight"))
    assert meta["wan.expert"] == "high_noise" and float(meta["wan.expert_boundary"]) == 0.875
    assert meta["wan.first_frame_clean"] == "true"
    step_times = [e["step_time"] for e in events if e["type"] == "step"]
    print(f"Wan22-TI2V s/step (1 stage): {step_times}")
