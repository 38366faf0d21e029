"""GPU smoke check: the tiny MMDiT and Flux-min train a few steps in bf16 and fp8, block swap off and on.

One prepared script for a CUDA machine (a few minutes; budget under 8). Each case replays the model the
way the training process does (``training.model_source.load_model``: the loader's weight dtype plus the
compute dtype), sets the stage up as the engine does (bench/_smoke_setup.py: DeepSpeed's PipelineModule
left on the host, the stage placed with its swapped blocks kept in host memory, the trainer's LoRA
injection, AdamW on the fp32 LoRA, the block swapper, DeepSpeed's stage engine on a 1-rank group), and
runs the layers as one pipeline stage does: each under torch's non-reentrant activation checkpoint, the
last blocks swapped to host memory when asked. Every step trains on one fixed batch (flow-matching target
through the model's own ``model_sampling``), so a working case must show finite losses that fall.

Prints per case as a table: s/step (median after the first step), the set-up peak (the most device memory
allocated from the stage build through the first step's start, above what was allocated before it), what
is left allocated at the first step's start, the steps' peak, and the memory plan's estimate of the
stage's peak (training/offload/memory_plan.py, without its margin, which is for the CUDA context torch
does not count) with its error against the measured peak. Then, per model and precision, the set-up peak
with swap off and on next to what set-up should leave on the device (the stage minus the swapped blocks'
frozen weights, plus the LoRA). Exits non-zero if any case failed. Without DeepSpeed (or with
``--setup plain``) the same placement runs without it: it then runs where only torch, peft, safetensors
and a ComfyUI tree exist. Without a GPU every case still runs (a dry run) and the GPU figures are skipped.

    python bench/gpu_smoke.py                                    # dev host, fixtures built if missing
    python bench/gpu_smoke.py --comfyui DIR [--mmdit FILE] [--flux FILE]   # a GPU machine without it
    python bench/gpu_smoke.py --device cpu --quick               # dry run: tiny MMDiT only, 5 steps
    python bench/gpu_smoke.py --setup plain                      # the engine's placement without DeepSpeed
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from _pack import import_pack
from _smoke_setup import SETUPS, engine_group

PRECISIONS = {"bf16": ("default", "bf16"), "fp8": ("fp8_e4m3fn", "bf16")}  # name: (weight_dtype, compute)
# LoRA learning rates that make the fixed-batch loss fall in a few steps (checked on CPU): Flux-min's
# random 3072-wide blocks diverge at the tiny MMDiT's rate (3e-2: 3.5 -> 1.4 -> 33).
LEARNING_RATES = {"mmdit": 3e-2, "flux": 1e-3}
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BATCH_LATENT, BATCH_TOKENS = 8, 77  # the fixed batch: an 8 x 8 latent (64 px) and 77 text tokens


@dataclass(frozen=True)
class Case:
    model: str  # "mmdit" or "flux"
    precision: str  # a PRECISIONS key
    blocks_to_swap: int


@dataclass
class Result:
    case: Case
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_mib: float | None = None  # the steps' peak (allocated)
    setup_peak_mib: float | None = None  # stage build through the first step's start, above the baseline
    at_start_mib: float | None = None  # allocated at the first step's start, above the baseline
    baseline_mib: float | None = None  # allocated before the stage build (the model loaded: should be ~0)
    estimate: object = None  # bench/_smoke_setup.Estimate: the memory plan's figures for this case
    error: str = ""

    @property
    def measured_peak_mib(self) -> float | None:
        peaks = [p for p in (self.setup_peak_mib, self.peak_mib) if p is not None]
        return max(peaks) if peaks else None

    @property
    def plan_error(self) -> float | None:
        """The plan's estimate (without its margin) against the measured peak: (estimate - measured) / measured."""
        measured = self.measured_peak_mib
        if self.estimate is None or not measured:
            return None
        return (self.estimate.need_no_margin / 2**20 - measured) / measured

    @property
    def ok(self) -> bool:
        return not self.error


def cases(quick: bool) -> list[Case]:
    """bf16 and fp8 for each model, block swap off and on (all swappable blocks but one)."""
    models = {"mmdit": 3} if quick else {"mmdit": 3, "flux": 1}  # tiny MMDiT: 4 blocks; Flux-min: 1 + 1
    return [Case(m, p, n) for m, swap in models.items() for p in PRECISIONS for n in (0, swap)]


