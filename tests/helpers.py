"""Test helpers: build a run spec for the tiny MMDiT and run the real training process tree."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from pipetrainer.training.model.fingerprint import file_fingerprint
from pipetrainer.training.process.events import read_all
from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec
from pipetrainer.training.spec.run_spec import RunSpec

PACK_DIR = Path(__file__).resolve().parent.parent
ENTRY = PACK_DIR / "training" / "process" / "entry.py"


def make_spec(model_path: Path, items, run_dir: Path, comfy_root: Path, **train) -> RunSpec:
    lora = train.pop("lora", LoraSpec(rank=8, alpha=8.0))
    optimizer = train.pop("optimizer", OptimizerSpec(lr=1e-3, weight_decay=0.0))
    extra = {k: train.pop(k) for k in ("resume_from", "parent_pid") if k in train}
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunSpec(
        model=ModelRecipe("diffusion_model", str(model_path), "default", file_fingerprint(model_path)),
        items=tuple(items), lora=lora, optimizer=optimizer,
        train=TrainSpec(**{"steps": 10, "seed": 0, "dtype": "fp32", **train}),
        run_dir=str(run_dir), lora_output=str(run_dir / "lora.safetensors"), comfyui_path=str(comfy_root),
        **extra,
    ).validated()


def train_min_flux(model_path: Path, items, run_dir: Path, comfy_root: Path, stages: int) -> tuple[RunSpec, list[dict]]:
    """Three steps of a Flux-min fixture through the real process tree (attention LoRA, fp32); asserts success."""
    spec = make_spec(model_path, items, run_dir, comfy_root, steps=3, pipeline_stages=stages,
                     lora=LoraSpec(rank=4, alpha=4.0, targets="attention"))
    code, events = run_training(spec, timeout=900)
    assert code == 0, [e for e in events if e["type"] == "error"]
    return spec, events


def with_changes(spec: RunSpec, **changes) -> RunSpec:
    return dataclasses.replace(spec, **changes)


def run_training(spec: RunSpec, timeout: float = 600) -> tuple[int, list[dict]]:
    """Run the supervisor to completion; return its exit code and the run's events."""
    path = Path(spec.run_dir) / "spec.json"
    path.write_text(spec.to_json())
    proc = subprocess.run([sys.executable, str(ENTRY), "supervise", str(path)], timeout=timeout,
                          capture_output=True, text=True, env={**os.environ})
    return proc.returncode, read_all(spec.run_dir)


def losses(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["type"] == "step"]


class BatchCapture:
    """A real family adapter that keeps the batches its first stage is handed (every other call goes
    to the adapter), so a test sees what the data pipeline assembled."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.batches = []

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def first_stage_inputs(self, batch):
        self.batches.append(batch)
        return self.adapter.first_stage_inputs(batch)
