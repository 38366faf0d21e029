"""Loss weighting by sigma (training/objective/loss_weighting.py): SD3's ``cosmap`` and ``sigma_sqrt``.

Oracles: ``cosmap`` is the density of SD3's cosine-map timesteps ``t = 1 - 1/(tan(pi u/2) + 1)`` for
uniform ``u``, estimated here by a histogram of that map (no formula of the trainer involved);
``sigma_sqrt`` is ``1/s^2`` in float64; the weighted loss of a real micro-batch equals the mean of each
item's plain MSE times the weight of the sigma the network was given (read back from its timestep
input); ``none`` leaves the labels and the loss exactly as they were.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pipetrainer.training.objective.loss import mse_loss
from pipetrainer.training.objective.loss_weighting import item_scales, scale_labels, sigma_weights
from pipetrainer.training.spec.choices import LOSS_WEIGHTINGS
from pipetrainer.training.spec.options import TimestepSpec


def test_cosmap_is_the_density_of_sd3s_cosine_map_timesteps():
    u = torch.rand(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = 1 - 1 / (torch.tan(math.pi * u / 2) + 1)
    bins = 40
    density = torch.histc(t, bins=bins, min=0.0, max=1.0) / (t.numel() / bins)
    fine = torch.linspace(0, 1, bins * 50 + 1, dtype=torch.float64)  # the weight's mean over each bin
    weight = sigma_weights("cosmap", fine[:-1] + 0.5 / (bins * 50)).double().view(bins, 50).mean(1)
    assert torch.allclose(density, weight, rtol=0.02), (density - weight).abs().max()
    assert float(weight.mean()) == pytest.approx(1.0, abs=1e-3)  # a density on [0, 1]: mean weight 1


def test_sigma_sqrt_is_one_over_sigma_squared_and_none_is_one():
    s = torch.tensor([1e-4, 0.01, 0.3, 0.5, 0.999, 1.0])
    expected = torch.tensor([1.0 / (x * x) for x in s.double().tolist()], dtype=torch.float64)
    assert torch.allclose(sigma_weights("sigma_sqrt", s).double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(sigma_weights("none", s), torch.ones(6))
    with pytest.raises(ValueError, match="not one of"):
        sigma_weights("snr", s)


def test_scale_labels_follows_the_labels_contract():
    target = torch.randn(2, 3, 4)
    scale = torch.tensor([0.5, 2.0])
    t, w, s = scale_labels(target, scale)
    assert t is target and torch.equal(s, scale) and w.shape == (1, 1, 1) and float(w) == 1.0
    mask = torch.tensor([0.0, 1.0, 1.0]).view(1, 3, 1)
    _, w2, s2 = scale_labels((target, mask), scale)
    assert w2 is mask and torch.equal(s2, scale)
    _, _, s3 = scale_labels((target, mask, s2), torch.tensor(3.0))  # a scalar scale multiplies each item's
    assert torch.equal(s3, scale * 3)


@pytest.fixture(scope="module")
def sd3(fixture_paths):
    import comfy.sd
    from pipetrainer.training.pipelines.base import adapter_for

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model, adapter_for("SD3")


def _batches(sd3, weighting: str):
    from pipetrainer.training.data.micro_batches import Example, MicroBatches

    model, adapter = sd3
    g = torch.Generator().manual_seed(3)
    examples = [Example(torch.randn(16, 8, 8, generator=g), torch.randn(77, 768, generator=g),
                        torch.randn(768, generator=g)) for _ in range(5)]
    return MicroBatches(examples, 4, 11, model, adapter, TimestepSpec(loss_weighting=weighting),
                        torch.device("cpu"), family_options=adapter.options_type())


@pytest.mark.parametrize("weighting", ["cosmap", "sigma_sqrt"])
def test_a_weighted_micro_batch_scales_each_items_loss_by_its_sigmas_weight(sd3, weighting):
    model, _ = sd3
    plain, weighted = _batches(sd3, "none"), _batches(sd3, weighting)
    for micro in (0, 7):
        (inputs, labels), (w_inputs, w_labels) = plain.build(micro), weighted.build(micro)
        assert all(torch.equal(a, b) for a, b in zip(inputs, w_inputs, strict=True))  # same draws
        target, _, scale = w_labels
        assert torch.equal(target, labels)
        sigma = inputs[1].double() / float(model.model_sampling.multiplier)  # SD3: timestep = sigma * 1000
        own = 1 / sigma**2 if weighting == "sigma_sqrt" else 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
        assert torch.allclose(scale.double(), own, rtol=1e-5)
        prediction = torch.randn(labels.shape, generator=torch.Generator().manual_seed(micro))
        per_item = ((prediction.double() - labels.double()) ** 2).flatten(1).mean(1)
        assert float(mse_loss(prediction, w_labels)) == pytest.approx(float((own * per_item).mean()), rel=1e-5)


def test_none_leaves_labels_and_loss_exactly_as_before(sd3):
    batches = _batches(sd3, "none")
    assert batches.timesteps == TimestepSpec()  # the default
    for micro in range(3):
        inputs, labels = batches.build(micro)
        assert isinstance(labels, torch.Tensor)  # no (target, weight, scale): mse_loss's plain path
        prediction = torch.randn(labels.shape, generator=torch.Generator().manual_seed(micro))
        assert torch.equal(mse_loss(prediction, labels), F.mse_loss(prediction.float(), labels.float()))
    assert item_scales("none", torch.ones(2), None) is None


def test_eps_and_v_models_are_refused_with_the_fix():
    import comfy.model_sampling as ms
    from pipetrainer.training.pipelines.checks import timestep_problems

    for kind in ("eps", "v"):
        problems = timestep_problems(TimestepSpec(loss_weighting="cosmap"), kind, "SDXL", (0.03, 14.6))
        assert len(problems) == 1 and "loss_weighting to 'none'" in problems[0]
    assert timestep_problems(TimestepSpec(loss_weighting="cosmap"), "flow", "SD3", (0.0, 1.0)) == []
    eps = type("EpsSampling", (ms.ModelSamplingDiscrete, ms.EPS), {})()
    with pytest.raises(ValueError, match="set loss_weighting to none"):
        item_scales("sigma_sqrt", torch.tensor([0.5]), eps)


def test_the_option_is_validated_and_offered_by_the_timesteps_node(comfy_root):
    from pipetrainer.nodes.timesteps import PipeTrainerTimesteps

    assert TimestepSpec(loss_weighting="snr").problems()
    assert all(not TimestepSpec(loss_weighting=k).problems() for k in LOSS_WEIGHTINGS)
    out = PipeTrainerTimesteps.execute("uniform", "model", 3.0, 0.0, 1.0, 0.5, 1.15, 0.0, 1.0,
                                       loss_weighting="cosmap").result[0]
    assert out == TimestepSpec(loss_weighting="cosmap")
    schema = PipeTrainerTimesteps.define_schema()
    assert any(i.id == "loss_weighting" for i in schema.inputs)
