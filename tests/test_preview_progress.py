"""Previews never stall the progress display: while ComfyUI renders a preview, the Train node goes on forwarding
the run's steps, and due previews that a newer one overtook are reported, not dropped in silence.

The Train node's own ``execute`` runs with the real tiny model, CLIP and VAE and the real preview path
(held weights reloaded, stock LoRA loader, KSampler, VAEDecode); only the training tree is a stand-in
process that writes the events a rank writes (steps, ``saved`` LoRA files). The first preview is made slow
by a wrapper around the stock render (``nodes.run.previews.render``) that waits until the node has forwarded
the run's last step: if the node forwards nothing while a preview renders, the wait times out. Cancel and a
failing run while a preview renders must end the node promptly, with the graph's MODEL and ComfyUI's
progress hook as they were.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from pipetrainer.training.process.events import read_all
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec
from safetensors.torch import save_file

STEPS = 8
WAIT_S = 20.0  # how long the slow preview waits for the node to forward the last step
THREAD = "PipeTrainer previews"

# The training tree's stand-in: a rank's events, written to events.jsonl as the ranks write them.
STANDIN = r"""
import json, os, shutil, sys, time
run_dir, lora, final, total, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
events, started, stop = (os.path.join(run_dir, n) for n in ("events.jsonl", "render_started", "STOP"))

def emit(*records):  # one write: lines written together are read together
    data = "".join(json.dumps({"time": time.time(), "source": "rank0", **r}) + "\n" for r in records)
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, data.encode())
    os.close(fd)

def step(n):
    return {"type": "step", "step": n, "total": total, "loss": 1.0 / n, "lr": 1e-3, "it_s": 2.0,
            "eta_s": float(total - n), "step_time": 0.5}

def saved(n, path, final=False):
    return {"type": "saved", "step": n, "path": path, "final": final,
            "checkpoint": os.path.join(run_dir, "checkpoints", "step%d" % n)}

def wait_for(path, seconds):
    deadline = time.time() + seconds
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)

emit({"type": "phase", "phase": "first_step", "text": "step 0/%d" % total, "resumed_from": 0})
emit(step(1))
emit(step(2), saved(2, lora))
wait_for(started, 60)  # the step-2 preview is rendering from here on
last = total if mode == "finish" else 5
for n in range(3, last):
    time.sleep(0.05)
    emit(step(n), *([saved(n, lora)] if n % 2 == 0 else []))
if mode == "finish":
    shutil.copyfile(lora, final)
    emit(step(total), saved(total, final, final=True))
    time.sleep(1.0)  # a supervisor takes a moment to exit after the last save
    sys.exit(0)
if mode == "fail":  # a rank fails while the preview renders
    emit({"type": "error", "rank": 0, "message": "a rank failed"})
    open(os.path.join(run_dir, "exited"), "w").close()
    sys.exit(1)
if wait_for(stop, 60):  # Cancel: the ranks checkpoint and stop
    emit(saved(last - 1, lora), {"type": "stopped", "step": last - 1})
    sys.exit(3)
