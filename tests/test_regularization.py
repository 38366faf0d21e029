"""Regularization images (training/data/regularization.py, nodes/regularization.py).

Oracles: counts of regularization micro-batches (told apart by their latent shape, which only the
regularization examples have) against ``floor(N * ratio)`` computed here; every mixed micro-batch against
the two streams built on their own (fresh objects, so no state is shared); the loss of a regularization
micro-batch against ``weight x`` the unscaled one; a pinned training hash written before the option
existed; and, in the slow test, the first step's loss of real 1- and 2-stage runs against ComfyUI's own
``apply_model`` on the two micro-batches the rule picks.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from pipetrainer.training.data.regularization import (
    MixedMicroBatches,
    exact_ratio,
    is_regularization,
    regularization_before,
    regularization_seed,
)
from pipetrainer.training.objective.loss import mse_loss
from pipetrainer.training.spec.choices import SpecError
from pipetrainer.training.spec.options import (
    CacheItem,
    LoraSpec,
    ModelRecipe,
    OptimizerSpec,
    RegularizationSpec,
    TimestepSpec,
    TrainSpec,
)
from pipetrainer.training.spec.run_spec import RunSpec

TRAIN_SHAPE, REG_SHAPE = (16, 8, 8), (16, 8, 12)


@pytest.mark.parametrize("ratio", [0.5, 0.3, 0.29, 0.25, 1 / 3, 0.01, 0.99])
def test_any_n_micro_batches_hold_floor_n_ratio_regularization_ones(ratio):
    r = exact_ratio(ratio)
    flags = [is_regularization(i, r) for i in range(1000)]
    assert sum(flags[:200]) == math.floor(200 * round(ratio, 6) + 1e-9)
    for start in (0, 1, 17, 333):
        for n in (1, 7, 100):
            count = sum(flags[start:start + n])
            assert math.floor(n * ratio - 1e-9) <= count <= math.ceil(n * ratio + 1e-9)
    assert all(regularization_before(i, r) == sum(flags[:i]) for i in range(0, 1000, 37))


def _examples(shape, n: int, seed: int, text: bool = True):
    from pipetrainer.training.data.micro_batches import Example

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        # Few tokens: the streams never run the model, and the test stays fast.
        latent, cond, pooled = torch.randn(shape, generator=g), torch.randn(4, 768, generator=g), torch.randn(768, generator=g)
        out.append(Example(latent, cond if text else None, pooled if text else None))
    return out


@pytest.fixture(scope="module")
def sd3(fixture_paths):
    import comfy.sd
    from pipetrainer.training.pipelines.base import adapter_for

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model, adapter_for("SD3")


def _streams(sd3, *, ratio=0.3, weight=0.5, replica=0, replicas=1, text=True, seed=5):
    """A fresh mixed stream and fresh copies of its two streams (no state shared with it)."""
    from pipetrainer.training.data.micro_batches import MicroBatches

    model, adapter = sd3

    def stream(shape, n, stream_seed):
        return MicroBatches(_examples(shape, n, n, text), 2, stream_seed, model, adapter, TimestepSpec(),
                            torch.device("cpu"), replica=replica, replicas=replicas,
                            family_options=adapter.options_type())

    mixed = MixedMicroBatches(stream(TRAIN_SHAPE, 5, seed), stream(REG_SHAPE, 3, regularization_seed(seed)),
                              ratio, weight)
    return mixed, stream(TRAIN_SHAPE, 5, seed), stream(REG_SHAPE, 3, regularization_seed(seed))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("replicas", [1, 2])
def test_regularization_micro_batches_come_at_the_ratio_from_their_own_stream(sd3, replicas):
    ratio, weight, n = 0.3, 0.5, 120
    seen = []
    for replica in range(replicas):
        mixed, train, reg = _streams(sd3, ratio=ratio, weight=weight, replica=replica, replicas=replicas)
        built = [mixed.build(i) for i in range(n)]
        is_reg = [tuple(labels[0].shape[1:]) == REG_SHAPE for _, labels in built]
        assert sum(is_reg) == 36  # floor(120 * 0.3), on every replica
        t = r = 0
        for (inputs, labels), reg_one in zip(built, is_reg, strict=True):
            if reg_one:  # the regularization stream's next micro-batch, its loss scaled by weight
                own_inputs, own_target = reg.build(r)
                assert _same(inputs, own_inputs) and torch.equal(labels[0], own_target)
                assert torch.equal(labels[2], torch.full((2,), weight))
                r += 1
            else:  # the training stream's next one, untouched
                assert _same((inputs, labels), train.build(t))
                t += 1
        seen.append(built)
        again, _, _ = _streams(sd3, ratio=ratio, weight=weight, replica=replica, replicas=replicas)
        resumed = again.iterate(97)  # a resumed run starts mid-stream on a fresh object: the same batches
        assert all(_same(next(resumed), built[i]) for i in range(97, 107))
    if replicas == 2:  # the same kinds at the same index, but each replica its own items and noise
        assert all(tuple(a[1][0].shape) == tuple(b[1][0].shape) for a, b in zip(*seen, strict=True))
        assert not torch.equal(seen[0][0][1], seen[1][0][1])


def test_the_last_pipeline_stage_builds_the_same_targets_without_text(sd3):
    first, _, _ = _streams(sd3)
    last, _, _ = _streams(sd3, text=False)
    for i in range(20):
        (inputs, a), (none, b) = first.build(i), last.build(i)
        assert inputs and none == () and _same(a, b)


def test_a_regularization_micro_batch_loss_is_weight_times_its_own_and_weight_zero_gives_no_gradient(sd3):
    micro = next(i for i in range(10) if is_regularization(i, exact_ratio(0.3)))
    for weight in (0.0, 0.25, 3.0):
        mixed, _, reg = _streams(sd3, weight=weight)
        _, labels = mixed.build(micro)
        _, own = reg.build(0)
        prediction = torch.randn(own.shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = mse_loss(prediction, labels)
        assert float(loss.detach()) == pytest.approx(weight * float(mse_loss(prediction.detach(), own)), rel=1e-6, abs=0)
        loss.backward()
        assert (prediction.grad.abs().max() == 0) == (weight == 0)


# ---- spec, hash, resume ------------------------------------------------------------------------------
def _spec(**changes) -> RunSpec:
    return RunSpec(model=ModelRecipe("diffusion_model", "/m/model.safetensors", "default", "abc123"),
                   items=(CacheItem("/c/index", "/c/index", "/d/0.png", "a cat", "lat0", "txt0"),),
                   lora=LoraSpec(rank=4, alpha=4.0), optimizer=OptimizerSpec(lr=1e-3),
                   train=TrainSpec(steps=5, seed=3), run_dir="/runs/r", lora_output="/l/x.safetensors",
                   comfyui_path="/c", **changes)


REG_ITEMS = (CacheItem("/r/index", "/r/index", "/r/0.png", "a dog", "rlat0", "rtxt0"),)


def test_the_spec_round_trips_validates_and_hashes_only_when_on():
    off = _spec()
    assert off.training_hash() == "6b246b52870d6632"  # the hash of this spec before either option existed
    on = _spec(regularization=RegularizationSpec(items=REG_ITEMS, weight=0.5, ratio=0.25))
    assert RunSpec.from_json(on.to_json()) == on and RunSpec.from_json(off.to_json()) == off
    hashes = {on.training_hash(), off.training_hash(),
              dataclasses.replace(on, regularization=dataclasses.replace(on.regularization, weight=1.0)).training_hash(),
              dataclasses.replace(on, regularization=dataclasses.replace(on.regularization, ratio=0.5)).training_hash(),
              dataclasses.replace(off, train=dataclasses.replace(off.train, timesteps=TimestepSpec(
                  loss_weighting="cosmap"))).training_hash()}
    assert len(hashes) == 5
    assert RegularizationSpec(ratio=5.0).problems() == []  # off: nothing to check
    problems = _spec(regularization=RegularizationSpec(items=REG_ITEMS, weight=-1.0, ratio=1.0)).problems()
    assert any("ratio" in p for p in problems) and any("weight" in p for p in problems)


def test_resuming_with_regularization_added_or_changed_warns_and_is_not_refused():
    import json

    from pipetrainer.training.loop.resume import hash_changes

    off = json.loads(_spec().to_json())
    del off["regularization"]  # a spec.json written before the option
    on = _spec(regularization=RegularizationSpec(items=REG_ITEMS))
    changes = hash_changes(off, on)
    assert changes and all(why == "" for _, _, why in changes), changes
    heavier = dataclasses.replace(on, regularization=dataclasses.replace(on.regularization, weight=2.0))
    assert [(name, why) for name, _, why in hash_changes(json.loads(on.to_json()), heavier)] == [
        ("regularization.weight", "")]


# ---- nodes --------------------------------------------------------------------------------------------
def test_the_node_records_the_choice_and_refuses_an_empty_cache(comfy_root):
    from pipetrainer.nodes.extension import NODES
    from pipetrainer.nodes.regularization import PipeTrainerRegularization

    assert PipeTrainerRegularization in NODES
    choice = PipeTrainerRegularization.execute(SimpleNamespace(items=REG_ITEMS), 0.5, 0.25).result[0]
    assert choice.spec() == RegularizationSpec(items=REG_ITEMS, weight=0.5, ratio=0.25)
    empty = PipeTrainerRegularization.execute(SimpleNamespace(items=()), 1.0, 0.5).result[0]
    with pytest.raises(SpecError, match="regularization cache has no items"):
        empty.spec()


def test_the_train_node_carries_the_regularization_cache_and_checks_it_against_the_model(
        fixture_paths, demo_cache, tmp_path):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel
    from pipetrainer.nodes.regularization import RegularizationChoice
    from pipetrainer.nodes.train import PipeTrainerTrain
    from safetensors.torch import save_file

    model = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]
    settings = dict(steps=10, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
                    gradient_checkpointing=True, pipeline_stages=1, partition_method="parameters")

    def build(reg_cache):
        return PipeTrainerTrain.build_spec(model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                           "reg_test", regularization=RegularizationChoice(reg_cache, 0.5, 0.25),
                                           **settings)

    reg_items = demo_cache.items[:2]
    spec = build(dataclasses.replace(demo_cache, items=reg_items))
    assert spec.regularization == RegularizationSpec(items=tuple(reg_items), weight=0.5, ratio=0.25)
    assert spec.items == demo_cache.items
    lat, txt = tmp_path / "sd15.latent.safetensors", tmp_path / "sd15.text.safetensors"
    save_file({"latent": torch.zeros(4, 8, 8)}, str(lat))  # an SD1.5 VAE's latent: 4 channels
    save_file({"cond": torch.zeros(77, 768), "pooled": torch.zeros(768)}, str(txt))
    wrong = dataclasses.replace(demo_cache, items=(CacheItem(str(lat), str(txt), str(tmp_path / "x.png"), "x"),))
    with pytest.raises(SpecError) as info:
        build(wrong)
    assert "Regularization cache:" in str(info.value) and "channel" in str(info.value)


# ---- a real run ---------------------------------------------------------------------------------------
def _oracle_first_step(fixture_paths, spec: RunSpec) -> float:
    """Step 1 (gradient accumulation 2, ratio 0.5: micro-batch 0 training, 1 regularization) of the base
    model, from ComfyUI's own ``apply_model``: the flow output recovered from its denoised result."""
    import comfy.sd
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.pipelines.base import adapter_for

    patcher = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit), model_options={"dtype": torch.float32})
    model, adapter = patcher.model, adapter_for("SD3")
    assert not is_regularization(0, exact_ratio(0.5)) and is_regularization(1, exact_ratio(0.5))
    losses = []
    for items, seed, scale in ((spec.items, 0, 1.0), (spec.regularization.items, regularization_seed(0),
                                                      spec.regularization.weight)):
        stream = MicroBatches(load_examples(items, text_dtype=torch.float32), 1, seed, model, adapter,
                              spec.train.timesteps, torch.device("cpu"), family_options=adapter.options_type())
        (noisy, timestep, cond, pooled), target = stream.build(0)
        sigma = timestep / float(model.model_sampling.multiplier)
        with torch.no_grad():
            denoised = model.apply_model(noisy, sigma, c_crossattn=cond, y=pooled)
        flow = (noisy - denoised) / sigma.view(-1, 1, 1, 1)
        losses.append(scale * float(((flow - target) ** 2).mean()))
    return sum(losses) / 2


@pytest.mark.slow
def test_a_real_run_mixes_them_in_alike_on_one_and_two_stages(fixture_paths, comfy_root, demo_cache, tmp_path):
    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.training.process.rank import EXIT_OK

    reg = RegularizationSpec(items=tuple(demo_cache.items[-2:]), weight=0.5, ratio=0.5)
    runs = []
    for stages in (1, 2):
        spec = make_spec(fixture_paths.mmdit, demo_cache.items[:-2], tmp_path / f"run{stages}", comfy_root,
                         steps=3, grad_accum=2, pipeline_stages=stages, gradient_checkpointing=False)
        spec = dataclasses.replace(spec, regularization=reg).validated()
        code, events = run_training(spec)
        assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
        runs.append(losses(events))
    assert len(runs[0]) == 3 and runs[0] == runs[1]
    assert runs[0][0] == pytest.approx(_oracle_first_step(fixture_paths, spec), rel=1e-4)
