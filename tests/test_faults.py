"""Faults: a killed rank, a kill during a LoRA save, a vanished ComfyUI, two runs at once.

Every process here is real (the supervisor and DeepSpeed CPU ranks over gloo, started by the pack's
own launcher) and every kill is a real signal. Timings are measured and printed (``-s`` shows them);
the machine is shared, so the bounds are the promises, not the typical figures.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from pipetrainer.tests.helpers import losses, make_spec
from pipetrainer.training.process.events import read_all, stop_path
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec
from safetensors.torch import load_file

PACK_DIR = Path(__file__).resolve().parent.parent
ENTRY = PACK_DIR / "training" / "process" / "entry.py"
NODE_ERROR_WITHIN_S = 30.0


def _wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _rank_processes(supervisor_pid: int, world: int) -> dict[int, psutil.Process]:
    """rank -> process, once the supervisor has started all of them."""
    def found():
        try:
            kids = psutil.Process(supervisor_pid).children()
            ranks = {int(p.environ()["RANK"]): p for p in kids if "RANK" in p.environ()}
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            return None
        return ranks if len(ranks) == world else None
    return _wait_for(found, 120, "the rank processes")


def _saved_then_stepped(run_dir: Path):
    """The last 'saved' event, once a later step has been reported (the ranks are mid-step then)."""
    events = read_all(run_dir)
    saved = [e for e in events if e["type"] == "saved"]
    if saved and any(e["type"] == "step" and e["step"] > saved[-1]["step"] for e in events):
        return saved[-1]
    return None


def _assert_intact(saved: dict) -> None:
    """The saved LoRA loads completely and matches its step; every checkpoint file loads."""
    lora = load_file(saved["path"])
    assert lora and all(torch.isfinite(t).all() for t in lora.values())
    from safetensors import safe_open

    with safe_open(saved["path"], "pt") as f:
        assert f.metadata()["steps"] == str(saved["step"])
    files = [p for p in Path(saved["checkpoint"]).rglob("*.pt")]
    assert files, saved
    for path in files:
        torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


# ---- a rank killed mid-step -------------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_of_a_rank_fails_the_node_fast_with_the_log_tail(tiny_model, demo_cache):
    """2-stage run through the Train node; rank 1 is SIGKILLed mid-step after a save."""
    from pipetrainer.nodes.run import paths
    from pipetrainer.nodes.run.run_process import TrainingFailed
    from pipetrainer.nodes.train import PipeTrainerTrain

    name = f"faults-sigkill-{secrets.token_hex(3)}"
    seen: dict = {}

    def kill_rank_after_a_save():
        try:
            root = Path(paths.runs_root())
            run_dir = _wait_for(lambda: next(iter(root.glob(f"{name}-*")), None), 60, "the run dir")
            seen["run_dir"] = run_dir
            launch = _wait_for(lambda: [e for e in read_all(run_dir) if e["type"] == "launch"], 60, "launch")[0]
            ranks = _rank_processes(launch["pid"], 2)
            seen["pids"] = [launch["pid"], *(p.pid for p in ranks.values())]
            seen["saved"] = _wait_for(lambda: _saved_then_stepped(run_dir), 300, "a save and a later step")
            os.kill(ranks[1].pid, signal.SIGKILL)
            seen["killed_at"] = time.monotonic()
        except BaseException as exc:  # end the run rather than let it train to the end
            seen["error"] = exc
            if "run_dir" in seen:
                stop_path(seen["run_dir"]).touch()

    watcher = threading.Thread(target=kill_rank_after_a_save, daemon=True)
    watcher.start()
    settings = dict(steps=400, batch_size=1, gradient_accumulation=2, seed=0,
                    save_every=2, training_dtype="fp32", gradient_checkpointing=False, pipeline_stages=2,
                    partition_method="parameters", resume=False)
    try:
        with pytest.raises(TrainingFailed) as info:
            PipeTrainerTrain.execute(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0),
                                     OptimizerSpec(lr=1e-3), name, **settings)
        raised_at = time.monotonic()
        watcher.join(10)
        assert "error" not in seen, seen.get("error")
        took = raised_at - seen["killed_at"]
        print(f"\nSIGKILL of rank 1 after step {seen['saved']['step']}: node raised after {took:.2f} s")
        assert took < NODE_ERROR_WITHIN_S
        message = str(info.value)
        assert "rank 1 exited with code -9" in message and "Log tail:" in message, message
        _wait_for(lambda: all(_gone(pid) for pid in seen["pids"]), 10, "every training process to end")
        _assert_intact(seen["saved"])
    finally:
        if "run_dir" in seen:
            shutil.rmtree(seen["run_dir"], ignore_errors=True)
        Path(paths.lora_output_path(name)).unlink(missing_ok=True)


@pytest.mark.slow
def test_sigkill_of_the_supervisor_takes_its_ranks_down(fixture_paths, comfy_root, demo_cache, tmp_path):
    """The supervisor itself dies: its ranks follow (PR_SET_PDEATHSIG) and the node reports the exit code."""
    from pipetrainer.nodes.run import run_process

    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=400,
                     pipeline_stages=2, gradient_checkpointing=False)
    handle = run_process.launch(spec)
    try:
        ranks = _rank_processes(handle.proc.pid, 2)
        pids = [p.pid for p in ranks.values()]
        _wait_for(lambda: any(e["type"] == "step" for e in read_all(spec.run_dir)), 300, "a step")
        os.kill(handle.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = run_process.follow(handle, lambda e: None, lambda: False)
        _wait_for(lambda: all(_gone(pid) for pid in pids), 30, "the ranks to follow their supervisor")
        took = time.monotonic() - killed_at
    finally:
        run_process.stop(handle, grace_s=5)
    print(f"\nSIGKILL of the supervisor: ranks gone {took:.2f} s later")
    assert code == -signal.SIGKILL
    assert "exited with code -9" in run_process.failure_message(handle)


# ---- a kill during a LoRA save ----------------------------------------------------------------
_WRITER = """
import sys, time
sys.path.insert(0, {pack_parent!r})
import importlib.util
spec = importlib.util.spec_from_file_location("_entry", {entry!r})
entry = importlib.util.module_from_spec(spec); spec.loader.exec_module(entry); entry.import_pack()
import torch
from pipetrainer.training.adapters.lora_file import atomic_save
version = {start}
while True:
    tensors = {{"w": torch.full(({elements},), float(version))}}
    print("writing", version, flush=True)
    t0 = time.monotonic()
    atomic_save(tensors, {path!r}, {{"version": str(version)}})
    print("saved", version, time.monotonic() - t0, flush=True)
    version += 1
