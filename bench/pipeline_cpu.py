"""Benchmark: seconds per step for 1 vs N pipeline stages on CPU ranks, and peak RSS per rank.

Trains the tiny MMDiT fixture on the demo dataset through the real process tree (supervisor +
DeepSpeed CPU ranks over gloo). The first step of each run pays one-off costs and is left out of
s/step; start-up (process start to first step) is printed separately. Each rank reports its peak
RSS (``getrusage``) in its ``rank_done`` event. On a shared 2-core machine the figures are noisy.

    .venv/bin/python bench/pipeline_cpu.py [--stages 1 2] [--steps 20] [--grad-accum 4] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _pack import PACK_DIR, import_pack


def build_items(workdir: Path):
    """Cache the demo dataset at 64 px with the tiny VAE and CLIP (ComfyUI's own loaders)."""
    from pipetrainer.devkit.fixtures import ensure_fixtures
    from pipetrainer.devkit.host import ensure_host
    from pipetrainer.training.model.comfy_env import use_comfyui

    root = ensure_host()
    use_comfyui(root, "cpu")
    import comfy.sd
    import comfy.utils
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    fixtures = ensure_fixtures(root)
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixtures.vae)))
    clip = comfy.sd.load_clip([str(fixtures.clip)], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    items = build_cache(scan_dataset(fixtures.dataset, 64), vae, clip, workdir / "cache").items
    return root, fixtures, items


def run_once(root: Path, fixtures, items, run_dir: Path, stages: int, steps: int, grad_accum: int) -> dict:
    from pipetrainer.training.model.fingerprint import file_fingerprint
    from pipetrainer.training.process.events import read_all
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec
    from pipetrainer.training.spec.run_spec import RunSpec

    shutil.rmtree(run_dir, ignore_errors=True)  # events.jsonl is append-only: start each run clean
    run_dir.mkdir(parents=True)
    spec = RunSpec(
        model=ModelRecipe("diffusion_model", str(fixtures.mmdit), "default", file_fingerprint(fixtures.mmdit)),
        items=tuple(items), lora=LoraSpec(rank=8, alpha=8.0), optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.0),
        train=TrainSpec(steps=steps, grad_accum=grad_accum, seed=0, dtype="fp32", pipeline_stages=stages),
        run_dir=str(run_dir), lora_output=str(run_dir / "lora.safetensors"), comfyui_path=str(root),
    ).validated()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(spec.to_json())
    started = time.time()
    proc = subprocess.run([sys.executable, str(PACK_DIR / "training" / "process" / "entry.py"), "supervise", str(spec_path)],
                          capture_output=True, text=True)
    events = read_all(run_dir)
    if proc.returncode != 0:
        raise RuntimeError(f"{stages}-stage run failed: {[e for e in events if e['type'] in ('error', 'failed')]}")
    step_events = [e for e in events if e["type"] == "step"]
    done = sorted((e for e in events if e["type"] == "rank_done"), key=lambda e: e["rank"])
    times = [e["step_time"] for e in step_events[1:]] or [e["step_time"] for e in step_events]
    return {
        "stages": stages,
        "s_per_step": sum(times) / len(times),
        "startup_s": step_events[0]["time"] - started - step_events[0]["step_time"],
        "total_s": time.time() - started,
        "peak_rss_mb": [round(e["peak_rss_mb"]) for e in done],
        "final_loss": step_events[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (fills the pipeline)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    import_pack()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pipetrainer-bench-"))
    root, fixtures, items = build_items(workdir)
    print(f"tiny MMDiT (9.4M params), 64x64, LoRA rank 8, fp32, {args.steps} steps x {args.grad_accum} micro-batches")
    print(f"{'stages':>6} {'s/step':>8} {'startup s':>10} {'total s':>8}  peak RSS per rank (MB)")
    for stages in args.stages:
        r = run_once(root, fixtures, items, workdir / f"stages{stages}", stages, args.steps, args.grad_accum)
        print(f"{r['stages']:>6} {r['s_per_step']:>8.3f} {r['startup_s']:>10.1f} {r['total_s']:>8.1f}  "
              f"{r['peak_rss_mb']}  (final loss {r['final_loss']:.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
