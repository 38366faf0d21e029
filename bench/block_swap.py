"""Benchmark: block swap's cost (s/step) and, on CUDA, its saving (peak GPU memory) on the tiny MMDiT.

Runs one pipeline stage's work in this process, as a rank does it: the family's stage layers with PEFT
LoRA, each layer under torch's non-reentrant activation checkpoint, then AdamW on the LoRA. No DeepSpeed
is needed, so it also runs on a GPU machine that only has torch, peft and a ComfyUI tree. Compares
``blocks_to_swap`` = 0 with all blocks but one swapped. On CPU it prints the hooks' overhead only and
says that the GPU figures were skipped. The first steps warm up and are left out.

    .venv/bin/python bench/block_swap.py [--steps 20] [--warmup 3] [--resolution 64] [--device auto]
                                         [--comfyui DIR --model FILE]  (a GPU machine without the dev host)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

from _pack import import_pack


def build_stage(device, model_path: Path):
    """The tiny MMDiT's stage layers on ``device`` with LoRA (rank 8, attention + MLP) and their optimizer."""
    import comfy.sd
    import torch
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import LoraSpec

    adapter = adapter_for("SD3")
    dm = comfy.sd.load_diffusion_model(str(model_path)).model.diffusion_model
    layers = adapter.stage_layers(dm)
    inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex("attention_mlp"), LoraSpec(rank=8), 0)
    params = [p for layer in layers for p in freeze_all_but_lora(layer)]
    for layer in layers:
        layer.to(device)
    return adapter, layers, torch.optim.AdamW(params, lr=1e-4)


def step(adapter, layers, optimizer, device, resolution: int) -> None:
    import torch
    import torch.utils.checkpoint
    from pipetrainer.training.pipelines.base import Batch

    g = torch.Generator().manual_seed(0)
    side = resolution // 8
    x = torch.randn(1, 16, side, side, generator=g).to(device)
    cond = torch.randn(1, 77, 768, generator=g).to(device)
    pooled = torch.randn(1, 768, generator=g).to(device)
    out = tuple(t.detach().requires_grad_(t.is_floating_point())
                for t in adapter.first_stage_inputs(Batch(x, torch.tensor([0.5], device=device), cond, pooled,
                                                         options=adapter.options_type())))
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for layer in layers:
        out = checkpoint(layer, out)
    (out.float() ** 2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(device, model_path: Path, blocks_to_swap: int, steps: int, warmup: int, resolution: int) -> dict:
    import torch
    from pipetrainer.training.offload.block_swap import swap_last_blocks

    adapter, layers, optimizer = build_stage(device, model_path)
    swapper = swap_last_blocks(layers, blocks_to_swap, device)
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + steps):
        if cuda and i == warmup:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step(adapter, layers, optimizer, device, resolution)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    result = {"blocks_to_swap": blocks_to_swap, "s_per_step": statistics.median(times), "best_s": min(times),
              "loads": swapper.loads if swapper else 0,
              "host": swapper.host_bytes() if swapper else (0, 0)}  # (pinned, weight) bytes, flat buffers
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["resident_gib"] = torch.cuda.memory_allocated(device) / 2**30
    if swapper:
        swapper.detach()
    return result


def _dev_host() -> Path:
    from pipetrainer.devkit.host import ensure_host

    return ensure_host()


def _dev_mmdit(root: Path) -> Path:
    from pipetrainer.devkit.fixtures import ensure_fixtures

    return ensure_fixtures(root).mmdit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--comfyui", type=Path, default=None,
                        help="a ComfyUI tree (default: the dev host, set up if missing)")
    parser.add_argument("--model", type=Path, default=None,
                        help="the tiny MMDiT file (default: the dev fixture, built if missing); only it is needed")
    args = parser.parse_args(argv)
    import_pack()
    import torch
    from pipetrainer.training.model.comfy_env import use_comfyui

    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    torch.set_num_threads(1)
    root = args.comfyui or _dev_host()
    use_comfyui(root, device.type)
    model_path = args.model or _dev_mmdit(root)
    blocks = 4  # joint blocks of the tiny MMDiT fixture
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    if device.type != "cuda":
        print("no CUDA device: skipped GPU figures (peak GPU memory); CPU s/step shows the hooks' overhead")
    rows = [measure(device, model_path, n, args.steps, args.warmup, args.resolution) for n in (0, blocks - 1)]
    for r in rows:
        line = (f"blocks_to_swap={r['blocks_to_swap']}: {r['s_per_step']:.4f} s/step (median, best "
                f"{r['best_s']:.4f}), {r['loads']} block loads")
        if "peak_gib" in r:
            line += f", peak GPU {r['peak_gib'] * 1024:.1f} MiB, after step {r['resident_gib'] * 1024:.1f} MiB"
        if r["blocks_to_swap"]:
            pinned, weights = r["host"]
            line += f", host copies pinned {pinned / 2**20:.2f} MiB for {weights / 2**20:.2f} MiB of weights"
        print(line)
    base, swap = rows
    print(f"overhead: {swap['s_per_step'] / base['s_per_step']:.2f}x s/step with {blocks - 1} of {blocks} blocks swapped")
    if "peak_gib" in base:
        print(f"peak GPU memory: {(base['peak_gib'] - swap['peak_gib']) * 1024:.1f} MiB less with block swap")


if __name__ == "__main__":
    main()
