"""Attention benchmark: PyTorch SDPA against flash-attn, training the same model the same way on one GPU.

For a CUDA machine with flash-attn installed. ComfyUI binds its attention function when its model code
is imported, so each backend trains in its own fresh process, chosen the way the training process
chooses it: the launch settings (``--use-pytorch-cross-attention`` / ``--use-flash-attention``) through
``training.launch_settings.plan_rank_args`` and ``training.comfy_env.use_comfyui``, plus the flash op's
backward (``patches.comfy_flash_backward``). Each child replays the model like a rank
(``training.model_source.load_model``, bf16), builds the family's stage layers with the trainer's LoRA
injection, and trains a fixed batch with the same seed under torch's non-reentrant activation
checkpoint. The table shows s/step (median after the first step), peak GPU memory and the loss curve;
the run fails when the curves disagree by more than bf16 tolerance.

    python bench/attention.py                         # dev host; tiny MMDiT at 512 px (1024 image tokens)
    python bench/attention.py --model flux --flux FILE --comfyui DIR     # wider heads (128), 3072 wide
    python bench/attention.py --device cpu            # dry run of the harness: SDPA only, a few steps

Without a CUDA device it says so and measures nothing (exit 0).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _pack import import_pack
from gpu_smoke import model_file, train_step

BACKENDS = ("pytorch", "flash")
EXPECTED_FUNCTION = {"pytorch": "attention_pytorch", "flash": "attention_flash"}
FIRST_STEP_RTOL = 1e-2  # one forward in bf16: attention kernels round differently (bf16 eps = 2**-8)
CURVE_RTOL = 5e-2  # after some steps the LoRA weights themselves differ by that rounding
LEARNING_RATES = {"mmdit": 1e-3, "flux": 1e-4}


@dataclass
class Result:
    backend: str
    function: str = ""
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_mib: float | None = None
    error: str = ""


def fixed_batch(model, adapter, device, resolution: int, seed: int = 0):
    """First-stage inputs and the flow target of one batch (``resolution`` px, 77 tokens), in the compute dtype."""
    import torch
    from pipetrainer.training.pipelines.base import Batch

    dm = model.diffusion_model
    context_dim, pooled_dim = adapter.conditioning_dims(dm)
    side = resolution // 8
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 16, side, side, generator=g)
    noise = torch.randn(1, 16, side, side, generator=g)
    cond = torch.randn(1, 77, context_dim, generator=g)
    pooled = torch.randn(1, pooled_dim, generator=g) if pooled_dim else None
    sigma = torch.tensor([0.6])
    ms = model.model_sampling
    noisy = ms.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
    dtype = model.manual_cast_dtype or model.get_dtype()
    inputs = adapter.first_stage_inputs(Batch(noisy.to(dtype), ms.timestep(sigma).float(), cond.to(dtype),
                                              None if pooled is None else pooled.to(dtype), options=adapter.options_type()))
    return tuple(t.to(device) for t in inputs), (noise - x0).to(device)


def train_child(backend: str, comfyui: Path, model_path: Path, device_name: str, steps: int, resolution: int,
                lr: float) -> Result:
    """One backend in this (fresh) process; the result holds losses, timings and the attention function."""
    import torch
    import torch.utils.checkpoint
    from pipetrainer.training.model.comfy_env import attention_in_use, use_comfyui
    from pipetrainer.training.model.launch_settings import LaunchSettings, plan_rank_args

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    plan = plan_rank_args(LaunchSettings(attention=backend), device=device.type, train_dtype="bf16",
                          flash_installed=importlib.util.find_spec("flash_attn") is not None,
                          capability=torch.cuda.get_device_capability(device) if cuda else None)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    use_comfyui(comfyui, device.type, plan.comfy_args)
    if plan.attention == "flash":
        from pipetrainer.patches.comfy_flash_backward import enable_flash_attention_backward

        enable_flash_attention_backward()
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe

    result = Result(backend, function=attention_in_use())
    torch.manual_seed(0)
    patcher = load_model(ModelRecipe("diffusion_model", str(model_path)), "bf16")
    model = patcher.model
    adapter = adapter_for(family_name_for(model))
    layers = adapter.stage_layers(model.diffusion_model)
    stage = torch.nn.ModuleList(layers).to(device)  # the engine moves the stage, then injects
    lora = LoraSpec(rank=16, alpha=16.0, targets="attention_mlp")
    inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex(lora.targets), lora, seed=0)
    params = freeze_all_but_lora(stage)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    inputs, target = fixed_batch(model, adapter, device, resolution)
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        t0 = time.perf_counter()
        result.losses.append(train_step(layers, inputs, target, optimizer, checkpoint))
        result.step_s.append(time.perf_counter() - t0)
    if cuda:
        result.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    return result


def run_backend(backend: str, args: argparse.Namespace, model_path: Path, comfyui: Path) -> Result:
    """Train ``backend`` in a child process (ComfyUI picks attention once per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", backend, "--result", str(out),
               "--comfyui", str(comfyui), "--model-file", str(model_path), "--device", args.device,
               "--steps", str(args.steps), "--resolution", str(args.resolution), "--lr", str(args.lr)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("note: "):
                print(f"[{backend}] {line}")
        if proc.returncode != 0 or not out.exists():
            return Result(backend, error=(proc.stdout + proc.stderr)[-2000:] or f"exit {proc.returncode}")
        return Result(**json.loads(out.read_text()))


def curve_problem(reference: list[float], other: list[float]) -> str:
    """Why two loss curves disagree by more than bf16 tolerance ("" when they agree)."""
    if len(reference) != len(other) or not reference:
        return f"curves of different lengths: {len(reference)} and {len(other)}"
    if not all(math.isfinite(v) for v in reference + other):
        return "non-finite loss"
    rel = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(reference, other, strict=True)]
    if rel[0] > FIRST_STEP_RTOL:
        return f"first-step losses differ by {rel[0]:.2e} (> {FIRST_STEP_RTOL:g})"
    if max(rel) > CURVE_RTOL:
        return f"loss curves differ by up to {max(rel):.2e} at step {rel.index(max(rel)) + 1} (> {CURVE_RTOL:g})"
    return ""


