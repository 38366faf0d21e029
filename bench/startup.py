"""Queue -> first training step, ours and ComfyUI's native trainer, in one real ComfyUI server.

Runs, in one server: PipeTrainer twice (the first run starts cold; the second is queued once the warm
tree the first one left has done its imports, as when a user looks at the result first, and takes it:
nodes/run/warm_pool.py), then ComfyUI's own TrainLoraNode twice, all on the bundled tiny MMDiT with the demo
dataset. "Queue -> first step" is, for PipeTrainer, the time of the first ``step`` event minus the time
the prompt was queued; for the native node (which reports no steps) it is the whole 2-step prompt
(load, encode, two steps, return; ComfyUI 0.3.75's node fails with one step), an overestimate of its
first step by about one step. Prints a table. Usage: ``.venv/bin/python bench/startup.py [--runs 2]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from _pack import PACK_DIR, import_pack


def _train_only(workflow: dict, lora_name: str, steps: int) -> dict:
    """The example's training nodes (1-8) with a fresh LoRA name: nothing sampled afterwards."""
    prompt = {key: json.loads(json.dumps(node)) for key, node in workflow.items() if int(key) <= 8}
    prompt["8"]["inputs"].update(lora_name=lora_name, steps=steps, resume=False)
    return prompt


def _native(workflow: dict, seed: int) -> dict:
    """ComfyUI's own dataset nodes and TrainLoraNode on the same model, images and captions (two steps)."""
    loaders = {k: workflow[k] for k in ("2", "3")}
    return {
        **loaders,
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": workflow["1"]["inputs"]["unet_name"],
                                                      "weight_dtype": "default"}},
        "30": {"class_type": "LoadImageTextDataSetFromFolder",
               "inputs": {"folder": workflow["4"]["inputs"]["folder"]}},
        "31": {"class_type": "MakeTrainingDataset",
               "inputs": {"images": ["30", 0], "texts": ["30", 1], "vae": ["3", 0], "clip": ["2", 0]}},
        "32": {"class_type": "TrainLoraNode", "inputs": {
            "model": ["1", 0], "latents": ["31", 0], "positive": ["31", 1], "batch_size": 1,
            "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 0.0005, "rank": 8, "optimizer": "AdamW",
            "loss_function": "MSE", "seed": seed, "training_dtype": "bf16", "lora_dtype": "bf16",
            "algorithm": "LoRA", "gradient_checkpointing": True, "existing_lora": "[None]"}},
        "33": {"class_type": "LossGraphNode", "inputs": {"loss": ["32", 2], "filename_prefix": f"startup_native_{seed}"}},
    }


def _wait_for_warm_rank(folder, timeout_s: float = 90.0) -> float:
    """Seconds until the newest warm rank in ``folder`` reports its imports done (or the timeout)."""
    from pipetrainer.training.process.warm_rank import READY

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        logs = sorted(folder.glob("warm-rank-*.log"), key=lambda p: p.stat().st_mtime)
        if logs and READY in logs[-1].read_text(errors="replace"):
            break
        time.sleep(0.2)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each trainer in the one server")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import_pack()
    from pipetrainer.devkit.fixtures import ensure_fixtures
    from pipetrainer.devkit.host import ComfyServer, ensure_host, history_error
    from pipetrainer.training.model.comfy_env import use_comfyui
    from pipetrainer.training.process.events import read_all

    root = ensure_host()
    use_comfyui(root)
    ensure_fixtures(root)
    workflow = json.loads((PACK_DIR / "workflows" / "api" / "pipetrainer_tiny_mmdit.json").read_text())
    rows = []
    with ComfyServer(root, PACK_DIR / ".host" / "bench-startup.log") as server:
        for run in range(args.runs):
            name = f"startup_{uuid.uuid4().hex[:6]}"
            if run:  # as a user looking at the result would: the warm tree finishes its imports meanwhile
                waited = _wait_for_warm_rank(root / "output" / "pipetrainer" / "runs" / ".warm")
                print(f"(waited {waited:.1f} s for the warm rank's imports before run {run + 1})", flush=True)
            queued = time.time()
            entry = server.wait(server.queue(_train_only(workflow, name, args.steps)), 600)
            done = time.time()
            if history_error(entry):
                print(f"PipeTrainer run {run + 1} failed: {history_error(entry)}")
                return 1
            run_dir = max((root / "output" / "pipetrainer" / "runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
            events = read_all(run_dir)
            first = next(e["time"] for e in events if e["type"] == "step")
            warm = any(e["type"] == "warm_start" for e in events)
            rows.append(("PipeTrainer", run + 1, "warm" if warm else "cold", first - queued, done - queued))
            print(rows[-1], flush=True)
        for run in range(args.runs):
            queued = time.time()
            entry = server.wait(server.queue(_native(workflow, seed=run)), 600)
            done = time.time()
            if history_error(entry):
                print(f"native run {run + 1} failed: {history_error(entry)}")
                return 1
            rows.append(("ComfyUI TrainLoraNode", run + 1, "in-process", done - queued, done - queued))
    print(f"{'trainer':<22} {'run':>3}  {'start':<10} {'queue->first step s':>20} {'queue->done s':>14}")
    for trainer, run, start, first, total in rows:
        print(f"{trainer:<22} {run:>3}  {start:<10} {first:>20.2f} {total:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
