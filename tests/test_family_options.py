"""The optional Family Options node: each family's own options, its values the run's, a mismatch refused."""

from __future__ import annotations

import pytest
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

SETTINGS = dict(steps=10, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
                gradient_checkpointing=True, pipeline_stages=1, partition_method="parameters", blocks_to_swap=0)


def _schema():
    from pipetrainer.nodes.family_options import PipeTrainerFamilyOptions

    return PipeTrainerFamilyOptions.define_schema()


def _widgets_by_family(schema) -> dict[str, dict[str, object]]:
    """{family: {option: default}} as the node offers them, on either kind of host."""
    from comfy_api.latest import io

    (family, *rest) = schema.inputs
    if hasattr(io, "DynamicCombo") and isinstance(family, io.DynamicCombo.Input):
        return {o.key: {i.id: i.default for i in o.inputs} for o in family.options}
    flat = {i.id: i.default for i in rest}
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.options import option_names

    return {f: {n: flat[n] for n in option_names(adapter_for(f).options_type)} for f in family.options}


def test_each_family_offers_only_its_own_options_with_its_own_defaults(comfy_root):
    from comfy_api.latest import io

    offered = _widgets_by_family(_schema())
    assert offered["Flux"] == {"guidance": 1.0}
    assert offered["LTX2"] == {"frame_rate": 25.0, "first_frame_clean": False}
    assert offered["Wan"] == {"first_frame_clean": False, "expert": "none", "expert_boundary": 0.0}
    assert "SDXL" not in offered and "SD3" not in offered  # families without options are not listed
    if hasattr(io, "DynamicCombo"):  # the current host shows a family's options only when it is chosen
        assert isinstance(_schema().inputs[0], io.DynamicCombo.Input) and len(_schema().inputs) == 1


def test_the_value_comes_from_either_host_s_input_shape(comfy_root):
    from pipetrainer.nodes.family_options import FamilyOptions, PipeTrainerFamilyOptions

    dynamic = PipeTrainerFamilyOptions.execute({"family": "LTX2", "frame_rate": 24.0, "first_frame_clean": True})
    assert dynamic.result[0] == FamilyOptions("LTX2", {"frame_rate": 24.0, "first_frame_clean": True})
    flat = PipeTrainerFamilyOptions.execute("Flux", guidance=3.0, frame_rate=30.0, expert="high_noise")
    assert flat.result[0] == FamilyOptions("Flux", {"guidance": 3.0})  # the other families' widgets are not taken


def test_its_values_win_and_the_train_values_they_replace_are_named(comfy_root):
    from pipetrainer.nodes.family_options import FamilyOptions

    own = {"first_frame_clean": False, "expert": "none", "expert_boundary": 0.0}
    options, problems, notes = FamilyOptions("Wan", {"first_frame_clean": False, "expert": "low_noise",
                                                     "expert_boundary": 0.9}).merged("Wan", own)
    assert options == {"first_frame_clean": False, "expert": "low_noise", "expert_boundary": 0.9}
    assert problems == []
    from pipetrainer.nodes.family_options import FamilyOptions as Chosen

    _, refused, _ = Chosen("Flux", {"guidance": 3.5}).merged("LTX2", {"frame_rate": 25.0})
    assert refused == ["Family Options (PipeTrainer) is set for Flux, but the model is LTX2: choose LTX2 in its "
                       "family input, or disconnect it from Train LoRA."]
    assert notes == ["expert: Family Options (PipeTrainer)'s 'low_noise' is used (Train LoRA's 'none' is set aside).",
                     "expert_boundary: Family Options (PipeTrainer)'s 0.9 is used (Train LoRA's 0.0 is set aside)."]


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


def test_options_set_for_another_family_are_refused_by_train_lora_with_the_fix(tiny_model, demo_cache):
    from pipetrainer.nodes.family_options import FamilyOptions
    from pipetrainer.nodes.train import PipeTrainerTrain
    from pipetrainer.training.spec.choices import SpecError

    with pytest.raises(SpecError) as err:
        PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                    "family_options_test", notes=[],
                                    family_options=FamilyOptions("Flux", {"guidance": 3.5}),
                                    **SETTINGS)
    assert ("Family Options (PipeTrainer) is set for Flux, but the model is SD3, which takes no family option: "
            "disconnect it from Train LoRA.") in err.value.problems
    spec = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                       "family_options_test", notes=[], **SETTINGS)
    assert spec.family_options == {}  # unconnected: nothing else changes


def test_the_run_takes_the_node_s_values_and_the_family_checks_them(comfy_root):
    from pipetrainer.nodes.family_options import FamilyOptions, run_family_options

    train_widgets = {"guidance": 1.0, "first_frame_clean": True, "frame_rate": 25.0, "steps": 10}
    options, problems, notes = run_family_options("Flux", train_widgets, FamilyOptions("Flux", {"guidance": 3.5}))
    assert (options, problems) == ({"guidance": 3.5}, [])
    assert notes == ["guidance: Family Options (PipeTrainer)'s 3.5 is used (Train LoRA's 1.0 is set aside)."]
    assert run_family_options("Flux", train_widgets, None) == ({"guidance": 1.0}, [], [])  # unconnected: Train's
    _, refused, _ = run_family_options("LTX2", train_widgets, FamilyOptions("LTX2", {"frame_rate": 0.0}))
    assert refused == ["LTX2: frame_rate must be between 0 and 1000 frames per second (got 0.0)."]