sys.exit(1)
"""


def _random_lora(model_patcher, path: Path) -> Path:
    """A LoRA in the pack's file format on two attention/MLP Linears of the model (random values)."""
    g = torch.Generator().manual_seed(0)
    linears = [(name, w) for name, w in model_patcher.model.diffusion_model.state_dict().items()
               if name.endswith(".weight") and w.ndim == 2 and "joint_blocks" in name][:2]
    tensors = {}
    for name, weight in linears:
        key = "diffusion_model." + name[: -len(".weight")]
        tensors[f"{key}.lora_A.weight"] = torch.randn(4, weight.shape[1], generator=g) * 0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(weight.shape[0], 4, generator=g) * 0.5
        tensors[f"{key}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(path))
    return path


def _run_train_node(fixture_paths, demo_cache, encoders, tmp_path: Path, mode: str, cancel_at: int | None = None):
    """Queue the Train node against the stand-in tree; return what the node showed and did."""
    import comfy.model_management
    import comfy.utils
    from pipetrainer.nodes import train
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel
    from pipetrainer.nodes.preview_settings import PreviewSettings
    from pipetrainer.nodes.run import paths, previews, run_process
    from pipetrainer.training.process.events import EventReader

    model = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]
    lora = _random_lora(model, tmp_path / "step.safetensors")
    vae, clip = encoders
    settings = PreviewSettings(clip=clip, vae=vae, prompts=("a red circle",), width=64, height=64, steps=2,
                               seed=1, every_n_steps=2)
    name = f"prevprog_{mode}_{tmp_path.name[-6:]}".replace("-", "_")
    rec: dict = {"texts": [], "bar": [], "model": model, "name": name}
    reached = threading.Event()
    cancelled = threading.Event()

    def hook(value, total, preview, prompt_id=None, node_id=None):  # ComfyUI's progress hook, recorded
        if total == STEPS:  # the Train node's bar (a sampler's bar counts its own steps)
            rec["bar"].append(value)  # (current ComfyUI throttles the bar: the last step always comes)
            if value >= STEPS:
                reached.set()

    def show_text(text, node_id):  # the node's progress text, recorded
        rec["texts"].append(text)
        if cancel_at is not None and f"step {cancel_at}/{STEPS}" in text and not cancelled.is_set():
            cancelled.set()  # the user presses Cancel while the preview renders
            rec["cancelled_at"] = time.monotonic()
            comfy.model_management.interrupt_current_processing(True)

    def launch(spec, pool=None, notes=()):  # the training tree: the stand-in
        rec["run_dir"] = Path(spec.run_dir)
        (rec["run_dir"] / "logs").mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", STANDIN, spec.run_dir, str(lora), spec.lora_output,
                                 str(STEPS), mode], start_new_session=True)
        return run_process.RunHandle(spec, proc, EventReader(spec.run_dir))

    real_render = previews.render

    def slow_render(model, positive, negative, settings):  # the stock render, the first one made slow
        if "render" not in rec:
            rec["render"] = {"thread": threading.current_thread().name}
            (rec["run_dir"] / "render_started").touch()
            if mode == "finish":  # the node must forward the run's last step while this preview renders
                rec["render"]["progressed"] = reached.wait(WAIT_S)
                time.sleep(0.5)  # two polls: the final save, written with the last step, reaches the node
            elif mode == "fail":  # the run fails while this preview renders; the node gives the render up
                exited = rec["run_dir"] / "exited"
                deadline = time.monotonic() + WAIT_S
                while not exited.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                rec["render"]["progressed"] = exited.exists()
                time.sleep(1.0)  # the node sees the exit at its next poll
            else:  # Cancel comes while this preview renders; the stock sampler meets it
                rec["render"]["progressed"] = cancelled.wait(WAIT_S)
            rec["render"]["texts"] = list(rec["texts"])
            rec["render"]["bar"] = list(rec["bar"])
        return real_render(model, positive, negative, settings)

    mp = pytest.MonkeyPatch()
    mp.setattr(comfy.utils, "PROGRESS_BAR_HOOK", hook)
    mp.setattr(train, "show_text", show_text)
    mp.setattr(run_process, "launch", launch)
    mp.setattr(previews, "render", slow_render)
    mp.setattr(train.WARM_POOL, "enabled", False)
    start = time.monotonic()
    try:
        rec["out"] = train.PipeTrainerTrain.execute(
            model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(lr=1e-3, weight_decay=0.0), name,
            steps=STEPS, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
            gradient_checkpointing=False, pipeline_stages=1, partition_method="parameters", resume=False,
            previews=settings)
    except BaseException as exc:  # noqa: BLE001 - the cancel case asserts on it
        rec["error"] = exc
    finally:
        rec["seconds"] = time.monotonic() - start
        rec["hook_after"] = comfy.utils.PROGRESS_BAR_HOOK
        rec["hook"] = hook
        rec["workers"] = [t.name for t in threading.enumerate() if t.name == THREAD]
        rec["flag"] = comfy.model_management.processing_interrupted()
        comfy.model_management.interrupt_current_processing(False)
        mp.undo()
        if "run_dir" in rec:
            rec["events"] = read_all(rec["run_dir"])
            log = rec["run_dir"] / "logs" / "previews.log"
            rec["log"] = log.read_text() if log.exists() else ""
            shutil.rmtree(rec["run_dir"], ignore_errors=True)
        Path(paths.lora_output_path(name)).unlink(missing_ok=True)
        shutil.rmtree(paths.step_loras_dir(name), ignore_errors=True)
    return rec


@pytest.fixture(scope="module")
def finished_run(fixture_paths, demo_cache, encoders, tmp_path_factory):
    return _run_train_node(fixture_paths, demo_cache, encoders, tmp_path_factory.mktemp("finish"), "finish")