"""


def _start_writer(path: Path, start: int, elements: int) -> subprocess.Popen:
    code = _WRITER.format(pack_parent=str(PACK_DIR.parent), entry=str(ENTRY), start=start, elements=elements,
                          path=str(path))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _complete_version(path: Path) -> int:
    """The file's version; raises unless the file is complete and self-consistent."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        version = int(f.metadata()["version"])
    tensor = load_file(str(path))["w"]
    assert bool((tensor == float(version)).all()), f"mixed content in {path}"
    return version


@pytest.mark.slow
def test_a_kill_during_a_lora_save_leaves_the_previous_file_intact(tmp_path):
    path = tmp_path / "my_lora.safetensors"
    elements = 24 * 2**20  # 96 MiB: a write takes long enough to be hit in the middle
    mid_write_kills, version = 0, 0
    for trial in range(4):
        writer = _start_writer(path, start=version, elements=elements)
        try:
            line = writer.stdout.readline()
            if trial == 0:  # let one version complete first
                assert line.startswith("writing"), line
                line = writer.stdout.readline()
                assert line.startswith("saved"), line
                write_s = float(line.split()[2])
                line = writer.stdout.readline()
            assert line.startswith("writing"), line
            before = _complete_version(path)
            time.sleep(write_s * (0.2 + 0.2 * trial))  # somewhere inside the write
            tmp_files = list(tmp_path.glob(".my_lora.safetensors.*.tmp"))
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        after = _complete_version(path)  # always one complete version, never a torn file
        assert after >= before, (before, after)
        mid_write_kills += bool(tmp_files)
        version = after + 1
    print(f"\nLoRA save of {elements * 4 / 2**20:.0f} MiB takes {write_s:.2f} s; {mid_write_kills}/4 kills hit "
          f"mid-write, the file stayed complete every time")
    assert mid_write_kills >= 1


