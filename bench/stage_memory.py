"""Benchmark: peak RSS per rank and for the whole machine, Flux-min trained with 1 and 2 pipeline stages.

Each rank materialises only its own stage (training/model/stage_weights.py); this prints what that buys in
host memory. Per rank: the peak RSS (``getrusage``, reported in its ``rank_done`` event), the RSS before
the model load (imports: the same in every rank) and the ratio to the 1-stage run's peak. Whole
machine: the sum of the ranks' peaks (an upper bound of what the ranks hold at once). The fixture is
built on the first run; ``--double-blocks`` / ``--single-blocks`` pick the layout (default 2 + 0, the
balanced Flux-min of tests/test_stage_memory.py; 1 + 1 is the plain Flux-min).

Measured 2026-12 on the 2-core CPU machine, fp32, 2 steps (peak RSS MB; x = over the 1-stage peak):

    layout   1 stage   2 stages: rank 0        rank 1         both
    1d + 1s  3741      2822 (0.75)             1657 (0.44)    4479 (1.20)   (issue #9, before)
    1d + 2s  4554      2826 (0.62)             2471 (0.54)    5297 (1.16)
    2d + 0s  4879      2827 (0.58)             2796 (0.57)    5623 (1.15)

    .venv/bin/python bench/stage_memory.py [--double-blocks 2] [--single-blocks 0] [--steps 2] [--workdir DIR]
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
from pipeline_cpu import build_items


def _flux_file(root: Path, double_blocks: int, single_blocks: int) -> Path:
    from pipetrainer.devkit.fixtures import build_min_flux

    path = root / "models" / "diffusion_models" / f"pipetrainer-min-flux-{double_blocks}d{single_blocks}s.safetensors"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.building")
        build_min_flux(tmp, single_blocks=single_blocks, double_blocks=double_blocks)
        tmp.replace(path)
    return path


def run_once(root: Path, model: Path, items, run_dir: Path, stages: int, steps: int) -> dict:
    from pipetrainer.training.model.fingerprint import file_fingerprint
    from pipetrainer.training.process.events import read_all
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec
    from pipetrainer.training.spec.run_spec import RunSpec

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = RunSpec(
        model=ModelRecipe("diffusion_model", str(model), "default", file_fingerprint(model)),
        items=tuple(items), lora=LoraSpec(rank=4, alpha=4.0, targets="attention"),
        optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.0),
        train=TrainSpec(steps=steps, seed=0, dtype="fp32", pipeline_stages=stages),
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
    done = {e["rank"]: e for e in events if e["type"] == "rank_done"}
    before = {e["rank"]: e for e in events if e["type"] == "rank_memory"}
    stage_bytes = {e["stage"]: e["local_bytes"] for e in events if e["type"] == "stage_memory"}
    setup = next(e for e in events if e["type"] == "setup")
    return {
        "stages": stages, "total_s": time.time() - started, "partition": setup["partition"],
        "ranks": [{"rank": r, "stage": done[r]["stage"], "peak_mb": done[r]["peak_rss_mb"],
                   "before_load_mb": before[r]["before_load_mb"],
                   "stage_share": stage_bytes[done[r]["stage"]] / sum(stage_bytes.values())} for r in sorted(done)],
        "losses": [e["loss"] for e in events if e["type"] == "step"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double-blocks", type=int, default=2)
    parser.add_argument("--single-blocks", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    import_pack()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pipetrainer-bench-"))
    root, _, items = build_items(workdir)
    model = _flux_file(root, args.double_blocks, args.single_blocks)
    print(f"Flux-min ({args.double_blocks} double + {args.single_blocks} single blocks), 64x64, LoRA rank 4 (attention), fp32, "
          f"{args.steps} steps")
    one = run_once(root, model, items, workdir / "stages1", 1, args.steps)
    two = run_once(root, model, items, workdir / "stages2", 2, args.steps)
    base = one["ranks"][0]["peak_mb"]
    print(f"{'stages':>6} {'rank':>4} {'stage':>5} {'share':>6} {'before load MB':>14} {'peak MB':>8} {'x 1-stage':>9}")
    for run in (one, two):
        for r in run["ranks"]:
            print(f"{run['stages']:>6} {r['rank']:>4} {r['stage']:>5} {r['stage_share']:>6.2f} "
                  f"{r['before_load_mb']:>14.0f} {r['peak_mb']:>8.0f} {r['peak_mb'] / base:>9.2f}")
        whole = sum(r["peak_mb"] for r in run["ranks"])
        print(f"{run['stages']:>6} {'all':>4} {'':>5} {'':>6} {'':>14} {whole:>8.0f} {whole / base:>9.2f}  "
              f"(partition {run['partition']}, {run['total_s']:.0f} s)")
    print(f"losses equal: {one['losses'] == two['losses']} ({one['losses']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
