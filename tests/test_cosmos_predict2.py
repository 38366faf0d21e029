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
