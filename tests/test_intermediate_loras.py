"""Every save of a run appears where the stock LoraLoader looks (models/loras/pipetrainer/<name>/), named by
run and step, and loads into the base model with every key mapped; the run dir keeps the same files."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

import pytest
from pipetrainer.training.adapters.lora_file import link_or_copy, step_lora_name
from pipetrainer.training.process.events import read_all
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


@pytest.fixture
def cold_node():
    """The Train node without its warm pool: no process tree is left running after the test."""
    from pipetrainer.nodes import train

    enabled = train.WARM_POOL.enabled
    train.WARM_POOL.enabled = False
    yield train.PipeTrainerTrain
    train.WARM_POOL.enabled = enabled


def _cleanup(name: str) -> None:
    from pipetrainer.nodes.run import paths

    for run in Path(paths.runs_root()).glob(f"{name}-*"):
        shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(paths.step_loras_dir(name), ignore_errors=True)
    Path(paths.lora_output_path(name)).unlink(missing_ok=True)


def test_each_save_is_listed_by_the_lora_loader_and_loads_every_key(cold_node, tiny_model, demo_cache, caplog):
    import comfy.sd
    import folder_paths
    from pipetrainer.nodes.run import paths

    name = f"steps_{secrets.token_hex(3)}"
    settings = dict(steps=4, batch_size=1, gradient_accumulation=1, seed=0, save_every=2, training_dtype="fp32",
                    gradient_checkpointing=False, pipeline_stages=1, partition_method="parameters", resume=False)
    try:
        cold_node.execute(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(lr=1e-3, weight_decay=0.0),
                          name, **settings)
        [run_dir] = Path(paths.runs_root()).glob(f"{name}-*")
        run_id = run_dir.name[len(name) + 1:]
        saved = [e for e in read_all(run_dir) if e["type"] == "saved"]
        assert [(e["step"], e["final"]) for e in saved] == [(2, False), (4, True)]

        folder = Path(paths.step_loras_dir(name))
        expected = [f"{name}-{run_id}-step{step:07d}.safetensors" for step in (2, 4)]
        assert sorted(p.name for p in folder.iterdir()) == expected  # nothing else, no temp files
        listed = folder_paths.get_filename_list("loras")  # what the stock LoraLoader offers
        assert [f"{paths.STEP_LORAS_FOLDER}/{name}/{file}" for file in expected] == [
            entry for entry in listed if entry.startswith(f"{paths.STEP_LORAS_FOLDER}/{name}/")]
        assert f"{name}.safetensors" in listed

        # The run dir keeps each file under the same name; the last save is the final LoRA.
        for file in expected:
            assert load_file(str(run_dir / "loras" / file)).keys() == load_file(str(folder / file)).keys()
        final = load_file(paths.lora_output_path(name))
        last = load_file(str(folder / expected[-1]))
        assert final.keys() == last.keys() and all(final[k].equal(last[k]) for k in final)
        assert not load_file(str(folder / expected[0]))["diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_B.weight"].equal(
            last["diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_B.weight"])

        for entry in (f"{paths.STEP_LORAS_FOLDER}/{name}/{file}" for file in expected):
            lora = load_file(folder_paths.get_full_path_or_raise("loras", entry))
            modules = {k.rsplit(".lora_", 1)[0] for k in lora if ".lora_" in k}
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                patched, _ = comfy.sd.load_lora_for_models(tiny_model, None, lora, 1.0, 0)
            assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()], entry
            assert len(patched.patches) == len(modules) > 0, entry  # one patched weight per LoRA module
    finally:
        _cleanup(name)


def test_step_names_sort_by_run_then_step_and_links_survive_a_replaced_source(tmp_path):
    run = tmp_path / "my_lora-20261201-101010-abc123"
    assert step_lora_name("/l/my_lora.safetensors", run, 123) == "my_lora-20261201-101010-abc123-step0000123.safetensors"
    assert step_lora_name("/l/other.safetensors", run, 5) == "other-my_lora-20261201-101010-abc123-step0000005.safetensors"

    source = tmp_path / "final.safetensors"
    source.write_bytes(b"first")
    copy = link_or_copy(source, tmp_path / "sub" / "copy.safetensors")
    tmp = tmp_path / "new.tmp"
    tmp.write_bytes(b"second")
    os.replace(tmp, source)  # what an atomic save of the next run does to the final file
    assert copy.read_bytes() == b"first" and source.read_bytes() == b"second"
    assert [p.name for p in copy.parent.iterdir()] == ["copy.safetensors"]