def fixed_batch(model, adapter, device, seed: int = 0, latent: int = 8, tokens: int = 77):
    """First-stage inputs and the flow target of one batch (a ``latent``² latent: 64 px by default, and
    ``tokens`` text tokens), in the model's compute dtype."""
    import torch
    from pipetrainer.training.pipelines.base import Batch

    dm = model.diffusion_model
    context_dim, pooled_dim = adapter.conditioning_dims(dm)
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 16, latent, latent, generator=g)
    noise = torch.randn(1, 16, latent, latent, generator=g)
    cond = torch.randn(1, tokens, context_dim, generator=g)
    pooled = torch.randn(1, pooled_dim, generator=g) if pooled_dim else None
    sigma = torch.tensor([0.6])
    ms = model.model_sampling
    noisy = ms.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
    dtype = model.manual_cast_dtype or model.get_dtype()  # what ComfyUI (and the trainer) compute in
    inputs = adapter.first_stage_inputs(Batch(noisy.to(dtype), ms.timestep(sigma).float(), cond.to(dtype),
                                              None if pooled is None else pooled.to(dtype), options=adapter.options_type()))
    return tuple(t.to(device) for t in inputs), (noise - x0).to(device)


def train_step(layers, inputs, target, optimizer, checkpoint) -> float:
    """One optimizer step through the stage layers, as a 1-stage pipeline runs it; returns the loss."""
    import torch

    out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    for layer in layers:
        out = checkpoint(layer, out)
    loss = torch.nn.functional.mse_loss(out.float(), target.float())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()  # also synchronises the device


def run_case(case: Case, model_path: Path, device, steps: int, lr: float | None = None,
             use_deepspeed: bool = False) -> Result:
    """Train one case for ``steps`` steps; the result holds losses, timings and memory, or the error."""
    import torch
    import torch.utils.checkpoint
    from _smoke_setup import build_stage, plan_estimate
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe

    result = Result(case)
    cuda = device.type == "cuda"
    stage = None
    try:
        weight_dtype, compute = PRECISIONS[case.precision]
        patcher = load_model(ModelRecipe("diffusion_model", str(model_path), weight_dtype), compute)
        model = patcher.model
        adapter = adapter_for(family_name_for(model))
        lora = LoraSpec(rank=8, alpha=8.0, targets="attention_mlp")
        if cuda:  # the set-up peak: from here (the stage build) through the first step's start
            torch.cuda.synchronize(device)
            baseline = torch.cuda.memory_allocated(device)
            result.baseline_mib = baseline / 2**20
            torch.cuda.reset_peak_memory_stats(device)
        layers = adapter.stage_layers(model.diffusion_model)
        result.estimate = plan_estimate(layers, adapter, model.diffusion_model, lora, case.blocks_to_swap,
                                        COMPUTE_BYTES[compute], (16, BATCH_LATENT, BATCH_LATENT), BATCH_TOKENS)
        stage = build_stage(layers, adapter, lora, case.blocks_to_swap, device, lr or LEARNING_RATES[case.model],
                            use_deepspeed)
        inputs, target = fixed_batch(model, adapter, device, latent=BATCH_LATENT, tokens=BATCH_TOKENS)
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        if cuda:
            torch.cuda.synchronize(device)
            result.setup_peak_mib = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
            result.at_start_mib = (torch.cuda.memory_allocated(device) - baseline) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            t0 = time.perf_counter()
            value = train_step(layers, inputs, target, stage.optimizer, checkpoint)
            result.step_s.append(time.perf_counter() - t0)
            result.losses.append(value)
        if cuda:
            result.peak_mib = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
        problem = loss_problem(result.losses)
        if problem:
            result.error = problem
    except Exception as exc:  # report every case, then fail at the end
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if stage is not None and stage.swapper is not None:
            stage.swapper.detach()
        stage = None
        gc.collect()  # the case's model and engine go before the next case's baseline
        if cuda:
            torch.cuda.empty_cache()
    return result


def loss_problem(losses: list[float]) -> str:
    """Why these losses are not finite and falling on a fixed batch ("" if they are)."""
    if not losses or not all(math.isfinite(v) for v in losses):
        return f"non-finite loss: {losses}"
    tail = losses[-2:] if len(losses) > 2 else losses[-1:]
    if not sum(tail) / len(tail) < 0.95 * losses[0]:
        return f"loss did not fall: {[round(v, 4) for v in losses]}"
    return ""


def _mib(value: float | None, fmt: str = ".1f") -> str:
    return format(value, fmt) if value is not None else "-"


def table(results: list[Result]) -> str:
    head = (f"{'model':<6} {'precision':<9} {'swap':>4} {'s/step':>8} {'set-up MiB':>10} {'at start':>9} "
            f"{'steps MiB':>9} {'plan MiB':>9} {'plan err':>8}  {'loss first -> last':<20} status")
    lines = [head, "-" * len(head)]
    for r in results:
        timed = r.step_s[1:] or r.step_s
        s_step = f"{statistics.median(timed):.4f}" if timed else "-"
        plan = r.estimate.need_no_margin / 2**20 if r.estimate is not None else None
        error = f"{100 * r.plan_error:+.0f}%" if r.plan_error is not None else "-"
        loss = f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}" if r.losses else "-"
        lines.append(f"{r.case.model:<6} {r.case.precision:<9} {r.case.blocks_to_swap:>4} {s_step:>8} "
                     f"{_mib(r.setup_peak_mib):>10} {_mib(r.at_start_mib):>9} {_mib(r.peak_mib):>9} {_mib(plan):>9} "
                     f"{error:>8}  {loss:<20} {'ok' if r.ok else 'FAILED: ' + r.error}")
    return "\n".join(lines)


