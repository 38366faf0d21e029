"""Cosmos Predict2's rectified-flow sampling in the shared objective (training/objective): the target ComfyUI
denoises back to x0, the default sigmas from the model's own table, and the flow-only settings refused.

Oracles are ComfyUI's own ``ModelSamplingCosmosRFlow`` + ``COSMOS_RFLOW`` objects, built as
``BaseModel.__init__`` builds them. Skips on a ComfyUI without Cosmos Predict2 (0.3.75), naming it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cosmos_sampling(comfy_root):
    import comfy.model_base
    import comfy.supported_models

    if not hasattr(comfy.model_base.ModelType, "FLOW_COSMOS"):
        pytest.skip("this ComfyUI has no ModelType.FLOW_COSMOS (Cosmos Predict2)")
    config = comfy.supported_models.CosmosT2IPredict2({"image_model": "cosmos_predict2", "in_channels": 16})
    return comfy.model_base.model_sampling(config, comfy.model_base.ModelType.FLOW_COSMOS)


def test_the_rflow_target_denoises_to_x0_through_comfyuis_sampling(cosmos_sampling):
    from pipetrainer.training.objective.loss import noisy_input_and_target, prediction_type

    ms = cosmos_sampling
    assert prediction_type(ms) == "rflow"
    g = torch.Generator().manual_seed(2)
    sigma = torch.tensor([0.002, 0.5, 3.0, 80.0])
    x0, noise = torch.randn(4, 16, 1, 6, 6, generator=g), torch.randn(4, 16, 1, 6, 6, generator=g)
    network_input, timestep, target = noisy_input_and_target(ms, x0, noise, sigma)
    s = sigma.view(-1, 1, 1, 1, 1)
    noisy = ms.noise_scaling(s, noise, x0)
    assert torch.allclose(noisy, x0 + s * noise)  # EDM sigmas, not flow noise shares
    assert torch.allclose(network_input, ms.calculate_input(s, noisy), atol=1e-6)
    assert torch.equal(timestep, ms.timestep(sigma).float())
    assert torch.allclose(ms.calculate_denoised(s, target, noisy), x0, atol=1e-4)


def test_default_sigmas_walk_the_models_own_table_and_not_its_timestep(cosmos_sampling):
    """The table ComfyUI's schedulers walk is log-spaced 0.002..80; uniform in the rflow timestep would put half
    the draws above sigma 40 (timestep 0.49 of 0.988), where the table has under 10 % of its entries."""
    from pipetrainer.training.objective.timesteps import sample_sigmas
    from pipetrainer.training.spec.options import TimestepSpec

    ms = cosmos_sampling
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    drawn = sample_sigmas(40_000, TimestepSpec(), torch.Generator().manual_seed(0), ms)
    assert torch.allclose(torch.quantile(drawn.double().log(), q), torch.quantile(ms.sigmas.double().log(), q),
                          atol=0.05)
    assert float(drawn.min()) >= float(ms.sigma_min) * 0.999 and float(drawn.max()) <= float(ms.sigma_max) * 1.001


def test_flow_only_timestep_settings_are_refused(cosmos_sampling):
    from pipetrainer.training.pipelines.checks import timestep_problems
    from pipetrainer.training.spec.options import TimestepSpec

    assert timestep_problems(TimestepSpec(), "rflow", "CosmosPredict2", (0.002, 80.0)) == []
    problems = timestep_problems(TimestepSpec(shift="none", loss_weighting="cosmap"), "rflow", "CosmosPredict2",
                                 (0.002, 80.0))
    assert len(problems) == 2 and all("rectified-flow" in p for p in problems)


def test_odd_latent_sides_are_refused_with_the_fix(comfy_root):
    """ComfyUI 0.3.75's model asserts even latent sides (current ComfyUI pads them): preflight refuses odd ones on
    every ComfyUI, naming the resolution to choose."""
    from pipetrainer.training.pipelines.base import Geometry
    from pipetrainer.training.pipelines.checks import CachedShapes, ModelInputs, cache_vs_model_problems

    inputs = ModelInputs("CosmosPredict2", 16, Geometry(patch=(1, 2, 2), video=True, frame_step=4), 1024, 0)
    shapes = CachedShapes(latents={"a": (16, 17, 13), "b": (16, 16, 12)}, conds={"a": (5, 1024), "b": (5, 1024)},
                          pooled={"a": 0, "b": 0}, unreadable=())
    (problem,) = cache_vs_model_problems(shapes, inputs)
    assert "17x13" in problem and "16x12" not in problem and "divisible by 2" in problem and "16 px" in problem


# ---- Anima's data path: the T5 token ids and weights from the cache to the LLM adapter ------------------------
CAPTIONS = {"short": "red fox", "long": "a small red fox sitting in deep snow at dawn"}


class _AnimaLikeEncoders:
    """Stands in for ComfyUI's VAE and Anima text encoder: a seeded latent per image; per caption ``N`` Qwen
    states with the unpadded mask ``[1, N]``, and ``N + 1`` T5 ids ending in the end token 1 with their weights,
    unbatched, as ComfyUI's Anima encoder puts them into the conditioning; through the cache's own
    ``_text_tensors``."""

    def latent_identity(self) -> str:
        return "stub-vae"

    def text_identity(self) -> str:
        return "stub-anima-text"

    def encode_latent(self, pixels: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(pixels.sum() * 1000) % 2**31)
        return torch.randn(16, pixels.shape[1] // 8, pixels.shape[2] // 8, generator=g)

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        from pipetrainer.training.cache.encoders import _text_tensors

        n = len(caption.split())
        g = torch.Generator().manual_seed(n)
        extras = {"attention_mask": torch.ones(1, n, dtype=torch.int64),
                  "t5xxl_ids": torch.cat([torch.randint(2, 32128, (n,), generator=g), torch.ones(1)]).to(torch.int),
                  "t5xxl_weights": 1.0 + 0.1 * torch.arange(n + 1, dtype=torch.float32)}
        return _text_tensors(torch.randn(1, n, 24, generator=g), extras)


@pytest.fixture
def anima_cache(tmp_path):
    from PIL import Image
    from pipetrainer.training.cache.store import fill_cache
    from pipetrainer.training.data.dataset import scan_dataset

    data = tmp_path / "data"
    data.mkdir()
    for i, (name, caption) in enumerate(CAPTIONS.items()):
        Image.new("RGB", (64, 64), (90 * i, 120, 200)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(caption)
    return fill_cache(scan_dataset(data, 64), _AnimaLikeEncoders(), tmp_path / "cache")


def test_the_cache_keeps_the_t5_ids_and_weights_through_write_and_read(anima_cache):
    from pipetrainer.training.data.micro_batches import load_examples

    encoders = _AnimaLikeEncoders()
    examples = load_examples(anima_cache.items)
    assert len(examples) == 2
    by_length = {int(e.extras["attention_mask"].sum()): e for e in examples}
    for caption in CAPTIONS.values():
        want = encoders.encode_text(caption)
        got = by_length[len(caption.split())].extras
        assert got.keys() >= {"t5xxl_ids", "t5xxl_weights", "attention_mask"}
        for name in ("t5xxl_ids", "t5xxl_weights", "attention_mask"):
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_a_micro_batch_pads_t5_ids_of_two_lengths_and_the_adapter_reads_each_true_length(anima_cache, comfy_root):
    """Two captions of different T5 lengths share a micro-batch: ids, weights, cond and mask are zero-padded to
    the longest, and Anima's embed adapts each prompt at its own lengths, as ComfyUI runs each prompt alone."""
    from pipetrainer.tests.family_rows.cosmos_predict2 import anima_small
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.pipelines.anima import AnimaEmbed
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import TimestepSpec

    model = anima_small().model  # skips on a ComfyUI without comfy.model_base.Anima, naming it
    adapter = adapter_for("Anima")
    examples = load_examples(anima_cache.items)
    inputs, _ = MicroBatches(examples, 2, 3, model, adapter, TimestepSpec(), torch.device("cpu")).build(0)
    _, _, cond, mask, ids, weights = inputs
    lengths = [int(m.sum()) for m in mask]
    assert sorted(lengths) == sorted(len(c.split()) for c in CAPTIONS.values())
    assert ids.shape == weights.shape == (2, max(lengths) + 1) and cond.shape[1] == mask.shape[1] == max(lengths)
    for i, n in enumerate(lengths):
        assert ids[i, n] == 1 and (ids[i, :n] > 1).all() and not ids[i, n + 1:].any()  # end token, zeros after
        assert not weights[i, n + 1:].any() and (weights[i, :n + 1] >= 1).all()
        assert not cond[i, n:].any() and not mask[i, n:].any()
    embed = AnimaEmbed(model.diffusion_model)
    context = embed.text_context(inputs)
    dm = model.diffusion_model
    for i, n in enumerate(lengths):
        alone = dm.preprocess_text_embeds(cond[i:i + 1, :n], ids[i:i + 1, :n + 1],
                                          t5xxl_weights=weights[i:i + 1, :n + 1, None])
        assert torch.equal(context[i:i + 1, :alone.shape[1]], alone) and not context[i, alone.shape[1]:].any()
    # reading the padded ids instead would change the shorter prompt's context (the check above can fail)
    short = lengths.index(min(lengths))
    padded = dm.preprocess_text_embeds(cond[short:short + 1], ids[short:short + 1],
                                       t5xxl_weights=weights[short:short + 1, :, None])
    assert not torch.equal(padded, context[short:short + 1, :padded.shape[1]])


