"""SDXL beyond the generic family table: detection of the real layout, the loss targets, the size/crop vector and
the relatives that are refused. What crosses stage boundaries (the UNet's skip stack, shared with SD 1.x / 2.x)
is in tests/test_stage_split.py.

ComfyUI's detection pins SDXL at 2.57 B parameters, so the real layout is built on the meta device (shapes
only, no memory) and fed to ComfyUI's own detection; everything numeric runs on the tiny rows of
tests/family_rows/sdxl.py, built with ComfyUI's SDXL config class.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.sdxl import POOLED, SIZE_CROP, UNET, comfy_y, sdxl_small

FULL_SDXL = {  # the shapes of a full SDXL base UNet (what ComfyUI detects as comfy.supported_models.SDXL)
    **UNET, "adm_in_channels": 2816, "model_channels": 320, "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 4],
    "transformer_depth": [0, 0, 2, 2, 10, 10], "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "transformer_depth_middle": 10, "context_dim": 2048, "num_head_channels": 64,
}


def _meta_state_dict() -> dict[str, torch.Tensor]:
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    unet = UNetModel(**FULL_SDXL, dtype=torch.float16, device="meta", operations=comfy.ops.disable_weight_init)
    return unet.state_dict()


@pytest.fixture(scope="module")
def full_size(comfy_root):
    """ComfyUI's detection and model class on the shapes of a full SDXL UNet (meta tensors)."""
    import comfy.model_detection

    state = _meta_state_dict()
    config = comfy.model_detection.model_config_from_unet(state, "")
    return state, config, config.get_model(state, "", device="meta")


def test_full_size_sdxl_is_detected_and_trainable_on_any_split(full_size):
    import comfy.lora
    import comfy.model_base
    import comfy.supported_models
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    from pipetrainer.training.model.partition import describe, require_lora_on_every_stage
    from pipetrainer.training.objective.loss import prediction_type
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.pipelines.targets import model_targets

    state, config, model = full_size
    assert type(config) is comfy.supported_models.SDXL and type(model) is comfy.model_base.SDXL
    assert round(sum(v.numel() for v in state.values()) / 1e9, 2) == 2.57
    assert family_name_for(model) == "SDXL" and prediction_type(model.model_sampling) == "eps"
    assert checks.model_support_problems(model) == []
    adapter = adapter_for("SDXL")
    dm = model.diffusion_model
    assert adapter.conditioning_dims(dm) == (2048, 1280)  # CLIP-L + CLIP-G states, CLIP-G pooled
    layers = adapter.stage_layers(dm)
    assert len(layers) == 1 + 8 + 1 + 9 + 1 and adapter.layer_layout(dm) == [layer.swappable for layer in layers]

    key_map = comfy.lora.model_lora_keys_unet(model, {})
    counts = {}
    for preset in ("attention", "attention_mlp", "all_linear"):
        targets = model_targets(dm, adapter.lora_target_regex(preset))
        assert {f"diffusion_model.{p}" for p in targets} <= set(key_map)
        counts[preset] = len(targets)
    # 70 transformer layers (24 down, 10 middle, 36 up) x (8 attention + 2 MLP) Linears; all_linear adds the
    # proj_in/proj_out of 11 SpatialTransformers and the time projection of 17 ResBlocks
    assert counts == {"attention": 560, "attention_mlp": 700, "all_linear": 700 + 22 + 17}

    pipeline = [lambda x: x, *layers]  # the engine puts its input preparation first
    weights = [0] + [sum(p.numel() for p in layer.parameters()) for layer in layers]
    regex = adapter.lora_target_regex("attention")
    for stages in (2, 3, 4):
        for parts in (partition_balanced(weights, stages), partition_uniform(len(pipeline), stages)):
            require_lora_on_every_stage(describe(pipeline, [int(p) for p in parts], regex), "attention")
    # Parameter balancing splits among the big 1280-channel blocks (input 7-8, middle, output 0-2);
    # uniform leaves one stage with almost all of them: both are valid, "parameters" is the balanced one.
    assert [int(p) for p in partition_balanced(weights, 3)] == [0, 10, 12, 21]
    assert [int(p) for p in partition_uniform(len(pipeline), 3)] == [0, 7, 14, 21]


