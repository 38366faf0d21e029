"""Benchmark: CPU seconds per training step of every in-memory family row, in 1 and 2 pipeline stages.

The rows are the tiny models of tests/family_rows/ that tests/test_stage_split.py splits (ComfyUI's own config
classes at test size); each is trained ``--steps`` steps through DeepSpeed's pipeline engine on real gloo ranks
(LoRA rank 4 on the ``attention_mlp`` preset, SGD, batch 1, fp32), all rows in one start-up per stage count.
Printed per row: its parameters, and the median s/step after the first step for 1 and 2 stages. These are
figures for the fixtures, which are far from a real model's size: they show the per-step overhead of a family's
stage layers and of a stage boundary, not a real run's speed.

    COMFYUI_PATH=$PWD/.host/current/ComfyUI .host/current/venv/bin/python bench/family_steps.py [--rows A B] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from _pack import import_pack

TARGET = "pipetrainer.tests.test_stage_split:two_training_steps"


def _median_after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] or seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: every split row this ComfyUI has)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    import_pack()
    from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks
    from pipetrainer.tests.test_stage_split import SPLIT

    rows = args.rows or SPLIT
    os.environ.update(PIPETRAINER_SPLIT_ROWS=",".join(rows), PIPETRAINER_SPLIT_STEPS=str(args.steps))
    bounds = {"collective_timeout_s": 120.0, "run_timeout_s": 120.0 + 10.0 * args.steps * len(rows)}
    with tempfile.TemporaryDirectory() as tmp:
        (ones,) = run_on_gloo_ranks(TARGET, Path(tmp), world=1, **bounds)
        twos = run_on_gloo_ranks(TARGET, Path(tmp), world=2, **bounds)
    print(f"{'row':24} {'parameters':>11} {'1 stage s/step':>15} {'2 stages s/step':>16}")
    for name in rows:
        one, two = ones[name], twos[0][name]
        if "skipped" in one or "error" in one or "error" in two:
            reason = one.get("skipped") or "failed: " + (one.get("error") or two["error"]).strip().splitlines()[-1]
            print(f"{name:24} {reason}")
            continue
        # a 2-stage step ends when the last stage is done: the slower rank's time
        two_s = max(_median_after_first(two["seconds"]), _median_after_first(twos[1][name]["seconds"]))
        print(f"{name:24} {one['parameters']:>11,} {_median_after_first(one['seconds']):>15.4f} {two_s:>16.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
