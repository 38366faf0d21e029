"""The optional GPUs & Memory node: its values are the run's, and a Train LoRA value it overrides is named."""

from __future__ import annotations

import pytest
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

SETTINGS = dict(steps=10, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
                gradient_checkpointing=True, pipeline_stages=1, partition_method="parameters", blocks_to_swap=0)


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


def test_the_node_s_values_are_the_run_s_and_what_they_replace_is_named(tiny_model, demo_cache):
    from pipetrainer.nodes.checks.memory import CPU_NOTE
    from pipetrainer.nodes.gpus_memory import PipeTrainerGpusMemory
    from pipetrainer.nodes.train import PipeTrainerTrain

    devices = PipeTrainerGpusMemory.execute(-1, 2, 1, "  ", "uniform", False, 2).result[0]
    notes: list[str] = []
    spec = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                       "gpus_memory_test", notes=notes, gpus_and_memory=devices, **SETTINGS)
    train = spec.train
    assert (train.pipeline_stages, train.partition_method, train.gradient_checkpointing,
            train.checkpoint_interval) == (2, "uniform", False, 2)
    assert train.blocks_to_swap == 0 and CPU_NOTE in notes  # auto, planned (on the CPU: nothing to swap)
    assert "pipeline_stages: GPUs & Memory's 2 is used (Train LoRA's 1 is set aside)." in notes
    assert not any(n.startswith("data_parallel") for n in notes)  # equal values are not named
    unchanged = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                            "gpus_memory_test", notes=[], **SETTINGS).train
    assert (unchanged.pipeline_stages, unchanged.partition_method) == (1, "parameters")  # not connected: Train's


def test_a_bad_gpu_list_on_the_node_is_refused_with_train_lora_s_problems(tiny_model, demo_cache):
    from pipetrainer.nodes.gpus_memory import GpusMemory
    from pipetrainer.nodes.train import PipeTrainerTrain
    from pipetrainer.training.spec.choices import SpecError

    with pytest.raises(SpecError) as err:
        PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                    "gpus_memory_test", notes=[], gpus_and_memory=GpusMemory(pipeline_stages=64),
                                    **SETTINGS)
    assert "pipeline_stages x data_parallel = 64 ranks" in str(err.value)