def table(results: list[Result]) -> str:
    head = f"{'backend':<8} {'ComfyUI function':<18} {'s/step':>8} {'peak MiB':>9}  {'loss first -> last':<20} status"
    lines = [head, "-" * len(head)]
    for r in results:
        timed = r.step_s[1:] or r.step_s
        s_step = f"{statistics.median(timed):.4f}" if timed else "-"
        peak = f"{r.peak_mib:.1f}" if r.peak_mib is not None else "-"
        loss = f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}" if r.losses else "-"
        lines.append(f"{r.backend:<8} {r.function:<18} {s_step:>8} {peak:>9}  {loss:<20} "
                     f"{'ok' if not r.error else 'FAILED: ' + r.error.strip().splitlines()[-1]}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of the harness, SDPA only)")
    parser.add_argument("--model", default="mmdit", choices=("mmdit", "flux"))
    parser.add_argument("--mmdit", type=Path, default=None, help="the tiny MMDiT file (default: built if missing)")
    parser.add_argument("--flux", type=Path, default=None, help="the Flux-min file (default: built if missing, ~1 GB)")
    parser.add_argument("--comfyui", type=Path, default=None, help="a ComfyUI tree (default: the dev host)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resolution", type=int, default=512, help="image side in px (tiny MMDiT: at most 512)")
    parser.add_argument("--lr", type=float, default=None, help=f"LoRA learning rate (default per model: {LEARNING_RATES})")
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-file", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.lr = args.lr or LEARNING_RATES[args.model]
    import_pack()
    if args.child:
        result = train_child(args.child, args.comfyui, args.model_file, args.device, args.steps, args.resolution, args.lr)
        args.result.write_text(json.dumps(result.__dict__))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the SDPA vs flash-attn comparison needs a CUDA GPU; nothing was measured "
              "(run with --device cpu for a dry run of the harness)")
        return 0
    backends = BACKENDS if args.device == "cuda" else ("pytorch",)
    if "flash" in backends and importlib.util.find_spec("flash_attn") is None:
        print("flash-attn is not installed in this Python ('pip install flash-attn'): nothing to compare SDPA with")
        return 2
    from pipetrainer.devkit.host import ensure_host

    comfyui = args.comfyui or ensure_host()
    model_path = model_file(args.model, getattr(args, args.model), comfyui)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    print(f"device: {name}, torch {torch.__version__}, {args.model} at {args.resolution} px, {args.steps} steps, "
          f"lr {args.lr}, bf16 base + fp32 LoRA", flush=True)
    results = [run_backend(b, args, model_path, comfyui) for b in backends]
    print(table(results))
    failed = [r for r in results if r.error]
    for r in results:
        if not r.error and r.function != EXPECTED_FUNCTION[r.backend]:
            print(f"{r.backend}: ComfyUI ran {r.function}, not {EXPECTED_FUNCTION[r.backend]}")
            failed.append(r)
    if len(results) == 2 and not failed:
        problem = curve_problem(results[0].losses, results[1].losses)
        sdpa, flash = results
        ratio = statistics.median(flash.step_s[1:] or flash.step_s) / statistics.median(sdpa.step_s[1:] or sdpa.step_s)
        print(f"flash-attn / SDPA: {ratio:.2f}x time per step, {flash.peak_mib - sdpa.peak_mib:+.1f} MiB peak; "
              f"loss curves {'agree within bf16 tolerance' if not problem else 'DISAGREE: ' + problem}")
        if problem:
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