# ---- ComfyUI dies ------------------------------------------------------------------------------
_PARENT = """
import sys, time, dataclasses, os
sys.path.insert(0, {pack_parent!r})
import importlib.util
spec = importlib.util.spec_from_file_location("_entry", {entry!r})
entry = importlib.util.module_from_spec(spec); spec.loader.exec_module(entry); entry.import_pack()
from pipetrainer.nodes.run import run_process
from pipetrainer.training.spec.run_spec import RunSpec
spec = dataclasses.replace(RunSpec.load({spec_path!r}), parent_pid=os.getpid())
handle = run_process.launch(spec)
print(handle.proc.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_training_stops_when_the_comfyui_process_dies(fixture_paths, comfy_root, demo_cache, tmp_path):
    """A real parent launches a 2-stage run as the Train node does, then is SIGKILLed mid-run."""
    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=400,
                     pipeline_stages=2, gradient_checkpointing=False)
    spec_path = tmp_path / "spec-in.json"
    spec_path.write_text(spec.to_json())
    code = _PARENT.format(pack_parent=str(PACK_DIR.parent), entry=str(ENTRY), spec_path=str(spec_path))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        supervisor = int(parent.stdout.readline())
        ranks = _rank_processes(supervisor, 2)
        pids = [supervisor, *(p.pid for p in ranks.values())]
        run_dir = Path(spec.run_dir)
        _wait_for(lambda: any(e["type"] == "step" and e["step"] >= 2 for e in read_all(run_dir)), 300, "step 2")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        killed_at = time.monotonic()
        _wait_for(lambda: all(_gone(pid) for pid in pids), 120, "the training processes to stop")
        took = time.monotonic() - killed_at
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in locals().get("pids", []):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    events = read_all(run_dir)
    kinds = [e["type"] for e in events]
    print(f"\nComfyUI SIGKILLed at step {max(e['step'] for e in events if e['type'] == 'step')}: "
          f"all training processes gone {took:.2f} s later")
    assert "parent_gone" in kinds and "stopped" in kinds, kinds
    saved = [e for e in events if e["type"] == "saved"]
    assert saved, kinds  # it stopped with a checkpoint, not by being killed
    _assert_intact(saved[-1])
    assert not (run_dir / ".rendezvous").exists()


# ---- two trainings at once --------------------------------------------------------------------
def _ports(processes: list[psutil.Process]) -> tuple[set[int], set[int]]:
    """(ports these processes listen on, remote ports they are connected to)."""
    listening, remote = set(), set()
    for p in processes:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.add(c.laddr.port)
                elif c.raddr:
                    remote.add(c.raddr.port)
        except psutil.NoSuchProcess:
            pass
    return listening, remote


@pytest.mark.slow
def test_two_trainings_at_once_share_no_port_run_dir_or_temp_file(fixture_paths, comfy_root, demo_cache):
    """Two 2-stage runs of the same LoRA name at once: separate everything, identical losses (same seed).

    Both train until each has done a few steps while the other is also training, then both are stopped
    (the stop file), so the overlap does not depend on how fast either starts on a loaded machine.
    """
    from pipetrainer.nodes.run import paths, run_process

    name = f"faults-twin-{secrets.token_hex(3)}"
    run_dirs = [Path(paths.new_run_dir(name)), Path(paths.new_run_dir(name))]
    assert run_dirs[0] != run_dirs[1]
    handles = []
    try:
        for run_dir in run_dirs:
            spec = make_spec(fixture_paths.mmdit, demo_cache.items, run_dir, comfy_root, steps=1000,
                             pipeline_stages=2, gradient_checkpointing=False)
            handles.append(run_process.launch(spec))
        ranks = [_rank_processes(h.proc.pid, 2) for h in handles]
        init = [{p.environ()["PIPETRAINER_INIT_METHOD"] for p in r.values()} for r in ranks]
        assert init[0] == {f"file://{run_dirs[0] / '.rendezvous'}"}
        assert init[1] == {f"file://{run_dirs[1] / '.rendezvous'}"}
        ports = [(set(), set()), (set(), set())]
        started, overlap_steps = time.monotonic(), None
        while any(h.proc.poll() is None for h in handles) and time.monotonic() - started < 600:
            for seen, r in zip(ports, ranks, strict=True):
                listening, remote = _ports(list(r.values()))
                seen[0].update(listening)
                seen[1].update(remote)
            steps = [losses(read_all(d)) for d in run_dirs]
            if overlap_steps is None and min(map(len, steps)) >= 3:
                overlap_steps = [len(s) for s in steps]
                for d in run_dirs:
                    stop_path(d).touch()
            time.sleep(0.2)
        codes = [run_process.follow(h, lambda e: None, lambda: False) for h in handles]
        (listen_a, remote_a), (listen_b, remote_b) = ports
        print(f"\ntwo concurrent 2-stage runs (both training at steps {overlap_steps}), {len(listen_a)} vs "
              f"{len(listen_b)} listening ports, none shared; both stopped {time.monotonic() - started:.1f} s after launch")
        assert overlap_steps, "the two runs were never training at the same time"
        assert codes == [run_process.EXIT_STOPPED] * 2, [run_process.failure_message(h) for h in handles]
        assert listen_a and listen_b
        assert not listen_a & listen_b and not remote_a & listen_b and not remote_b & listen_a
    finally:
        for h in handles:
            run_process.stop(h, grace_s=5)
    curves = [losses(read_all(d)) for d in run_dirs]
    common = min(map(len, curves))
    assert common >= 3 and curves[0][:common] == curves[1][:common]  # same seed, no cross-talk
    for run_dir in run_dirs:
        saved = [e for e in read_all(run_dir) if e["type"] == "saved"]
        assert saved and Path(saved[-1]["path"]).is_relative_to(run_dir), saved
        _assert_intact(saved[-1])
        assert not list(run_dir.rglob("*.tmp")) and not (run_dir / ".rendezvous").exists()
        shutil.rmtree(run_dir, ignore_errors=True)
