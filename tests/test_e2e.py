"""End to end on the real ComfyUI server: the example workflow trains, saves and samples; Cancel stops cleanly."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
from PIL import Image
from pipetrainer.devkit.host import history_error, output_images
from pipetrainer.tests.ui_client import NodeTexts
from pipetrainer.training.process.events import read_all
from safetensors.torch import load_file

WORKFLOW = Path(__file__).resolve().parent.parent / "workflows" / "api" / "pipetrainer_tiny_mmdit.json"
TRAIN_NODE = "8"


def _workflow(lora_name: str, steps: int) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    prompt[TRAIN_NODE]["inputs"].update(lora_name=lora_name, steps=steps)
    prompt["14"]["inputs"]["filename_prefix"] = lora_name
    return prompt


def _with_stock_consumers(prompt: dict, prefix: str) -> dict:
    """Feed the Train node's LOSS_MAP and LORA_MODEL outputs to the stock LossGraphNode / LoraModelLoader."""
    prompt["15"] = {"class_type": "LossGraphNode", "inputs": {"loss": [TRAIN_NODE, 3], "filename_prefix": prefix}}
    prompt["16"] = {"class_type": "LoraModelLoader",
                    "inputs": {"model": ["1", 0], "lora": [TRAIN_NODE, 2], "strength_model": 1.0,
                                           "bypass": False}}  # required on current ComfyUI, ignored by 0.3.75
    prompt["17"] = {"class_type": "KSampler", "inputs": {**prompt["12"]["inputs"], "model": ["16", 0]}}
    prompt["18"] = {"class_type": "VAEDecode", "inputs": {"samples": ["17", 0], "vae": ["3", 0]}}
    prompt["19"] = {"class_type": "SaveImage", "inputs": {"images": ["18", 0], "filename_prefix": prefix + "_lmm"}}
    return prompt


def _sample_with_stock_loader(lora_file: str, strength: float, prefix: str) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    keep = {k: v for k, v in prompt.items() if k in {"1", "2", "3", "9", "10", "11", "12", "13", "14"}}
    keep["20"] = {"class_type": "LoraLoaderModelOnly",
                  "inputs": {"model": ["1", 0], "lora_name": lora_file, "strength_model": strength}}
    keep["12"]["inputs"]["model"] = ["20", 0]
    keep["14"]["inputs"]["filename_prefix"] = prefix
    return keep