def test_v_pred_flag_of_a_full_size_file_gives_v_prediction(full_size):
    from pipetrainer.training.objective.loss import prediction_type

    state, config, _ = full_size
    model = config.get_model({**state, "v_pred": torch.zeros(0)}, "", device="meta")
    assert prediction_type(model.model_sampling) == "v"


@pytest.mark.parametrize("flags, kind", [({}, "eps"), ({"v_pred": torch.zeros(0)}, "v"),
                                         ({"v_pred": torch.zeros(0), "ztsnr": torch.zeros(0)}, "v")])
def test_eps_and_v_targets_denoise_to_the_clean_latent_with_comfyuis_model_sampling(comfy_root, flags, kind):
    """The trainer's target, handed to ComfyUI's own ``calculate_denoised`` as the network output, gives x0."""
    from pipetrainer.training.objective.loss import noisy_input_and_target, prediction_type

    ms = sdxl_small(flags).model.model_sampling
    assert prediction_type(ms) == kind
    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(3, 4, 6, 5, generator=g), torch.randn(3, 4, 6, 5, generator=g)
    sigma = torch.stack([ms.sigmas[10], ms.sigmas[500], ms.sigmas[-1]]).float()  # low, middle, highest noise
    got = noisy_input_and_target(ms, x0, noise, sigma)
    s = sigma.view(-1, 1, 1, 1)
    noisy = ms.noise_scaling(s, noise, x0)
    assert torch.allclose(ms.calculate_denoised(sigma, got.target, noisy), x0, atol=1e-4 * max(1.0, sigma.max().item()))
    assert torch.equal(got.network_input, ms.calculate_input(s, noisy))
    assert torch.equal(got.timestep, ms.timestep(sigma).float())
    eps_target = noise
    assert torch.equal(got.target, eps_target) == (kind == "eps")


def test_default_sigmas_are_uniform_over_the_models_discrete_timesteps(comfy_root):
    """Discrete-time SDXL: the default draws (in ComfyUI's timestep units) cover its 1000 steps evenly, and the
    sigma quantiles are those of ``model_sampling.sigmas`` (within sampling noise, relative)."""
    from pipetrainer.training.objective.timesteps import sample_sigmas
    from pipetrainer.training.spec.options import TimestepSpec

    ms = sdxl_small().model.model_sampling
    n = 100_000
    sigma = sample_sigmas(n, TimestepSpec(), torch.Generator().manual_seed(1), ms)
    share = torch.histc(ms.timestep(sigma).float(), bins=10, min=0, max=999) / n
    assert torch.allclose(share, torch.full((10,), 0.1), atol=0.006), share  # ~6 standard deviations
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    assert torch.allclose(torch.quantile(sigma.double(), q), torch.quantile(ms.sigmas.double(), q), rtol=0.02, atol=0)


def test_size_crop_vector_is_what_comfyui_feeds_the_unet(comfy_root):
    """Without a cached ``size_crop`` the ``y`` vector is what ComfyUI's sampler builds for a plain text
    conditioning of that latent (``encode_model_conds``); with one, ComfyUI's ``encode_adm`` of those values."""
    import comfy.samplers
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    model = sdxl_small().model
    adapter = adapter_for("SDXL")
    g = torch.Generator().manual_seed(2)
    noisy = torch.randn(1, 4, 9, 7, generator=g)
    cond, pooled = torch.randn(1, 5, 32, generator=g), torch.randn(1, POOLED, generator=g)
    conds = [{"cross_attn": cond, "pooled_output": pooled, "model_conds": {}}]
    sampler = comfy.samplers.encode_model_conds(model.extra_conds, conds, noisy, "cpu", "positive")
    expected = sampler[0]["model_conds"]["y"].cond
    batch = Batch(noisy, torch.zeros(1), cond, pooled)
    assert torch.equal(adapter.first_stage_inputs(batch)[3], expected)

    sizes = torch.tensor([SIZE_CROP], dtype=torch.int64)
    y = adapter.first_stage_inputs(Batch(noisy, torch.zeros(1), cond, pooled, extras={"size_crop": sizes}))[3]
    assert torch.equal(y, comfy_y(pooled, SIZE_CROP)) and not torch.equal(y, expected)


