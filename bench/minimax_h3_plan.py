"""MiniMax-H3's stage split and memory plan on its real layout, from ComfyUI's config, without loading weights.

Builds ComfyUI's ``model_base.MiniMaxH3`` from its own ``supported_models.MiniMaxH3`` config on the meta
device (training/model/meta_model.py; no weights, no RAM), cuts it into the stage layers of
training/pipelines/minimax_h3.py and prints: the parameters (the published size is 33 B), the bytes per
layer, each stage's bytes for 1, 2, 4 and 8 pipeline stages (DeepSpeed's "parameters" split, reproduced
by training/offload/stages.py) with bf16 and fp8 base weights, and the ``blocks_to_swap`` the memory plan
(training/offload/memory_plan.py, through the Train node's own facts code nodes/checks/memory.py) picks on
a GPU with 24 GiB and one with 80 GiB free, at each stated clip size (``WIDTHxHEIGHTxFRAMES``; by default
the H3 nodes' own canvas, 1344x768 for 124 frames = 5 s, and a small 640x352 clip of the same length), LoRA rank
and preset (AdamW, bf16 compute, gradient checkpointing every block, batch 1: the Train node's defaults).

Needs the current ComfyUI (v0.33+, the first with MiniMax-H3); runs in seconds on a CPU::

    COMFYUI_PATH=.host/current/ComfyUI .host/current/venv/bin/python bench/minimax_h3_plan.py \\
        [--size 1344x768x124 --size 640x352x124] [--rank 16] [--targets attention_mlp] [--text-tokens 256]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _pack import PACK_DIR, import_pack

STAGE_COUNTS = (1, 2, 4, 8)
GPUS_GIB = (24, 80)
GB = 1e9


def _size(text: str) -> tuple[int, int, int]:
    try:
        width, height, frames = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHTxFRAMES, e.g. 1344x768x124") from None
    return width, height, frames


def build(weight: str):
    """(diffusion model, layout, layers with the engine's leading input slot) at the real config."""
    import torch
    from pipetrainer.training.model.meta_model import build_on_meta
    from pipetrainer.training.pipelines.minimax_h3 import MiniMaxH3Adapter

    dtypes = {"bf16": (torch.bfloat16, None), "fp8": (torch.float8_e4m3fn, torch.bfloat16)}
    model = build_on_meta("MiniMaxH3", {"image_model": "minimax_h3"}, *dtypes[weight])
    layout = MiniMaxH3Adapter()
    dm = model.diffusion_model
    return dm, layout, [None, *layout.stage_layers(dm)]


def plan_rows(layers, layout, dm, args, size: tuple[int, int, int]):
    """Tokens at ``size``, and per stage count: (boundaries, StageWeights per stage, plan per GPU size)."""
    from pipetrainer.nodes.checks.memory import hidden_width, stage_boundaries, stage_weights
    from pipetrainer.training.offload.memory_plan import GIB, GpuBudget, Workload, plan_blocks_to_swap
    from pipetrainer.training.spec.options import LoraSpec

    lora = LoraSpec(rank=args.rank, alpha=float(args.rank), targets=args.targets)
    regex = layout.lora_target_regex(args.targets)
    tokens = layout.tokens(dm, *size, args.text_tokens)
    rows = []
    for n in STAGE_COUNTS:
        bounds = stage_boundaries(layers, n, "parameters")
        held = stage_weights(layers, bounds, 2, regex, lora)
        work = Workload(tokens=tokens, hidden=hidden_width(layers), stages=n)
        plans = {g: plan_blocks_to_swap(held, [GpuBudget(f"{g} GiB GPU", g * GIB)] * n, work) for g in GPUS_GIB}
        rows.append((n, bounds, held, plans))
    return tokens, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", type=_size,
                        help="WIDTHxHEIGHTxFRAMES (frames at 24 fps, snapped up to 17k + 5); repeatable")
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="attention_mlp", choices=("attention", "attention_mlp", "all_linear"))
    args = parser.parse_args(argv)
    sizes = args.size or [(1344, 768, 124), (640, 352, 124)]
    import_pack()
    from pipetrainer.training.model.comfy_env import use_comfyui

    use_comfyui(Path(os.environ.get("COMFYUI_PATH", PACK_DIR / ".host" / "current" / "ComfyUI")), "cpu")
    from pipetrainer.nodes.checks.memory import tensor_bytes
    from pipetrainer.training.model.meta_model import parameter_count, stored_bytes

    for weight in ("bf16", "fp8"):
        dm, layout, layers = build(weight)
        layer_bytes = [sum(tensor_bytes(t, 2) for t in (*layer.parameters(), *layer.buffers())) for layer in layers[1:]]
        print(f"== MiniMax-H3, {weight} base weights (compute bf16) ==")
        if weight == "bf16":
            print(f"parameters {parameter_count(dm):,} ({parameter_count(dm) / 1e9:.2f} B); as built "
                  f"{stored_bytes(dm) / GB:.2f} GB (fp32 islands kept), as a rank holds it {sum(layer_bytes) / GB:.2f} GB")
        print(f"per layer: embed {layer_bytes[0] / GB:.3f} GB, each of {len(layer_bytes) - 2} blocks {layer_bytes[1] / GB:.3f} GB, "
              f"final {layer_bytes[-1] / GB:.3f} GB; total {sum(layer_bytes) / GB:.2f} GB")
        for i, size in enumerate(sizes):
            tokens, rows = plan_rows(layers, layout, dm, args, size)
            if i == 0:
                for n, bounds, held, _ in rows:
                    per = ", ".join(f"s{s}: {h.blocks} blocks {(sum(h.block_bytes) + h.rest_bytes) / GB:.2f} GB "
                                    f"(LoRA {h.lora_params / 1e6:.1f} M)"
                                    for s, h in enumerate(held))
                    print(f"{n} stage(s), layers {bounds}: {per}")
            print(f"plan at {size[0]}x{size[1]}, {size[2]} frames ({tokens:,} tokens), LoRA rank {args.rank} "
                  f"{args.targets}, AdamW:")
            for n, _, _, plans in rows:
                for g, plan in plans.items():
                    choice = plan.blocks_to_swap if plan.problem is None else "none fits"
                    worst = max(plan.stages, key=lambda f: f.need.total)
                    print(f"  {n} stage(s), {g} GiB: blocks_to_swap {choice} (largest stage need "
                          f"{worst.need.total / 2**30:.1f} GiB; without swap {worst.unswapped.total / 2**30:.1f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