def _run_dirs(comfy_root: Path, lora_name: str) -> list[Path]:
    return sorted((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{lora_name}-*"))


def _processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes of the run: named by their command line, or by the pids its events record (a
    pre-started supervisor and rank, nodes/run/warm_pool.py, were started before the run dir existed)."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in part for part in (p.info["cmdline"] or [])):
            found[p.pid] = p
    for event in read_all(run_dir) if run_dir.exists() else []:
        if event["type"] in ("launch", "warm_start"):
            try:
                process = psutil.Process(event["pid"])
                if process.status() != psutil.STATUS_ZOMBIE:
                    found[process.pid] = process
            except psutil.NoSuchProcess:
                pass
    return list(found.values())


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_workflow_trains_saves_and_samples_with_the_lora(server, comfy_root):
    name = f"e2e_{uuid.uuid4().hex[:6]}"
    entry = server.wait(server.queue(_with_stock_consumers(_workflow(name, steps=12), name)), timeout=600)
    assert history_error(entry) is None, server.log_tail()
    assert entry["outputs"]["15"]["images"], "the stock LossGraphNode plots our LOSS_MAP"
    lora_path = comfy_root / "models" / "loras" / f"{name}.safetensors"
    assert lora_path.exists()
    keys = load_file(str(lora_path))
    assert keys and all(k.startswith("diffusion_model.") for k in keys)
    [run_dir] = _run_dirs(comfy_root, name)
    assert [e["step"] for e in read_all(run_dir) if e["type"] == "step"] == list(range(1, 13))
    assert _processes_of(run_dir) == []
    trained_image, lora_model_image = output_images(entry, comfy_root)
    # The stock LoraModelLoader applies our LORA_MODEL output exactly like the Train node's MODEL output.
    assert np.array_equal(_pixels(trained_image), _pixels(lora_model_image))

    with_lora = server.wait(server.queue(_sample_with_stock_loader(lora_path.name, 1.0, name + "_s1")), 300)
    without = server.wait(server.queue(_sample_with_stock_loader(lora_path.name, 0.0, name + "_s0")), 300)
    assert history_error(with_lora) is None and history_error(without) is None
    assert "lora key not loaded" not in server.log_path.read_text(errors="replace")
    [stock_image] = output_images(with_lora, comfy_root)
    [base_image] = output_images(without, comfy_root)
    # The Train node's MODEL output and the stock LoraLoader apply the same file: the same image.
    assert np.array_equal(_pixels(trained_image), _pixels(stock_image))
    assert np.abs(_pixels(stock_image) - _pixels(base_image)).max() > 0


def test_cancel_stops_the_run_and_keeps_a_resumable_checkpoint(server, comfy_root, request):
    name = f"cancel_{uuid.uuid4().hex[:6]}"
    texts = NodeTexts(server).start()  # what the frontend draws on the Train node
    request.addfinalizer(texts.stop)
    first = _workflow(name, steps=100_000)
    first[TRAIN_NODE]["inputs"]["resume"] = True
    prompt_id = server.queue(first)
    deadline = time.monotonic() + 300
    run_dir = None
    while time.monotonic() < deadline:
        dirs = _run_dirs(comfy_root, name)
        if dirs and sum(e["type"] == "step" for e in read_all(dirs[0])) >= 3:
            run_dir = dirs[0]
            break
        time.sleep(0.5)
    assert run_dir is not None, server.log_tail()
    assert _processes_of(run_dir), "training should be running"
    cancelled_at = time.monotonic()
    server.interrupt()
    entry = server.wait(prompt_id, timeout=120)
    took = time.monotonic() - cancelled_at
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds, entry["status"]
    assert took < 60, took
    assert _processes_of(run_dir) == []
    events = read_all(run_dir)  # every line is complete JSON
    stopped = [e for e in events if e["type"] == "stopped"]
    saved = [e for e in events if e["type"] == "saved"]
    assert stopped and saved and saved[-1]["step"] == stopped[-1]["step"]
    assert Path(saved[-1]["checkpoint"]).is_dir()
    assert load_file(saved[-1]["path"])
    assert not (comfy_root / "models" / "loras" / f"{name}.safetensors").exists()
    assert not (run_dir / ".rendezvous").exists()
    stopped_at = stopped[-1]["step"]
    assert texts.of(TRAIN_NODE)[-1] == f"stopped at step {stopped_at}; checkpoint kept; queue again to resume"

    # Queue the same LoRA again: it resumes from the cancelled run's checkpoint and finishes.
    again = _workflow(name, steps=stopped_at + 3)
    again[TRAIN_NODE]["inputs"]["resume"] = True
    entry = server.wait(server.queue(again), timeout=600)
    assert history_error(entry) is None, server.log_tail()
    resumed_dir = [d for d in _run_dirs(comfy_root, name) if d != run_dir][0]
    events = read_all(resumed_dir)
    assert [e["resumed_step"] for e in events if e["type"] == "setup"] == [stopped_at]
    assert [e["step"] for e in events if e["type"] == "step"] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]
    assert (comfy_root / "models" / "loras" / f"{name}.safetensors").exists()
    shown = texts.of(TRAIN_NODE)
    assert f"resumed from step {stopped_at}; step {stopped_at}/{stopped_at + 3}: first step (warming up)" in shown
    assert any(t.startswith(f"step {stopped_at + 1}/{stopped_at + 3} ") and t.endswith(
        f"(resumed from step {stopped_at})") for t in shown), shown
    assert shown[-1].startswith(f"done: step {stopped_at + 3}/{stopped_at + 3}")