def test_relatives_are_refused_by_name(comfy_root):
    import comfy.model_base
    import comfy.supported_models
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.pipelines.base import UnknownFamilyError, family_name_for

    ip2p = sdxl_small(unet={**UNET, "in_channels": 8}, config_class=comfy.supported_models.SDXL_instructpix2pix).model
    inpaint = sdxl_small(unet={**UNET, "in_channels": 9}).model
    for model in (ip2p, inpaint):
        assert family_name_for(model) == "SDXL"
        assert any("InstructPix2Pix" in p for p in checks.model_support_problems(model))
    playground = sdxl_small({"edm_mean": torch.zeros(4), "edm_std": torch.ones(4)}).model  # Playground 2.5
    assert any("EDM" in p for p in checks.model_support_problems(playground))
    refiner = object.__new__(comfy.model_base.SDXLRefiner)  # only its class matters to the registry
    with pytest.raises(UnknownFamilyError, match="SDXLRefiner"):
        family_name_for(refiner)


# ---- CosXL-style files: v-prediction on ComfyUI's continuous EDM schedule ---------------------------
COSXL = {"edm_vpred.sigma_max": torch.tensor(120.0), "edm_vpred.sigma_min": torch.tensor(0.002)}  # CosXL's keys


def test_cosxl_edm_vpred_draws_its_own_range_as_comfyuis_normal_scheduler(comfy_root):
    """An ``edm_vpred`` file gets ComfyUI's ModelSamplingContinuousEDM with the file's range: the default draws
    are the sigmas of ComfyUI's own ``normal`` scheduler (log-uniform over [0.002, 120]), not [1, 120]
    (timestep 0 is sigma 1 there), and the v target denoises to x0 through its ``calculate_denoised``."""
    import comfy.model_sampling
    import comfy.samplers
    from pipetrainer.training.objective.loss import noisy_input_and_target, prediction_type
    from pipetrainer.training.objective.timesteps import sample_sigmas
    from pipetrainer.training.spec.options import TimestepSpec

    ms = sdxl_small(COSXL).model.model_sampling
    assert isinstance(ms, comfy.model_sampling.ModelSamplingContinuousEDM) and prediction_type(ms) == "v"
    lo, hi = float(ms.sigma_min), float(ms.sigma_max)
    assert abs(lo - 0.002) < 1e-6 and abs(hi - 120.0) < 1e-3
    sigma = sample_sigmas(40_000, TimestepSpec(), torch.Generator().manual_seed(3), ms).double()
    assert sigma.min() >= lo * (1 - 1e-4) and sigma.max() <= hi * (1 + 1e-4)
    schedule = comfy.samplers.normal_scheduler(ms, 1000)[:-1].double()  # ComfyUI's: timestep(max) .. timestep(min)

    def position(s):  # where a sigma lies in the range, in ComfyUI's timestep units (log sigma / 4 here)
        return (ms.timestep(s) - ms.timestep(torch.tensor(lo))) / (ms.timestep(torch.tensor(hi)) - ms.timestep(torch.tensor(lo)))

    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    got, want = torch.quantile(position(sigma), q), torch.quantile(position(schedule), q)
    assert torch.allclose(got, want, atol=0.012), (got, want)

    g = torch.Generator().manual_seed(6)
    x0, noise = torch.randn(3, 4, 6, 5, generator=g), torch.randn(3, 4, 6, 5, generator=g)
    s = torch.tensor([0.01, 1.0, 100.0])
    noised = noisy_input_and_target(ms, x0, noise, s)
    noisy = ms.noise_scaling(s.view(-1, 1, 1, 1), noise, x0)
    assert torch.allclose(ms.calculate_denoised(s, noised.target, noisy), x0, atol=1e-4 * 100)


