"""Fast pipeline pieces: stage plans over the real MMDiT layers, the cluster bundle, the rank count."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pipetrainer.tests.helpers import ENTRY, make_spec
from pipetrainer.training.model.partition import (
    StageWithoutLoraError,
    describe,
    require_lora_on_every_stage,
    write_plan,
)
from pipetrainer.training.process.cluster import ranks_per_node, torchrun_command, write_cluster_bundle
from pipetrainer.training.spec.choices import SpecError


@pytest.fixture(scope="module")
def mmdit_layers(fixture_paths):
    from pipetrainer.training.loop.engine import _inputs_need_grad
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import ModelRecipe

    patcher = load_model(ModelRecipe("diffusion_model", str(fixture_paths.mmdit)))
    adapter = adapter_for("SD3")
    return [_inputs_need_grad, *adapter.stage_layers(patcher.model.diffusion_model)], adapter


def test_deepspeed_uniform_split_in_four_leaves_the_final_layer_alone_and_is_refused(mmdit_layers, tmp_path):
    from deepspeed.runtime.utils import partition_uniform

    layers, adapter = mmdit_layers
    regex = adapter.lora_target_regex("attention_mlp")
    plan = describe(layers, partition_uniform(len(layers), 4), regex)
    assert plan[-1].layers == ("final_layer",) and plan[-1].lora_targets == 0
    with pytest.raises(StageWithoutLoraError, match=r"stage 3 holds only final_layer.*fewer pipeline stages"):
        require_lora_on_every_stage(plan, "attention_mlp")
    two = describe(layers, partition_uniform(len(layers), 2), regex)
    require_lora_on_every_stage(two, "attention_mlp")
    assert sum(p.parameters for p in two) == sum(p.parameters for p in plan) > 9_000_000
    assert sum(p.lora_targets for p in two) == 4 * 8 - 3  # the last block's text stream is pre-only
    path = write_plan(tmp_path, two, "uniform", {"pipeline_stages": 2})
    data = json.loads(path.read_text())
    assert [s["stage"] for s in data["stages"]] == [0, 1] and data["stages"][0]["layers"][0] == "inputs_need_grad"


def test_ranks_are_stages_times_replicas(fixture_paths, comfy_root, tmp_path):
    spec = make_spec(fixture_paths.mmdit, [_item(tmp_path)], tmp_path / "run", comfy_root,
                     pipeline_stages=3, data_parallel=2)
    assert spec.world_size == 6
    with pytest.raises(SpecError, match="Data-parallel replicas must be at least 1"):
        make_spec(fixture_paths.mmdit, [_item(tmp_path)], tmp_path / "bad", comfy_root, data_parallel=0)


def test_cluster_bundle_has_the_spec_hostfile_and_runnable_scripts(fixture_paths, comfy_root, tmp_path):
    spec = make_spec(fixture_paths.mmdit, [_item(tmp_path)], tmp_path / "run", comfy_root,
                     pipeline_stages=4, data_parallel=2, parent_pid=12345)
    folder = write_cluster_bundle(spec, ENTRY)
    assert (folder / "hostfile").read_text().splitlines() == [f"node{i} slots=2" for i in range(4)]
    assert json.loads((folder / "spec.json").read_text())["parent_pid"] == 0
    for script in ("launch_deepspeed.sh", "launch_torchrun.sh"):
        subprocess.run(["bash", "-n", str(folder / script)], check=True)
    ds = (folder / "launch_deepspeed.sh").read_text()
    assert "deepspeed" in ds and "--hostfile" in ds and "--no_local_rank" in ds and '"$ENTRY" rank "$SPEC"' in ds
    tr = (folder / "launch_torchrun.sh").read_text()
    assert "--nnodes 4" in tr and "--nproc-per-node 2" in tr
    with pytest.raises(ValueError, match="cannot be spread evenly"):
        ranks_per_node(spec, 3)
    cmd = torchrun_command(ENTRY, folder / "spec.json", nodes=2, node_rank=1, nproc_per_node=4,
                           master_addr="10.0.0.1", master_port=29500)
    assert cmd[-3:] == [str(ENTRY), "rank", str(folder / "spec.json")] and "--node-rank" in cmd


def _item(tmp_path: Path):
    from pipetrainer.training.spec.options import CacheItem

    return CacheItem(latent_file=str(tmp_path / "l.safetensors"), text_file=str(tmp_path / "t.safetensors"),
                     source="a.png", caption="a")
