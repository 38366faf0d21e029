"""Train LoRA's preset input: a family's hardware preset sets the run's values and names each one it changed."""

from __future__ import annotations

import pytest
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

SETTINGS = dict(steps=10, batch_size=2, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
                gradient_checkpointing=False, pipeline_stages=1, partition_method="parameters", blocks_to_swap=0)


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


def test_presets_are_the_families_own_and_a_relative_does_not_inherit_them(comfy_root):
    from pipetrainer.nodes.presets import NO_PRESET, preset_choices, presets_of

    choices = preset_choices()
    assert choices[0] == NO_PRESET
    assert "FLUX.1 dev, 24 GB" in choices and "Wan 2.1 14B, 24 GB" in choices
    assert [p.label for p in presets_of("Flux")][0] == "FLUX.1 dev, 24 GB"
    assert presets_of("Flux2") == () and presets_of("WanVace") == ()  # subclassed adapters, other models
    assert len(set(choices)) == len(choices)  # a label names one preset


def test_every_preset_is_a_valid_run_of_its_family(comfy_root):
    """Each preset's values pass the run spec's own checks (names of optimizers and dtypes, ranges)."""
    from pipetrainer.nodes.presets import presets_of
    from pipetrainer.training.pipelines.base import known_families
    from pipetrainer.training.spec.choices import TRAIN_DTYPES

    for family in known_families():
        for preset in presets_of(family):
            assert LoraSpec(rank=preset.rank, alpha=float(preset.rank)).problems() == [], preset.label
            assert OptimizerSpec(name=preset.optimizer, lr=preset.lr).problems(steps=100) == [], preset.label
            assert preset.training_dtype in TRAIN_DTYPES and preset.batch_size >= 1, preset.label
            assert preset.source.endswith(".yaml") and preset.label.endswith(" GB"), preset.label


def test_a_preset_sets_the_run_and_names_each_value_it_changed(tiny_model, demo_cache):
    from pipetrainer.nodes.train import PipeTrainerTrain

    notes: list[str] = []
    spec = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=16, alpha=8.0), OptimizerSpec(lr=3e-4),
                                       "preset_test", notes=notes, preset="SD3.5 Large, 24 GB", **SETTINGS)
    assert (spec.lora.rank, spec.lora.alpha) == (16, 16.0)
    assert (spec.optimizer.name, spec.optimizer.lr) == ("AdamW8bit", 1e-4)
    assert (spec.train.batch_size, spec.train.gradient_checkpointing, spec.train.dtype) == (1, True, "bf16")
    start = notes.index("preset 'SD3.5 Large, 24 GB' follows ai-toolkit's config/examples/train_lora_sd35_large_24gb.yaml:")
    said = notes[start + 1:]
    assert said[:6] == ["  alpha 16.0 (LoRA Adapter's 8.0 set aside)",
                        "  optimizer 'AdamW8bit' (Optimizer's 'AdamW' set aside)",
                        "  lr 0.0001 (Optimizer's 0.0003 set aside)",
                        "  batch_size 1 (Train LoRA's 2 set aside)",
                        "  gradient_checkpointing True (Train LoRA's False set aside)",
                        "  training_dtype 'bf16' (Train LoRA's 'fp32' set aside)"]
    assert not any(line.startswith("  rank") for line in said)  # equal values are not named
    assert any("8-bit base; this one is stored in" in line for line in said)  # the loader's part, said not done
    plain = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=16, alpha=8.0), OptimizerSpec(lr=3e-4),
                                        "preset_test", notes=[], **SETTINGS)
    assert (plain.lora.alpha, plain.optimizer.name, plain.train.batch_size) == (8.0, "AdamW", 2)  # none: as set


def test_another_family_s_preset_is_refused_with_the_model_s_own(tiny_model, demo_cache):
    from pipetrainer.nodes.train import PipeTrainerTrain
    from pipetrainer.training.spec.choices import SpecError

    with pytest.raises(SpecError) as err:
        PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                    "preset_test", notes=[], preset="FLUX.1 dev, 24 GB", **SETTINGS)
    assert ("preset 'FLUX.1 dev, 24 GB' is a Flux preset, but the model is SD3: choose one of its presets "
            "(SD3.5 Large, 24 GB) or none.") in err.value.problems
