"""Validation loss: a held-out split at fixed sigmas and fixed noise (training/data/validation.py).

Oracles: the split by content (independent of order and repeats); the loss a real run reports equals
ComfyUI's own ``apply_model`` of the base model (step 0) and of the final LoRA applied by ComfyUI's LoRA
loader (last step), turned into the flow target's error through ``calculate_denoised`` — not through
the trainer's target code; and two runs (1 and 2 pipeline stages, same seed) report identical numbers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image
from pipetrainer.tests.helpers import make_spec, run_training
from pipetrainer.training.data.validation import distinct_items, evaluation_due, split_items, split_problems
from pipetrainer.training.process.rank import EXIT_OK
from pipetrainer.training.spec.options import CacheItem, ValidationSpec
from pipetrainer.training.spec.run_spec import RunSpec


def _items(n: int) -> list[CacheItem]:
    return [CacheItem("/c/index", "/c/index", f"/d/{i}.png", f"caption {i}", f"lat{i}", f"txt{i}") for i in range(n)]


def test_the_held_out_items_depend_on_content_not_on_order_or_repeats():
    items = _items(10)
    train, held = split_items(items, 0.2)
    assert len(held) == 2 and not set(held) & set(train) and len(train) == 8
    shuffled = list(reversed(items)) + items[:3]  # another order, three repeats
    train2, held2 = split_items(shuffled, 0.2)
    assert set(held2) == set(held)  # the same two examples
    assert len(held2) == 2  # repeats are evaluated once
    assert all(i not in held for i in train2) and len(train2) == 8 + sum(i not in held for i in items[:3])
    assert split_items(items, 0.0) == (tuple(items), ())
    assert distinct_items(items[:2] * 3) == tuple(items[:2])


def test_a_split_that_leaves_nothing_to_train_or_nothing_held_out_is_named():
    items = _items(3)
    assert "holds out every item" in split_problems(*split_items(items, 0.9), 0.9)[0]
    assert split_problems(*split_items(items, 0.3), 0.3) == []
    assert "holds out no item" in split_problems(tuple(items), (), 0.1)[0]
    assert ValidationSpec(every=5).problems()  # enabled without items


def test_evaluations_come_every_n_steps_and_at_the_end():
    assert [s for s in range(1, 11) if evaluation_due(s, 4, 10)] == [4, 8, 10]
    assert not any(evaluation_due(s, 0, 10) for s in range(1, 11))


def test_the_validation_set_survives_the_spec_file_and_leaves_the_training_hash_alone(fixture_paths, comfy_root,
                                                                                     tmp_path):
    spec = make_spec(fixture_paths.mmdit, _items(2), tmp_path / "run", comfy_root, steps=2)
    with_val = dataclasses.replace(spec, validation=ValidationSpec(items=tuple(_items(1)), every=3, sigmas=2))
    assert RunSpec.from_json(with_val.to_json()) == with_val
    assert with_val.training_hash() == spec.training_hash()


def test_the_curve_draws_the_validation_points_on_the_training_axis():
    from pipetrainer.nodes.run.loss_plot import VALIDATION_COLOUR, loss_curve

    plain = loss_curve([1.0, 0.8, 0.7], [1, 2, 3])
    with_val = loss_curve([1.0, 0.8, 0.7], [1, 2, 3], validation=[(0, 1.2), (3, 0.9)])
    colours = {c for _, c in with_val.getcolors(1 << 20)}
    assert VALIDATION_COLOUR in colours and VALIDATION_COLOUR not in {c for _, c in plain.getcolors(1 << 20)}
    assert isinstance(with_val, Image.Image)


def test_validation_noise_and_sigmas_ignore_the_run_seed_and_keep_its_sigma_range(fixture_paths, demo_cache):
    import comfy.sd
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.data.validation import ValidationBatches
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import TimestepSpec

    model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model
    adapter = adapter_for("SD3")
    examples = load_examples(demo_cache.items[:2])

    def draws(seed: int, timesteps: TimestepSpec) -> list:
        builder = MicroBatches(examples, 1, seed, model, adapter, timesteps, torch.device("cpu"),
                               family_options=adapter.options_type())
        batches = ValidationBatches(examples, 3, builder)
        return [batches.noise_and_sigma(i) for i in range(len(batches))]

    a, b = draws(0, TimestepSpec()), draws(12345, TimestepSpec())
    assert len(a) == 6
    assert all(torch.equal(x, y) for da, db in zip(a, b, strict=True) for x, y in zip(da, db, strict=True))
    assert len({float(s) for _, _, s in a}) == 3  # three levels, the same for each item of a shape
    assert not torch.equal(a[0][1], a[1][1])  # each (item, level) its own noise
    bounded = draws(0, TimestepSpec(sigma_min=0.7))
    assert all(float(s) >= 0.7 for _, _, s in bounded)


def _oracle_losses(fixture_paths, spec: RunSpec, lora_file: str | None) -> float:
    """The validation loss from ComfyUI's own forward: ``apply_model`` (optionally with the LoRA applied by
    ComfyUI's loader), the flow error recovered from its denoised output, averaged like the run."""
    import comfy.sd
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.data.validation import ValidationBatches
    from pipetrainer.training.pipelines.base import adapter_for
    from safetensors.torch import load_file

    patcher = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit), model_options={"dtype": torch.float32})
    if lora_file is not None:
        patcher, _ = comfy.sd.load_lora_for_models(patcher, None, load_file(lora_file), 1.0, 0)
    model = patcher.model
    adapter = adapter_for("SD3")
    examples = load_examples(spec.validation.items, text_dtype=torch.float32)
    builder = MicroBatches(examples, 1, 0, model, adapter, spec.train.timesteps, torch.device("cpu"),
                           family_options=adapter.options_type())
    batches = ValidationBatches(examples, spec.validation.sigmas, builder)
    losses = []
    patcher.patch_model()
    try:
        for i in range(len(batches)):
            x0, noise, sigma = batches.noise_and_sigma(i)
            example = examples[i // spec.validation.sigmas]
            noisy = model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
            with torch.no_grad():
                denoised = model.apply_model(noisy, sigma, c_crossattn=example.cond[None], y=example.pooled[None])
            losses.append((((x0 - denoised) / sigma.view(-1, 1, 1, 1)) ** 2).mean().item())
    finally:
        patcher.unpatch_model()
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_validation_loss_is_comfyuis_own_forward_and_the_same_in_every_run(fixture_paths, comfy_root, demo_cache,
                                                                            tmp_path):
    train_items, held = split_items(demo_cache.items, 0.25)
    assert held and train_items
    validation = ValidationSpec(items=held, every=2, sigmas=2)
    runs = []
    for stages in (1, 2):
        spec = make_spec(fixture_paths.mmdit, train_items, tmp_path / f"run{stages}", comfy_root, steps=3,
                         pipeline_stages=stages, gradient_checkpointing=False)
        spec = dataclasses.replace(spec, validation=validation).validated()
        code, events = run_training(spec)
        assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
        runs.append((spec, [(e["step"], e["loss"]) for e in events if e["type"] == "validation"]))
    (spec, first), (_, second) = runs
    assert [s for s, _ in first] == [0, 2, 3]  # before training, every 2 steps, the last step
    assert first == second  # fixed noise and sigmas: the same numbers in another run (and stage split)
    assert first[0][1] != first[-1][1]  # the LoRA moved it
    base = _oracle_losses(fixture_paths, spec, None)
    final = _oracle_losses(fixture_paths, spec, spec.lora_output)
    assert first[0][1] == pytest.approx(base, rel=1e-4)
    assert first[-1][1] == pytest.approx(final, rel=1e-4)


def test_the_validation_node_holds_out_a_fraction_or_takes_its_own_cache(comfy_root):
    from types import SimpleNamespace

    from pipetrainer.nodes.validation import ValidationChoice
    from pipetrainer.training.spec.choices import SpecError

    items = tuple(_items(5))
    train, spec = ValidationChoice(every=10, fraction=0.2, sigmas=2).split(items)
    assert len(train) == 4 and len(spec.items) == 1 and (spec.every, spec.sigmas) == (10, 2)
    own = SimpleNamespace(items=tuple(_items(7)[5:]) * 2)  # a validation folder's cache (with repeats)
    train, spec = ValidationChoice(every=10, fraction=0.2, sigmas=2, cache=own).split(items)
    assert train == items and spec.items == own.items[:2]
    with pytest.raises(SpecError, match="holds out every item"):
        ValidationChoice(every=10, fraction=0.9, sigmas=2).split(items[:1])


def test_train_lora_names_the_held_out_images_before_step_0(fixture_paths, demo_cache):
    """The hold-out is shown on the Train node (its notes lead the progress text and the run log)."""
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel
    from pipetrainer.nodes.train import PipeTrainerTrain
    from pipetrainer.nodes.validation import ValidationChoice
    from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

    model = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]
    notes: list[str] = []
    spec = PipeTrainerTrain.build_spec(
        model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(), "hold_out_note", notes=notes, steps=10,
        batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
        gradient_checkpointing=True, pipeline_stages=1, partition_method="parameters",
        validation=ValidationChoice(every=5, fraction=0.3, sigmas=2))
    [note] = [n for n in notes if n.startswith("validation:")]
    held = {item.source for item in spec.validation.items}
    assert held and all(name in note for name in held), (note, held)
    assert not held & {item.source for item in spec.items}  # what it names is never trained on
    assert "never trained on" in note and "every 5 steps" in note
