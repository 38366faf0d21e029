"""GPU smoke check: the tiny MMDiT and Flux-min train a few steps in bf16 and fp8, block swap off and on.

One prepared script for a CUDA machine (a few minutes; budget under 8). Each case replays the model the
way the training process does (``training.model_source.load_model``: the loader's weight dtype plus the
compute dtype), builds the family's stage layers with the trainer's LoRA injection, and runs them as
one pipeline stage does: each layer under torch's non-reentrant activation checkpoint, AdamW on the
fp32 LoRA, the last blocks swapped to host memory when asked. Every step trains on one fixed batch
(flow-matching target through the model's own ``model_sampling``), so a working case must show finite
losses that fall. Prints s/step (median after the first step) and peak GPU memory per case as a table,
and exits non-zero if any case failed. DeepSpeed is not needed: it runs where only torch, peft,
safetensors and a ComfyUI tree exist.

    python bench/gpu_smoke.py                                    # dev host, fixtures built if missing
    python bench/gpu_smoke.py --comfyui DIR [--mmdit FILE] [--flux FILE]   # a GPU machine without it
    python bench/gpu_smoke.py --device cpu --quick               # dry run: tiny MMDiT only, 5 steps
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from _pack import import_pack

PRECISIONS = {"bf16": ("default", "bf16"), "fp8": ("fp8_e4m3fn", "bf16")}  # name: (weight_dtype, compute)
# LoRA learning rates that make the fixed-batch loss fall in a few steps (checked on CPU): Flux-min's
# random 3072-wide blocks diverge at the tiny MMDiT's rate (3e-2: 3.5 -> 1.4 -> 33).
LEARNING_RATES = {"mmdit": 3e-2, "flux": 1e-3}


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
    peak_mib: float | None = None
    error: str = ""

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


def run_case(case: Case, model_path: Path, device, steps: int, lr: float | None = None) -> Result:
    """Train one case for ``steps`` steps; the result holds losses and timings, or the error."""
    import torch
    import torch.utils.checkpoint
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.offload.block_swap import swap_last_blocks
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe

    result = Result(case)
    cuda = device.type == "cuda"
    try:
        weight_dtype, compute = PRECISIONS[case.precision]
        patcher = load_model(ModelRecipe("diffusion_model", str(model_path), weight_dtype), compute)
        model = patcher.model
        adapter = adapter_for(family_name_for(model))
        layers = adapter.stage_layers(model.diffusion_model)
        stage = torch.nn.ModuleList(layers).to(device)  # the engine moves the stage, then injects
        lora = LoraSpec(rank=8, alpha=8.0, targets="attention_mlp")
        inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex(lora.targets), lora, seed=0)
        params = freeze_all_but_lora(stage)
        optimizer = torch.optim.AdamW(params, lr=lr or LEARNING_RATES[case.model], weight_decay=0.0)
        swapper = swap_last_blocks(layers, case.blocks_to_swap, device)
        inputs, target = fixed_batch(model, adapter, device)
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            t0 = time.perf_counter()
            value = train_step(layers, inputs, target, optimizer, checkpoint)
            result.step_s.append(time.perf_counter() - t0)
            result.losses.append(value)
        if cuda:
            result.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
        if swapper:
            swapper.detach()
        problem = loss_problem(result.losses)
        if problem:
            result.error = problem
    except Exception as exc:  # report every case, then fail at the end
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
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


def table(results: list[Result]) -> str:
    head = f"{'model':<6} {'precision':<9} {'swap':>4} {'s/step':>8} {'peak MiB':>9}  {'loss first -> last':<20} status"
    lines = [head, "-" * len(head)]
    for r in results:
        timed = r.step_s[1:] or r.step_s
        s_step = f"{statistics.median(timed):.4f}" if timed else "-"
        peak = f"{r.peak_mib:.1f}" if r.peak_mib is not None else "-"
        loss = f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}" if r.losses else "-"
        lines.append(f"{r.case.model:<6} {r.case.precision:<9} {r.case.blocks_to_swap:>4} {s_step:>8} {peak:>9}  "
                     f"{loss:<20} {'ok' if r.ok else 'FAILED: ' + r.error}")
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
        print("no CUDA device: a dry run; there are no GPU figures (peak GPU memory) to report")
    todo = cases(args.quick)
    paths = {kind: model_file(kind, getattr(args, kind), root) for kind in sorted({c.model for c in todo})}
    started = time.monotonic()
    results = []
    for case in todo:
        result = run_case(case, paths[case.model], device, steps, args.lr)
        print(f"{case}: {'ok' if result.ok else result.error} ({time.monotonic() - started:.0f} s so far)", flush=True)
        results.append(result)
    print(table(results))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
