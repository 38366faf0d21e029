"""Pipeline parallelism on real CPU ranks: N stages train exactly what one stage trains.

The oracle is bitwise equality (fp32): 1 stage vs 2 stages, a resumed 2-stage run vs a straight one,
2 stages x 2 data-parallel replicas vs 1 stage x 2 replicas, two machines (torchrun on loopback) vs
one supervisor. Clipping is set tight (max_grad_norm 1e-3) so it binds on every step: DeepSpeed's own
per-stage clipping would break the equality, ours (global norm across stages) keeps it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from pipetrainer.devkit.host import free_port
from pipetrainer.tests.helpers import ENTRY, losses, make_spec, run_training
from pipetrainer.training.process.events import read_all
from pipetrainer.training.process.rank import EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from safetensors.torch import load_file

STEPS = 6
SETTINGS = dict(steps=STEPS, grad_accum=2, max_grad_norm=1e-3, seed=3)
FAILURE_REPORTED_WITHIN_S = 20.0  # supervisor poll (0.2 s) + SIGTERM grace (10 s) + margin for a loaded machine


def _spec(fixture_paths, comfy_root, demo_cache, run_dir: Path, **changes):
    return make_spec(fixture_paths.mmdit, demo_cache.items, run_dir, comfy_root, **{**SETTINGS, **changes})


def _leftover_processes(run_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line mentions this run dir (supervisor, ranks, launchers)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(run_dir) in a for a in p.info["cmdline"] or ()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _assert_same_lora(a: Path, b: Path) -> None:
    x, y = load_file(str(a)), load_file(str(b))
    assert sorted(x) == sorted(y)
    different = [k for k in x if not torch.equal(x[k], y[k])]
    assert not different, different[:5]


@pytest.fixture(scope="module")
def two_stage(fixture_paths, comfy_root, demo_cache, tmp_path_factory):
    """The reference: 2 stages, 6 steps, a checkpoint at step 3."""
    spec = _spec(fixture_paths, comfy_root, demo_cache, tmp_path_factory.mktemp("pipe") / "two", pipeline_stages=2,
                 save_every=3)
    code, events = run_training(spec)
    assert code == EXIT_OK, events
    assert not _leftover_processes(Path(spec.run_dir))
    return spec, events


@pytest.mark.slow
def test_two_stages_train_bitwise_what_one_stage_trains(two_stage, fixture_paths, comfy_root, demo_cache, tmp_path):
    spec2, events2 = two_stage
    spec1 = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "one", pipeline_stages=1)
    code, events1 = run_training(spec1)
    assert code == EXIT_OK, events1
    assert len(losses(events1)) == STEPS
    assert losses(events1) == losses(events2)  # fp32: bitwise, every step
    _assert_same_lora(Path(spec1.lora_output), Path(spec2.lora_output))

    plan = json.loads((Path(spec2.run_dir) / "partition.json").read_text())
    assert plan["method"] == "parameters" and len(plan["stages"]) == 2
    assert plan["stages"][0]["first_layer"] == 0 and plan["stages"][-1]["end_layer"] == 7
    assert all(s["lora_targets"] > 0 for s in plan["stages"])
    assert "final_layer" in plan["stages"][-1]["layers"]
    setup = next(e for e in events2 if e["type"] == "setup")
    assert setup["partition"] == [0, plan["stages"][0]["end_layer"], 7]
    done = [e for e in events2 if e["type"] == "rank_done"]
    assert sorted(e["stage"] for e in done) == [0, 1] and all(e["peak_rss_mb"] > 100 for e in done)


@pytest.mark.slow
def test_a_resumed_two_stage_run_continues_exactly(two_stage, tmp_path):
    spec, events = two_stage
    checkpoint = next(e["checkpoint"] for e in events if e["type"] == "saved" and e["step"] == 3)
    resumed = make_spec(Path(spec.model.path), spec.items, tmp_path / "resumed", Path(spec.comfyui_path),
                        pipeline_stages=2, resume_from=checkpoint, **SETTINGS)
    code, resumed_events = run_training(resumed)
    assert code == EXIT_OK, resumed_events
    assert next(e for e in resumed_events if e["type"] == "setup")["resumed_step"] == 3
    assert losses(resumed_events) == losses(events)[3:]
    _assert_same_lora(Path(resumed.lora_output), Path(spec.lora_output))


@pytest.mark.slow
def test_two_stages_by_two_replicas_match_one_stage_by_two_replicas(fixture_paths, comfy_root, demo_cache, tmp_path):
    """4 CPU ranks: data parallelism composes with the pipeline (gradients averaged over replicas).

    The 2-stage run also recomputes 2 layers per activation-checkpoint chunk instead of 1: exact too.
    """
    runs = {}
    for stages in (1, 2):
        spec = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / f"s{stages}", pipeline_stages=stages,
                     data_parallel=2, steps=3, checkpoint_interval=stages)
        code, events = run_training(spec)
        assert code == EXIT_OK, events
        runs[stages] = (spec, events)
    assert len(losses(runs[2][1])) == 3
    assert losses(runs[1][1]) == losses(runs[2][1])
    _assert_same_lora(Path(runs[1][0].lora_output), Path(runs[2][0].lora_output))
    plan = json.loads((Path(runs[2][0].run_dir) / "partition.json").read_text())
    assert plan["data_parallel"] == 2 and len(plan["stages"]) == 2 and plan["checkpoint_interval"] == 2
    assert len([e for e in runs[2][1] if e["type"] == "rank_done"]) == 4


@pytest.mark.slow
def test_two_machines_on_loopback_with_the_exported_torchrun_command(two_stage, tmp_path):
    """Two torchrun agents acting as two nodes (one stage each) run the run dir's own launch script."""
    spec, events = two_stage
    cluster = make_spec(Path(spec.model.path), spec.items, tmp_path / "cluster", Path(spec.comfyui_path),
                        pipeline_stages=2, **{**SETTINGS, "steps": 3})
    from pipetrainer.training.process.cluster import write_cluster_bundle

    bundle = write_cluster_bundle(cluster, ENTRY, nodes=2)
    assert (bundle / "hostfile").read_text() == "node0 slots=1\nnode1 slots=1\n"
    assert json.loads((bundle / "spec.json").read_text())["parent_pid"] == 0
    assert "--no_local_rank" in (bundle / "launch_deepspeed.sh").read_text()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    nodes = [subprocess.Popen(["bash", str(bundle / "launch_torchrun.sh")], env={**env, "NODE_RANK": str(i)},
                              stdout=open(tmp_path / f"node{i}.log", "wb"), stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        codes = [p.wait(600) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [(tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2)]
    node_events = read_all(cluster.run_dir)
    assert losses(node_events) == losses(events)[:3]
    assert sorted(e["rank"] for e in node_events if e["type"] == "rank_done") == [0, 1]
    assert load_file(cluster.lora_output).keys() == load_file(spec.lora_output).keys()
    assert not _leftover_processes(Path(cluster.run_dir))


@pytest.mark.slow
def test_the_exported_deepspeed_launcher_script_trains_with_a_hostfile(two_stage, tmp_path):
    """DeepSpeed's launcher (hostfile, --no_local_rank) starts the same rank entry; one host here."""
    spec, events = two_stage
    run = make_spec(Path(spec.model.path), spec.items, tmp_path / "ds", Path(spec.comfyui_path),
                    pipeline_stages=2, **{**SETTINGS, "steps": 3})
    from pipetrainer.training.process.cluster import write_cluster_bundle

    bundle = write_cluster_bundle(run, ENTRY, nodes=1)
    (bundle / "hostfile").write_text("localhost slots=2\n")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DEEPSPEED_ARGS": "--no_ssh_check",  # one host: no ssh to itself
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", str(bundle / "launch_deepspeed.sh")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert losses(read_all(run.run_dir)) == losses(events)[:3]
    assert not _leftover_processes(Path(run.run_dir))


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_run_fast_with_its_error(two_stage, tmp_path):
    """Stage 1's checkpoint file is missing: rank 1 raises while loading; rank 0 must not hang."""
    spec, events = two_stage
    source = Path(next(e["checkpoint"] for e in events if e["type"] == "saved" and e["step"] == 3))
    broken = tmp_path / "checkpoints" / source.name
    shutil.copytree(source, broken)
    stage1_layers = json.loads((Path(spec.run_dir) / "partition.json").read_text())["stages"][1]
    for i in range(stage1_layers["first_layer"], stage1_layers["end_layer"]):
        (broken / f"layer_{i:02d}-model_states.pt").unlink(missing_ok=True)
    failing = make_spec(Path(spec.model.path), spec.items, tmp_path / "failing", Path(spec.comfyui_path),
                        pipeline_stages=2, resume_from=str(broken), **SETTINGS)
    code, failed_events = run_training(failing)
    assert code == EXIT_FAILED
    verdict = next(e for e in failed_events if e["type"] == "failed")
    error = next(e for e in failed_events if e["type"] == "error" and e["rank"] == verdict["rank"])
    assert verdict["rank"] == 1, failed_events
    assert "Could not load the checkpoint" in error["message"] and "pipeline stage 1" in error["message"], error
    assert "Traceback" in verdict["log_tail"]
    print(f"\nrank {verdict['rank']} raised -> run failed after {verdict['time'] - error['time']:.2f} s")
    assert verdict["time"] - error["time"] < FAILURE_REPORTED_WITHIN_S
    assert not _leftover_processes(Path(failing.run_dir))


@pytest.mark.slow
def test_cancel_stops_every_stage_at_the_same_step_and_leaves_no_process(two_stage, tmp_path):
    from pipetrainer.nodes.run import run_process

    spec, _ = two_stage
    long = make_spec(Path(spec.model.path), spec.items, tmp_path / "cancel", Path(spec.comfyui_path),
                     pipeline_stages=2, **{**SETTINGS, "steps": 10_000})
    handle = run_process.launch(long)
    deadline = time.monotonic() + 300
    while not any(e["type"] == "step" for e in read_all(long.run_dir)):
        assert handle.proc.poll() is None and time.monotonic() < deadline, read_all(long.run_dir)
        time.sleep(0.2)
    code = run_process.stop(handle)
    assert code == EXIT_STOPPED
    events = read_all(long.run_dir)
    stopped = [e for e in events if e["type"] == "rank_done"]
    assert len({e["step"] for e in stopped}) == 1 and len(stopped) == 2
    saved = next(e for e in events if e["type"] == "saved")
    assert Path(saved["checkpoint"]).is_dir() and saved["step"] == stopped[0]["step"]
    assert not _leftover_processes(Path(long.run_dir))