def test_flow_only_timestep_settings_are_refused_for_sdxl_models(comfy_root):
    """shift none / fixed / resolution and sigma_min / sigma_max are flow-matching noise levels: refused, by
    option and fix, for eps, v and CosXL models; the model's own sampling passes."""
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.spec.options import TimestepSpec

    for flags in ({}, {"v_pred": torch.zeros(0)}, COSXL):
        model = sdxl_small(flags).model
        assert checks.model_timestep_problems(model, TimestepSpec()) == []
        assert checks.model_timestep_problems(model, TimestepSpec(distribution="logit_normal")) == []
        for shift in ("none", "fixed", "resolution"):
            (problem,) = checks.model_timestep_problems(model, TimestepSpec(shift=shift))
            assert f"shift '{shift}'" in problem and "set shift to 'model'" in problem, problem
        (problem,) = checks.model_timestep_problems(model, TimestepSpec(sigma_min=0.5))
        assert "sigma_min 0.5" in problem and "set sigma_min to 0 and sigma_max to 1" in problem, problem
    assert "0.0292 to 14.6" in checks.model_timestep_problems(sdxl_small().model, TimestepSpec(shift="none"))[0]


# ---- size / crop conditioning written by the cache ---------------------------------------------------
def test_item_crop_is_where_the_cached_pixels_come_from(tmp_path):
    """The crop offsets (in the source scaled to cover the bucket) by hand, and against the pixels the
    cache's own loader makes of a ramp image (each output column/row shows the source position it covers)."""
    import numpy as np
    from PIL import Image
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import load_image
    from pipetrainer.training.cache.prep_extras import ItemCrop, item_crop

    assert item_crop(300, 200, 128, 128) == ItemCrop(300, 200, 128, 128, crop_left=32, crop_top=0)
    assert item_crop(100, 250, 64, 128) == ItemCrop(100, 250, 64, 128, crop_left=0, crop_top=16)
    assert item_crop(333, 500, 64, 64) == ItemCrop(333, 500, 64, 64, crop_left=0, crop_top=16)  # 16.05
    assert item_crop(64, 64, 64, 64) == ItemCrop(64, 64, 64, 64, 0, 0)

    for (w, h), (bw, bh), axis in (((300, 200), (128, 128), 1), ((100, 250), (64, 128), 0)):
        length = (w, h)[1 - axis]
        ramp = np.linspace(0.0, 1.0, length)
        ramp = np.broadcast_to(ramp[None, :] if axis == 1 else ramp[:, None], (h, w))
        path = tmp_path / f"ramp{w}x{h}.png"
        Image.fromarray((ramp * 255).round().astype(np.uint8)).convert("RGB").save(path)
        crop = item_crop(w, h, bw, bh)
        scale = max(bw / w, bh / h)
        offset = crop.crop_left if axis == 1 else crop.crop_top
        pixels = load_image(str(path), Bucket(bw, bh))[0, ..., 0].numpy()  # the cache's own loader
        profile = pixels.mean(axis=0) if axis == 1 else pixels.mean(axis=1)
        for j in (4, (bw if axis == 1 else bh) // 2, (bw if axis == 1 else bh) - 5):
            source = (offset + j + 0.5) / scale - 0.5  # the source pixel position output pixel j covers
            assert abs(profile[j] - source / (length - 1)) < 1.5 / 255, (w, h, j, profile[j], source)


def test_cached_size_crop_is_what_clip_text_encode_sdxl_feeds_encode_adm(comfy_root):
    """For the same numbers, the trainer's ``y`` from the cache's ``size_crop`` equals what ComfyUI's sampler
    builds (``encode_model_conds`` -> ``SDXL.encode_adm``) from CLIPTextEncodeSDXL's width/height/crop inputs:
    width/height = the source's size, crop_w/crop_h = the crop's left/top, target = the bucket."""
    import comfy.samplers
    from pipetrainer.training.cache.prep_extras import item_crop
    from pipetrainer.training.pipelines.base import Batch, adapter_for
    from pipetrainer.training.pipelines.sdxl import size_crop_of

    model = sdxl_small().model
    g = torch.Generator().manual_seed(8)
    crops = [item_crop(1536, 1024, 1024, 1024), item_crop(833, 1400, 768, 1344)]
    noisy = torch.randn(2, 4, 5, 6, generator=g)
    cond, pooled = torch.randn(2, 5, 32, generator=g), torch.randn(2, POOLED, generator=g)
    sizes = torch.stack([size_crop_of(c) for c in crops])
    assert sizes.dtype == torch.int64 and sizes[0].tolist() == [1024, 1536, 0, 256, 1024, 1024]
    ours = adapter_for("SDXL").first_stage_inputs(Batch(noisy, torch.zeros(2), cond, pooled, extras={"size_crop": sizes}))[3]
    for i, c in enumerate(crops):
        node_inputs = {"width": c.source_width, "height": c.source_height, "crop_w": c.crop_left, "crop_h": c.crop_top,
                       "target_width": c.width, "target_height": c.height}  # CLIPTextEncodeSDXL's add_dict
        conds = [{"cross_attn": cond[i:i + 1], "pooled_output": pooled[i:i + 1], "model_conds": {}, **node_inputs}]
        y = comfy.samplers.encode_model_conds(model.extra_conds, conds, noisy[i:i + 1], "cpu", "positive")[0]
        assert torch.equal(ours[i:i + 1], y["model_conds"]["y"].cond), i


def _sdxl_encoders(vae, clip):
    """The tiny fixture VAE and CLIP, with the cache extras the family of ComfyUI's SDXL text encoder asks for
    (an ``SDXLClipModel`` instance stands for the 0.8 B CLIP-L + CLIP-G; the choice itself is the real one)."""
    import types

    import comfy.sdxl_clip
    from pipetrainer.training.cache.encoders import ComfyEncoders
    from pipetrainer.training.cache.prep_extras import cache_extras

    encoders = ComfyEncoders(vae, clip)
    encoders.prep_extras = cache_extras(types.SimpleNamespace(
        cond_stage_model=object.__new__(comfy.sdxl_clip.SDXLClipModel)))
    return encoders


def test_the_cache_writes_size_crop_for_sdxl_encoders_only_and_re_encodes_old_entries(encoders, tmp_path):
    import numpy as np
    from PIL import Image
    from pipetrainer.training.cache.encoders import ComfyEncoders
    from pipetrainer.training.cache.prep_extras import cache_extras
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.cache.store import fill_cache
    from pipetrainer.training.data.dataset import BucketSettings, scan_dataset
    from pipetrainer.training.data.micro_batches import load_examples

    vae, clip = encoders
    assert cache_extras(clip) == {}  # a CLIP-L (SD3/Flux) cache: no family asks, its keys stay as they were
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, (w, h) in {"wide": (300, 200), "tall": (100, 250)}.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(f"a {name} picture")
    dataset = scan_dataset(data, 64, buckets=BucketSettings((64,), min_ratio=0.5, max_ratio=2.0, count=3))
    cache = tmp_path / "cache"

    plain_encoders, sdxl_encoders = ComfyEncoders(vae, clip), _sdxl_encoders(vae, clip)  # identities computed once
    plain = fill_cache(dataset, plain_encoders, cache)
    assert plain.report.cached["latent"] == 2
    sdxl = fill_cache(dataset, sdxl_encoders, cache)
    assert sdxl.report.reencoded_kinds["latent"] == 2 and sdxl.report.reused["text"] == 2
    assert all(r.endswith('latent: preprocessing changed (extras None -> {"size_crop": 1})')
               for r in sdxl.report.reencoded), sdxl.report.reencoded
    by_name = {item.source.rsplit("/", 1)[-1]: item for item in sdxl.items}
    stored = read_entries(str(sdxl.items[0].latent_file), [i.latent_key for i in sdxl.items])
    # 300x200 -> bucket 96x48 (cover 96x64, 8 px off the top); 100x250 -> 48x96 (cover 48x120, 12 px off the top)
    assert stored[by_name["wide.png"].latent_key]["size_crop"].tolist() == [200, 300, 8, 0, 48, 96]
    assert stored[by_name["tall.png"].latent_key]["size_crop"].tolist() == [250, 100, 12, 0, 96, 48]
    assert stored[by_name["wide.png"].latent_key]["size_crop"].dtype == torch.int64

    again = fill_cache(dataset, sdxl_encoders, cache)
    assert again.report.reused["latent"] == 2 and not again.report.reencoded
    examples = load_examples(again.items)
    assert all(e.extras["size_crop"].shape == (6,) for e in examples)
    back = fill_cache(dataset, plain_encoders, cache)  # the plain entries are still there
    assert back.report.reused["latent"] == 2 and {i.latent_key for i in back.items} == {i.latent_key for i in plain.items}