# ---- Video2World / image-to-video: first_frame_clean against ComfyUI's CosmosPredict2ImageToVideoLatent --------
def _staged(model, batch):
    from pipetrainer.training.pipelines.base import adapter_for

    adapter = adapter_for("CosmosPredict2")
    out = adapter.first_stage_inputs(batch)
    for layer in adapter.stage_layers(model.diffusion_model):
        out = layer(out)
    return out


def _i2v_node(start=None, length=9, height=48, width=32):
    """``CosmosPredict2ImageToVideoLatent``'s latent dict for a start image (or none), with a narrow Wan 2.1 VAE."""
    from comfy_extras.nodes_cosmos import CosmosPredict2ImageToVideoLatent
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae

    vae = tiny_wan21_vae()
    node = CosmosPredict2ImageToVideoLatent.execute(vae, width, height, length, 1, start_image=start)
    return vae, (node.result if hasattr(node, "result") else node)[0]


@pytest.fixture(params=["Video2World", "Text2Image"])
def cosmos_model(request, comfy_root):
    from pipetrainer.tests.family_rows.cosmos_predict2 import cosmos_predict2_small, cosmos_predict2_video_small

    return (cosmos_predict2_video_small if request.param == "Video2World" else cosmos_predict2_small)().model


def test_first_frame_clean_equals_comfyui_sampling_after_the_image_to_video_latent_node(cosmos_model):
    """The node's start latent and noise mask through ComfyUI's sampler (``KSamplerX0Inpaint`` with
    ``scale_latent_inpaint``, ``extra_conds``' mask channel, ``process_timestep``) give the trainer's output; the
    trainer's clean frame is the first latent frame of the clip the cache encodes (causal Wan 2.1 VAE)."""
    from pipetrainer.tests.family_rows.cosmos_predict2 import COSMOS_CONTEXT, cosmos_conds
    from pipetrainer.training.cache.encoders import latent_layout
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.base import Batch, adapter_for
    from pipetrainer.training.pipelines.cosmos_predict2 import CosmosPredict2Options

    model = cosmos_model
    g = torch.Generator().manual_seed(8)
    clip = torch.rand(9, 48, 32, 3, generator=g)  # the training clip; its first frame is the start image
    vae, node = _i2v_node(clip[:1])
    frame_mask = node["noise_mask"][0, 0].flatten(1)
    assert node["samples"].shape == (1, 16, 3, 6, 4) and frame_mask.amin(1).tolist() == [0.0, 1.0, 1.0]
    assert torch.equal(frame_mask.amax(1), frame_mask.amin(1))  # one value per latent frame
    latent_image = model.process_latent_in(node["samples"].float())
    x0 = model.process_latent_in(latent_layout(vae.encode(clip), 9)[None].float())  # as the cache encodes the clip
    assert torch.allclose(x0[:, :, :1], latent_image[:, :, :1], rtol=0, atol=1e-5 * x0.abs().max().item())
    assert (x0[:, :, 1:] - latent_image[:, :, 1:]).abs().max() > 0.1  # the node's later frames are not the clip's

    noise = torch.randn(x0.shape, generator=g)
    cond = torch.randn(1, 5, COSMOS_CONTEXT, generator=g)
    sigma = torch.tensor([1.5])
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    options = CosmosPredict2Options(first_frame_clean=True)
    with torch.no_grad():
        ours = _staged(model, Batch(noised.network_input, noised.timestep, cond, options=options, clean=x0))
        plain = _staged(model, Batch(noised.network_input, noised.timestep, cond))
    # ComfyUI: the sampler's latent is the noised clip; KSamplerX0Inpaint puts the node's start latent where the
    # mask is 0 (its other frames are zeros after process_latent_in and never reach the model).
    conds = cosmos_conds(model, noise, latent_image, node["noise_mask"])
    mask = conds["denoise_mask"]
    x = model.model_sampling.noise_scaling(sigma, noise, x0)
    x = x * mask + model.scale_latent_inpaint(sigma=sigma, noise=noise, latent_image=latent_image) * (1 - mask)
    with torch.no_grad():
        theirs = model.apply_model(x, sigma, c_crossattn=cond, **conds)
    ours_denoised = model.model_sampling.calculate_denoised(sigma, ours.float(), x)
    assert torch.allclose(ours_denoised, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    assert (ours - plain)[:, :, 1:].abs().max() > 1e-3  # the clean frame and its timestep reach later frames

    # the network input itself: the mask channel and the per-frame timestep ComfyUI builds
    from pipetrainer.training.pipelines.cosmos_predict2 import frame_conditioning, mask_channels

    inputs = adapter_for("CosmosPredict2").first_stage_inputs(
        Batch(noised.network_input, noised.timestep, cond, options=options, clean=x0))
    x_in, t_in = frame_conditioning(inputs[0], inputs[1], inputs[3], mask_channels(model.diffusion_model))
    want = model.model_sampling.calculate_input(sigma, x)
    if "c_concat" in conds:
        want = torch.cat([want, conds["c_concat"]], dim=1)
    assert x_in.shape == want.shape and torch.allclose(x_in, want, rtol=0, atol=1e-6 * want.abs().max().item())
    timestep = model.model_sampling.timestep(sigma).float()
    assert torch.equal(t_in, model.process_timestep(timestep, x=x, denoise_mask=mask)) and t_in[0, 0] == 0


def test_without_a_start_image_the_node_gives_text_to_video_and_so_does_the_trainer(comfy_root):
    """No start image: no noise mask, so ``extra_conds`` gives a zero mask channel and one timestep per example."""
    from pipetrainer.tests.family_rows.cosmos_predict2 import COSMOS_CONTEXT, cosmos_conds, cosmos_predict2_video_small
    from pipetrainer.training.pipelines.base import Batch, adapter_for
    from pipetrainer.training.pipelines.cosmos_predict2 import frame_conditioning

    model = cosmos_predict2_video_small().model
    _, node = _i2v_node()
    assert set(node) == {"samples"}
    noise = torch.randn(node["samples"].shape, generator=torch.Generator().manual_seed(9))
    conds = cosmos_conds(model, noise)
    assert set(conds) == {"c_concat"}
    inputs = adapter_for("CosmosPredict2").first_stage_inputs(
        Batch(noise, torch.full((1,), 0.4), torch.zeros(1, 3, COSMOS_CONTEXT)))
    x_in, t_in = frame_conditioning(inputs[0], inputs[1], inputs[3], 1)
    assert torch.equal(x_in, torch.cat([noise, conds["c_concat"]], dim=1)) and t_in.shape == (1,)


def test_a_one_frame_example_trains_text_to_video_and_the_loss_leaves_the_clean_frame_out(comfy_root):
    from pipetrainer.training.pipelines.base import Batch, adapter_for
    from pipetrainer.training.pipelines.cosmos_predict2 import CosmosPredict2Options

    adapter = adapter_for("CosmosPredict2")
    on, off = CosmosPredict2Options(first_frame_clean=True), CosmosPredict2Options()
    weight = adapter.loss_mask((16, 3, 8, 6), on)
    assert weight.shape == (1, 3, 1, 1) and weight.flatten().tolist() == [0.0, 1.0, 1.0]
    assert adapter.loss_mask((16, 1, 8, 6), on) is None and adapter.loss_mask((16, 3, 8, 6), off) is None
    image = torch.randn(1, 16, 1, 8, 6)
    x, _, _, clean = adapter.first_stage_inputs(Batch(image, torch.ones(1), torch.zeros(1, 2, 24), options=on,
                                                      clean=torch.zeros_like(image)))
    assert torch.equal(x, image) and not clean.any()
    with pytest.raises(ValueError, match="needs the clean latent"):
        adapter.first_stage_inputs(Batch(torch.zeros(1, 16, 3, 8, 6), torch.ones(1), torch.zeros(1, 2, 24),
                                         options=on))


def test_options_metadata_and_anima_takes_no_first_frame_clean(comfy_root):
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.cosmos_predict2 import CosmosPredict2Options
    from pipetrainer.training.pipelines.options import parse_family_options

    adapter = adapter_for("CosmosPredict2")
    options, problems = parse_family_options("CosmosPredict2", adapter.options_type, {"first_frame_clean": True})
    assert options == CosmosPredict2Options(first_frame_clean=True) and problems == []
    assert adapter.run_metadata(None, options) == {"cosmos_predict2.first_frame_clean": "true"}
    assert adapter.run_metadata(None, CosmosPredict2Options()) == {}
    anima = adapter_for("Anima")
    (problem,) = parse_family_options("Anima", anima.options_type, {"first_frame_clean": True})[1]
    assert "no option 'first_frame_clean'" in problem


@pytest.mark.parametrize(("in_channels", "refused"), [(16, False), (17, False), (18, True), (15, True)])
def test_input_layouts_comfyuis_class_cannot_feed_are_refused_by_name(in_channels, refused, comfy_root):
    import comfy.ops
    from pipetrainer.tests.family_rows.common import require_model_class
    from pipetrainer.training.pipelines.base import adapter_for

    require_model_class("CosmosPredict2")
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT
    from pipetrainer.tests.family_rows.cosmos_predict2 import _unet

    unet = {k: v for k, v in _unet("cosmos_predict2", 24).items() if k != "image_model"}
    dm = MiniTrainDIT(**{**unet, "in_channels": in_channels}, device="meta", operations=comfy.ops.disable_weight_init)
    problems = adapter_for("CosmosPredict2").support_problems(dm)
    if not refused:
        assert problems == []
        return
    assert len(problems) == 1 and f"takes {in_channels} input channels for 16 latent channels" in problems[0]
    with pytest.raises(NotImplementedError, match=f"takes {in_channels} input channels"):
        adapter_for("CosmosPredict2").stage_layers(dm)


def test_a_micro_batch_with_first_frame_clean_gives_the_cached_first_frame_and_leaves_it_out_of_the_loss(
        comfy_root, tmp_path):
    """The trainer's own path from cached clips: first-stage inputs with each clip's processed first latent
    frame clean and flagged, and a loss weight that is 0 on that frame only."""
    from pipetrainer.tests.family_rows.common import cache_items
    from pipetrainer.tests.family_rows.cosmos_predict2 import ROWS, cosmos_predict2_video_small
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.cosmos_predict2 import CosmosPredict2Options
    from pipetrainer.training.spec.options import TimestepSpec

    row = next(r for r in ROWS if r.name == "CosmosPredict2Video2World")
    model = cosmos_predict2_video_small().model
    examples = load_examples(cache_items(row, model, tmp_path / "cache"))
    batches = MicroBatches(examples, 2, 3, model, adapter_for("CosmosPredict2"), TimestepSpec(), torch.device("cpu"),
                           family_options=CosmosPredict2Options(first_frame_clean=True))
    (x, timestep, _, clean), (target, weight) = batches.build(0)
    assert clean.tolist() == [[1, 0, 0], [1, 0, 0]] and timestep.shape == (2,)
    firsts = {tuple(model.process_latent_in(e.latent[None].float())[0, :, 0].flatten().tolist()) for e in examples}
    assert {tuple(x[i, :, 0].flatten().tolist()) for i in range(2)} == firsts
    assert weight.shape == (1, 1, 3, 1, 1) and weight.flatten().tolist() == [0.0, 1.0, 1.0]
    assert target.shape == x.shape