def test_progress_advances_while_a_preview_renders(finished_run):
    rec = finished_run
    assert "error" not in rec, rec.get("error")
    during = rec["render"]
    assert during["progressed"], (
        f"the Train node forwarded no step while the step-2 preview rendered: its bar stood at "
        f"{during['bar'][-1:]} and its text at {during['texts'][-1:]}")
    assert max(during["bar"]) == STEPS
    # The node's text kept the run's step and ETA, with one line for the preview under it.
    assert any(f"step {STEPS}/{STEPS}" in t and "ETA" in t and "rendering previews of step 2" in t
               for t in during["texts"]), during["texts"][-3:]
    assert during["thread"] == THREAD  # rendered off the node thread
    # The render was ComfyUI's and complete: the step-2 preview exists and is in the run log.
    assert [e["step"] for e in rec["events"] if e["type"] == "preview"] == [2, STEPS]
    assert "step 2 rendered: step_2_0.png" in rec["log"] and f"step {STEPS} rendered" in rec["log"]
    # Nothing of the worker outlives the node: no thread, ComfyUI's own progress hook again.
    assert rec["workers"] == [] and rec["hook_after"] is rec["hook"]
    assert rec["out"].result[0].patches  # the trained MODEL came back with the LoRA on it


def test_skipped_previews_are_reported_on_the_node_and_in_the_run_log(finished_run):
    rec = finished_run
    assert "error" not in rec, rec.get("error")
    sentence = f"steps 4, 6 skipped: the step-{STEPS} preview was already due"
    assert any(sentence in t for t in rec["texts"]), rec["texts"][-5:]
    assert sentence in rec["log"]
    skipped = [e for e in rec["events"] if e["type"] == "preview_skipped"]
    assert [(e["step"], e["due"], e["message"]) for e in skipped] == [
        (4, STEPS, f"step 4 skipped: the step-{STEPS} preview was already due"),
        (6, STEPS, f"step 6 skipped: the step-{STEPS} preview was already due")]
    done = rec["texts"][-1]
    assert done.startswith("done:") and f"previews: step {STEPS} (1 image in" in done
    assert "previews skipped: 2 (steps 4, 6: training outran the renders" in done


def test_cancel_while_a_preview_renders_stops_the_node_promptly(fixture_paths, demo_cache, encoders, tmp_path):
    import comfy.model_management
    from pipetrainer.training.model.stage_weights import resident_bytes

    rec = _run_train_node(fixture_paths, demo_cache, encoders, tmp_path, "until_stop", cancel_at=4)
    assert isinstance(rec.get("error"), comfy.model_management.InterruptProcessingException), rec.get("error")
    assert rec["render"]["progressed"], "Cancel never came: the node forwarded no step while the preview rendered"
    assert time.monotonic() - rec["cancelled_at"] < 15.0  # the stand-in stops at once; the render is given up
    assert rec["texts"][-1].startswith("stopped at step 4; checkpoint kept")
    assert not [e for e in rec["events"] if e["type"] == "preview"]  # the render was given up, not finished
    assert rec["workers"] == [] and rec["hook_after"] is rec["hook"]
    assert resident_bytes(rec["model"].model.diffusion_model) > 0  # the graph's MODEL has its weights back


def test_a_run_that_fails_while_a_preview_renders_gives_the_render_up(fixture_paths, demo_cache, encoders,
                                                                       tmp_path):
    from pipetrainer.nodes.run.run_process import TrainingFailed
    from pipetrainer.training.model.stage_weights import resident_bytes

    rec = _run_train_node(fixture_paths, demo_cache, encoders, tmp_path, "fail")
    assert isinstance(rec.get("error"), TrainingFailed) and "a rank failed" in str(rec["error"]), rec.get("error")
    assert rec["render"]["progressed"] and rec["render"]["thread"] == THREAD
    assert rec["texts"][-1].startswith("failed: see the error")
    # The render stopped at its first sampler step: no preview, the log says so, nothing of it is left.
    assert not [e for e in rec["events"] if e["type"] == "preview"]
    assert "preview of step 2 abandoned: the run stopped before it was rendered" in rec["log"]
    assert rec["workers"] == [] and rec["hook_after"] is rec["hook"] and not rec["flag"]
    assert resident_bytes(rec["model"].model.diffusion_model) > 0  # the graph's MODEL has its weights back

