"""Unit tests of the vertical slice: key mapping, spec round-trip, caption policy, family registry."""

from __future__ import annotations

import os

import pytest
import torch
from pipetrainer.training.adapters.keys import comfy_key_for
from pipetrainer.training.adapters.lora_file import atomic_save, lora_state_dict
from pipetrainer.training.data.dataset import DatasetError, scan_dataset
from pipetrainer.training.pipelines.base import UnknownFamilyError, adapter_for, family_name_for, known_families
from pipetrainer.training.spec.choices import SpecError
from pipetrainer.training.spec.options import CacheItem, LoraSpec, ModelRecipe, OptimizerSpec, TimestepSpec, TrainSpec
from pipetrainer.training.spec.run_spec import RunSpec

LAYER_PATHS = {2: {"block": "joint_blocks.0"}, 1: {"x_embedder": "x_embedder"}, 6: {"final_layer": "final_layer"}}


def test_peft_names_map_to_comfy_module_keys():
    assert comfy_key_for("2.block.x_block.attn.qkv.lora_A.default.weight", LAYER_PATHS) == (
        "diffusion_model.joint_blocks.0.x_block.attn.qkv", "lora_A.weight")
    assert comfy_key_for("6.final_layer.linear.lora_B.default.weight", LAYER_PATHS) == (
        "diffusion_model.final_layer.linear", "lora_B.weight")
    assert comfy_key_for("1.x_embedder.lora_A.default.weight", LAYER_PATHS) == (
        "diffusion_model.x_embedder", "lora_A.weight")


@pytest.mark.parametrize("name", ["2.block.x_block.attn.qkv.base_layer.weight", "9.block.attn.lora_A.default.weight",
                                  "2.other.attn.lora_A.default.weight"])
def test_unmappable_names_are_errors(name):
    with pytest.raises(ValueError):
        comfy_key_for(name, LAYER_PATHS)


def test_lora_state_dict_has_alpha_per_module_and_fp32(tmp_path):
    params = {"2.block.x_block.attn.qkv.lora_A.default.weight": torch.ones(4, 8, dtype=torch.bfloat16),
              "2.block.x_block.attn.qkv.lora_B.default.weight": torch.zeros(24, 4)}
    sd = lora_state_dict(params, LAYER_PATHS, alpha=2.0)
    assert set(sd) == {"diffusion_model.joint_blocks.0.x_block.attn.qkv." + k
                       for k in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert sd["diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_A.weight"].dtype == torch.float32
    assert float(sd["diffusion_model.joint_blocks.0.x_block.attn.qkv.alpha"]) == 2.0
    out = atomic_save(sd, tmp_path / "x.safetensors", {"rank": "4", "steps": 3})
    assert out.exists() and not list(tmp_path.glob(".*.tmp"))


def _spec(**changes) -> RunSpec:
    base = dict(
        model=ModelRecipe("diffusion_model", "/m/model.safetensors", "fp8_e4m3fn", "abc", loras=(("/l/a.safetensors", 0.5),)),
        items=(CacheItem("/c/l.safetensors", "/c/t.safetensors", "/d/a.png", "a cat"),),
        lora=LoraSpec(rank=4, alpha=2.0), optimizer=OptimizerSpec(lr=3e-4, betas=(0.9, 0.99)),
        train=TrainSpec(steps=7, seed=3), run_dir="/runs/r", lora_output="/loras/x.safetensors", comfyui_path="/comfy",
    )
    base.update(changes)
    return RunSpec(**base)


def test_spec_round_trips_through_json():
    spec = _spec()
    again = RunSpec.from_json(spec.to_json())
    assert again == spec
    assert again.training_hash() == spec.training_hash()
    assert again.model.loras == (("/l/a.safetensors", 0.5),) and again.optimizer.betas == (0.9, 0.99)


def test_training_hash_ignores_steps_and_paths_but_not_settings():
    spec = _spec()
    assert _spec(train=TrainSpec(steps=999, seed=3), run_dir="/runs/other").training_hash() == spec.training_hash()
    assert _spec(train=TrainSpec(steps=7, seed=4)).training_hash() != spec.training_hash()
    assert _spec(lora=LoraSpec(rank=8, alpha=2.0)).training_hash() != spec.training_hash()


def test_spec_reports_every_problem_at_once():
    bad = _spec(items=(), lora=LoraSpec(rank=0, alpha=-1, targets="nope"),
                optimizer=OptimizerSpec(name="SGD", lr=0), train=TrainSpec(steps=0, timesteps=TimestepSpec(distribution="cosmic")),
                run_dir="relative/dir")
    with pytest.raises(SpecError) as err:
        bad.validated()
    text = str(err.value)
    for fragment in ("no items", "rank must be at least 1", "alpha must be positive", "target preset 'nope'",
                     "Optimizer 'SGD'", "Learning rate", "Steps must be at least 1", "Timestep distribution 'cosmic'",
                     "run_dir must be an absolute path"):
        assert fragment in text, fragment
    assert len(err.value.problems) >= 9


def _write(folder, name, caption=None):
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(folder / f"{name}.png")
    if caption is not None:
        (folder / f"{name}.txt").write_text(caption)


def test_missing_caption_policy(tmp_path):
    _write(tmp_path, "a", "a red square")
    _write(tmp_path, "b")
    _write(tmp_path, "c", "   ")
    with pytest.raises(DatasetError) as err:
        scan_dataset(tmp_path, 64)
    assert "b.png" in str(err.value) and "c.png" in str(err.value) and "missing_caption" in str(err.value)
    skipped = scan_dataset(tmp_path, 64, missing_caption="skip")
    assert [e.caption for e in skipped.entries] == ["a red square"]
    assert skipped.skipped == ("b.png", "c.png") and "skipped 2" in skipped.report()
    empty = scan_dataset(tmp_path, 64, missing_caption="empty")
    assert [e.caption for e in empty.entries] == ["a red square", "", ""]
    assert empty.empty_captions == ("b.png", "c.png") and "2 trained with an empty caption" in empty.report()


def test_registry_rejects_unknown_models_listing_the_known_ones():
    class HunyuanDiT:  # stands in for any ComfyUI model class we do not support
        pass

    with pytest.raises(UnknownFamilyError) as err:
        family_name_for(HunyuanDiT())
    for family in known_families():
        assert family in str(err.value)
    assert "HunyuanDiT" in str(err.value)
    with pytest.raises(UnknownFamilyError):
        adapter_for("HunyuanDiT")


def test_registry_finds_the_family_of_real_comfy_models(fixture_paths):
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    assert family_name_for(patcher.model) == "SD3"
    assert adapter_for("SD3").name == "SD3"


def test_atomic_save_removes_temp_files_of_killed_writers_only(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".x.safetensors.{dead.pid}.abc123.tmp"
    live = tmp_path / f".x.safetensors.{os.getpid()}.def456.tmp"
    stale.write_bytes(b"partial")
    live.write_bytes(b"in progress")
    atomic_save({"w": torch.zeros(2)}, tmp_path / "x.safetensors", {})
    assert not stale.exists() and live.exists()


def test_file_fingerprint_sees_the_last_bytes_of_large_files(tmp_path):
    from pipetrainer.training.model.fingerprint import file_fingerprint

    f = tmp_path / "big.bin"
    data = bytearray(os.urandom(5_000_003))
    f.write_bytes(data)
    before = file_fingerprint(f)
    data[-1] ^= 0xFF
    f.write_bytes(data)
    assert file_fingerprint(f) != before