def setup_summary(results: list[Result], cuda: bool) -> str:
    """Per model and precision: the set-up peak with swap off and on, next to what set-up should leave on
    the device (the plan's count: the stage minus the swapped blocks' frozen weights, plus the LoRA)."""
    if not cuda:
        return "set-up peak with swap off and on: skipped (no CUDA device; the cases above ran as a dry run)"
    lines = ["set-up peak (stage build through the first step's start) with swap off and on:"]
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.case.model, r.case.precision), []).append(r)
    for (model, precision), rs in groups.items():
        parts = []
        rs = sorted(rs, key=lambda r: r.case.blocks_to_swap)
        for r in rs:
            expected = r.estimate.setup_resident / 2**20 if r.estimate is not None else None
            planned = r.estimate.need / 2**20 if r.estimate is not None else None
            parts.append(f"swap {r.case.blocks_to_swap}: {_mib(r.setup_peak_mib)} MiB (at start {_mib(r.at_start_mib)}, "
                         f"expected {_mib(expected)}; allocated before set-up {_mib(r.baseline_mib)}; peak of all "
                         f"{_mib(r.measured_peak_mib)}, plan {_mib(planned)} with its margin)")
        off, on = rs[0].setup_peak_mib, rs[-1].setup_peak_mib
        ratio = f"; swap on / off = {on / off:.2f}" if off and on is not None and len(rs) > 1 else ""
        lines.append(f"  {model} {precision}: {'; '.join(parts)}{ratio}")
    lines.append("plan err: the memory plan's estimate without its margin against the larger measured peak "
                 "(training/offload/memory_plan.py; its margin adds 1 GiB + 10% for the CUDA context and the allocator)")
    return "\n".join(lines)


def model_file(kind: str, given: Path | None, comfyui: Path) -> Path:
    """The fixture file: as given, else the ComfyUI tree's, built there with the devkit if missing."""
    from pipetrainer.devkit import fixtures

    if given is not None:
        return given
    name, build = {"mmdit": (fixtures.MMDIT_FILE, fixtures.build_tiny_mmdit),
                   "flux": (fixtures.FLUX_FILE, fixtures.build_min_flux)}[kind]
    path = comfyui / "models" / "diffusion_models" / name
    if not path.exists():
        print(f"building {path} ...", flush=True)
        build(path)
    return path


def _dev_host() -> Path:
    from pipetrainer.devkit.host import ensure_host

    return ensure_host()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny MMDiT only, 5 steps (a dry run, e.g. on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="steps per case (default 8; 5 with --quick)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"AdamW learning rate of the LoRA (default per model: {LEARNING_RATES})")
    parser.add_argument("--comfyui", type=Path, default=None,
                        help="a ComfyUI tree (default: the dev host, set up if missing)")
    parser.add_argument("--mmdit", type=Path, default=None, help="the tiny MMDiT file (default: built if missing)")
    parser.add_argument("--flux", type=Path, default=None, help="the Flux-min file (default: built if missing, ~1 GB)")
    parser.add_argument("--setup", choices=SETUPS, default="auto",
                        help="the stage set-up: deepspeed (PipelineModule + stage engine, as the trainer), plain "
                             "(the same placement without DeepSpeed), auto (deepspeed when importable)")
    args = parser.parse_args(argv)
    import_pack()
    import torch
    from pipetrainer.training.model.comfy_env import use_comfyui

    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    root = args.comfyui or _dev_host()
    use_comfyui(root, device.type)
    steps = args.steps or (5 if args.quick else 8)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}, {steps} steps per case, lr {args.lr or LEARNING_RATES}", flush=True)
    if device.type != "cuda":
        print("no CUDA device: a dry run; the GPU part (peak and set-up GPU memory with swap off and on) is skipped")
    use_deepspeed, why_not = engine_group(args.setup, device)
    print("set-up: DeepSpeed's PipelineModule and stage engine on a 1-rank group" if use_deepspeed
          else f"set-up: the engine's placement without DeepSpeed: {why_not}", flush=True)
    todo = cases(args.quick)
    paths = {kind: model_file(kind, getattr(args, kind), root) for kind in sorted({c.model for c in todo})}
    started = time.monotonic()
    results = []
    for case in todo:
        result = run_case(case, paths[case.model], device, steps, args.lr, use_deepspeed)
        print(f"{case}: {'ok' if result.ok else result.error} ({time.monotonic() - started:.0f} s so far)", flush=True)
        results.append(result)
    print(table(results))
    print(setup_summary(results, device.type == "cuda"))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
