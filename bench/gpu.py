"""GPU benchmark: LoRA training of a full-size Flux (FLUX.1-dev architecture, random weights), one command.

    python bench/gpu.py --comfyui DIR               # a CUDA machine (budget: under 8 min on an H100/H200)
    python bench/gpu.py --comfyui DIR --in-memory   # the same without the 24 GB model file
    python bench/gpu.py --device cpu --tiny         # dry run of the same code path (tiny Flux, seconds)

The model is ComfyUI's ``Flux`` class with FLUX.1-dev's architecture (hidden 3072, 24 heads, 19 double
+ 38 single blocks, T5 context 4096, CLIP vector 768, guidance embedding; 11.9 B parameters) and
seeded random weights (bench/_random_flux.py): written once as a bf16 safetensors file in a temporary
folder (``--workdir``; ~24 GB, deleted afterwards) and loaded per precision through the trainer's
``training.model_source.load_model``, as a rank loads a UNETLoader model: bf16 = ``weight_dtype``
default, fp8 = ``fp8_e4m3fn`` (ComfyUI converts the weights at load), both computing in bf16. The
loaded weights are checked against the written ones. ``--in-memory`` hands the state dict to ComfyUI's
state-dict loader instead (the function ``load_diffusion_model`` calls after reading the file), for a
machine with a small or slow disk; the training steps are the same either way.

Each case trains one pipeline stage holding the whole model the way a rank does, without DeepSpeed
(so it runs where only torch, peft, safetensors and a ComfyUI tree exist): the Flux adapter's stage
layers, PEFT LoRA rank 32 (alpha 32, ``attention_mlp`` targets, fp32), the stage placed with the
engine's ``place_stage`` / ``move_trainable`` (swapped blocks' frozen weights stay in host memory),
each layer under torch's non-reentrant activation checkpoint, MSE on the flow target of one fixed
batch (1024² image = 128² latent = 4096 image tokens, 512 text tokens of width 4096, batch 1; built
through the model's own ``model_sampling``), AdamW (lr 1e-4) on the LoRA.

Cases, per precision (bf16, then fp8; one model load serves its five): ``blocks_to_swap`` max (57,
every block), half (28) and 0, the swapped ones twice: H2D-only on (PipeTrainer's ``BlockSwapper``:
the pinned host copy is the master, nothing is copied back) and off (bench/_copy_back_swap.py: the
same swapper plus a device-to-host copy of each block after every use). Every case starts from the
same LoRA initialisation and batch, so its losses repeat the first case's: bitwise on CPU (a
difference fails the dry run), within rounding on a GPU (``loss_max_rel_diff`` in the JSON).

Per case: ``--warmup`` steps (default 2), then ``--steps`` timed steps (default 4): few, so that the
model file, two loads and the per-case placement (pinning up to 24 GB of host memory) fit in the 8
minutes as well (``--time-limit`` guards it).
- s/step: median over the timed steps (each ends with ``loss.item()``, a device synchronisation).
- tokens/s = batch × (image tokens + text tokens) / (s/step): 4608 tokens per sample at 1024².
- peak VRAM: ``torch.cuda.max_memory_allocated`` over the timed steps (``reserved`` in the JSON).
- host RSS: the process's resident set (``VmRSS``), the largest value sampled after each timed step;
  it holds the frozen weights that are in host memory (pinned for swapped blocks), the LoRA snapshot,
  the Python/CUDA runtime, and whatever the allocators keep (torch's pinned-memory cache rounds each
  allocation up to a power of two; ``pinned_gib`` in the JSON shows what it holds).
- pinned / weights GiB: the swapped blocks' host copies, one flat buffer per block pinned in place
  (training/offload/host_buffer.py): bytes pinned against the weights' own bytes (the JSON's
  ``swap_pinned_gib`` / ``swap_weight_gib``); per-tensor ``pin_memory()`` held ~1.5x.
- MFU, PaLM's definition (the rematerialised forward of activation checkpointing is not counted):

      F_base = 2 · Σ rows · in_features · out_features over every call of a frozen Linear in one forward
      F_lora = the same sum over the LoRA A and B Linears
      F_attn = 4 · B · L² · hidden per transformer block (QKᵀ and P·V over all heads; L = text + image
               tokens: Flux attends jointly in double and single blocks)
      model FLOPs per step = 2·F_base + 3·F_lora + 3·F_attn
          forward 1×; backward: a frozen Linear needs only its input gradient (1×), a LoRA Linear also
          its weight gradient (2×), attention the gradients of both operands of both matmuls (2×)
      MFU = model FLOPs per step / (s/step × peak dense bf16 FLOP/s of the GPU)

  ``rows`` are counted by forward hooks on ``nn.Linear`` during one no-grad forward of the batch
  (norms, activations and RoPE are left out, as usual). The peak is 989.4 TFLOPS for H100 SXM and H200
  SXM, 835 for H100/H200 NVL, 756 for H100 PCIe, 312 for A100; ``--peak-tflops`` sets it for other
  GPUs (and on CPU, where it is unknown and MFU is left out). The JSON also has HFU, which counts the
  recomputed forward: (3·F_base + 4·F_lora + 4·F_attn) / (s/step × peak).
- ratios (×): each case over the bf16 ``blocks_to_swap`` 0 case.

Output: one JSON line per case as it finishes (``{"bench": "gpu", ...}``; also into ``--json FILE``),
then the table. Exit status 1 when a case failed or a loss was not finite, 3 when ``--time-limit``
(default 450 s) made it skip cases, else 0.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _pack import import_pack

LORA_TARGETS = "attention_mlp"
PEAK_TFLOPS = (  # dense bf16 tensor-core peak, by a substring of torch.cuda.get_device_name (first match)
    ("H200 NVL", 835.0), ("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.4),
    ("A100", 312.0),
)


@dataclass(frozen=True)
class Settings:
    resolution: int  # image side in pixels; the latent side is resolution / 8
    text_tokens: int
    rank: int
    lr: float
    warmup: int
    steps: int
    seed: int

    @property
    def latent(self) -> int:
        return self.resolution // 8

    @property
    def tokens(self) -> int:
        """Text plus image tokens of one sample (Flux patchifies the latent 2 × 2)."""
        return self.text_tokens + (self.latent // 2) ** 2


@dataclass(frozen=True)
class Case:
    precision: str  # a gpu_smoke.PRECISIONS key
    blocks_to_swap: int
    h2d_only: bool = True

    @property
    def label(self) -> str:
        if not self.blocks_to_swap:
            return f"{self.precision} swap 0"
        return f"{self.precision} swap {self.blocks_to_swap} {'H2D-only' if self.h2d_only else 'copy-back'}"


@dataclass
class Result:
    case: Case
    losses: list[float] = field(default_factory=list)  # warm-up and timed steps
    step_s: list[float] = field(default_factory=list)  # timed steps
    setup_s: float = 0.0
    peak_vram_gib: float | None = None
    reserved_vram_gib: float | None = None
    host_rss_gib: float = 0.0
    pinned: dict = field(default_factory=dict)  # torch's pinned-host allocator, GiB (see pinned_gib)
    block_loads: int = 0
    swap_host: tuple = ()  # (pinned GiB, weight GiB) of the swapper's flat host buffers
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def s_per_step(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None


@dataclass
class Flops:
    base: float  # F_base, F_lora, F_attn of one forward (see the module docstring)
    lora: float
    attn: float

    @property
    def model(self) -> float:
        return 2 * self.base + 3 * self.lora + 3 * self.attn

    @property
    def hardware(self) -> float:
        return 3 * self.base + 4 * self.lora + 4 * self.attn


@dataclass
class Bundle:
    """One loaded model with its LoRA, shared by the cases of one precision."""

    precision: str
    patcher: object
    layers: list
    stage: object  # nn.ModuleList of the layers
    lora_init: dict  # LoRA name -> initial value (host), restored before every case
    inputs: tuple
    target: object
    swappable: int
    flops: Flops | None = None


# ---- measurements ----------------------------------------------------------------------------------
def host_rss_gib() -> float:
    """The process's resident set now (Linux ``VmRSS``; elsewhere the peak so far)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def pinned_gib() -> dict:
    """Pinned host memory held by torch's allocator (``host_memory_stats``, torch >= 2.7; {} if absent).

    ``owned`` counts cached blocks too, and every block is rounded up to a power of two: the swapped
    weights can need up to twice their size in pinned memory."""
    import torch

    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    if stats_of is None or not torch.cuda.is_available():
        return {}
    try:
        stats = stats_of()
    except RuntimeError:
        return {}
    keys = {"owned": "allocated_bytes.current", "active": "active_bytes.current"}
    return {name: stats[key] / 2**30 for name, key in keys.items() if key in stats}


def peak_tflops(device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def forward_flops(stage, layers, inputs, hidden: int, blocks: int, tokens: int, batch: int) -> Flops:
    """Count F_base and F_lora with forward hooks on every ``nn.Linear`` during one no-grad forward."""
    import torch
    from torch import nn

    names = {id(m): n for n, m in stage.named_modules()}
    sums = {"base": 0.0, "lora": 0.0}

    def count(module, args, _output) -> None:
        if isinstance(module, nn.Linear) and id(module) in names:
            rows = args[0].numel() // module.in_features
            kind = "lora" if (".lora_A." in names[id(module)] or ".lora_B." in names[id(module)]) else "base"
            sums[kind] += 2.0 * rows * module.in_features * module.out_features

    handle = nn.modules.module.register_module_forward_hook(count)
    try:
        with torch.no_grad():
            out = inputs
            for layer in layers:
                out = layer(out)
    finally:
        handle.remove()
    return Flops(sums["base"], sums["lora"], 4.0 * batch * tokens**2 * hidden * blocks)


# ---- model and cases --------------------------------------------------------------------------------
def cases_for(precision: str, swappable: int) -> list[Case]:
    """All blocks swapped, half, none; the swapped ones with H2D-only on, then off.

    Most swapped first: the freshly loaded model is in host memory, so the first case places it the
    way the engine does (swapped blocks pinned straight from host memory, never whole on the device).
    Each case ends with its swapper detached (the whole stage on the device), so a later case with
    fewer swapped blocks copies fewer of them back to the host."""
    out = []
    for n in sorted({swappable, swappable // 2} - {0}, reverse=True):
        out += [Case(precision, n, True), Case(precision, n, False)]
    return [*out, Case(precision, 0)]


def prepare(source, path: Path | None, precision: str, settings: Settings, device, tiny: bool,
            check: bool) -> Bundle:
    """Load the model at ``precision`` (``check``: against the weights ``source`` wrote), build its stage
    layers with LoRA, and the fixed batch."""
    import torch
    from _random_flux import load
    from gpu_smoke import PRECISIONS, fixed_batch
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora, named_lora_parameters
    from pipetrainer.training.offload.stages import is_swappable
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.spec.options import LoraSpec

    weight_dtype, compute = PRECISIONS[precision]
    patcher = load(source, path, weight_dtype, compute, tiny)
    model = patcher.model
    if check:
        source.check_loaded(model.diffusion_model)
    adapter = adapter_for(family_name_for(model))
    layers = adapter.stage_layers(model.diffusion_model)
    stage = torch.nn.ModuleList(layers)
    lora = LoraSpec(rank=settings.rank, alpha=float(settings.rank), targets=LORA_TARGETS)
    if not inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex(lora.targets), lora, settings.seed):
        raise RuntimeError(f"No LoRA target matched {LORA_TARGETS!r} in the Flux stage layers.")
    freeze_all_but_lora(stage)
    lora_init = {n: p.detach().to("cpu", copy=True) for n, p in named_lora_parameters(stage).items()}
    inputs, target = fixed_batch(model, adapter, device, seed=settings.seed, latent=settings.latent,
                                 tokens=settings.text_tokens)
    return Bundle(precision, patcher, layers, stage, lora_init, inputs, target,
                  swappable=sum(1 for layer in layers if is_swappable(layer)))


def run_case(bundle: Bundle, case: Case, settings: Settings, device) -> Result:
    """Place the stage for the case, attach its swapper, train warm-up + timed steps; leave the stage
    on the device (the swapper detached) for the next case."""
    import torch
    import torch.utils.checkpoint
    from _copy_back_swap import CopyBackSwapper
    from gpu_smoke import train_step
    from pipetrainer.training.adapters.inject import named_lora_parameters
    from pipetrainer.training.offload.block_swap import BlockSwapper
    from pipetrainer.training.offload.placement import last_swappable, move_trainable, place_stage

    result = Result(case)
    cuda = device.type == "cuda"
    swapper = None
    try:
        t0 = time.perf_counter()
        swapped = last_swappable(bundle.layers, case.blocks_to_swap)
        place_stage(bundle.layers, swapped, device)
        move_trainable(swapped, device)
        with torch.no_grad():
            for name, param in named_lora_parameters(bundle.stage).items():
                param.copy_(bundle.lora_init[name])
        params = [p for p in bundle.stage.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        if swapped:
            swapper = (BlockSwapper if case.h2d_only else CopyBackSwapper)(swapped, device).attach()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        result.setup_s = time.perf_counter() - t0
        if bundle.flops is None:
            dm = bundle.patcher.model.diffusion_model
            bundle.flops = forward_flops(bundle.stage, bundle.layers, bundle.inputs, dm.params.hidden_size,
                                         bundle.swappable, settings.tokens, batch=1)
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        for i in range(settings.warmup + settings.steps):
            if i == settings.warmup and cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            result.losses.append(train_step(bundle.layers, bundle.inputs, bundle.target, optimizer, checkpoint))
            if i >= settings.warmup:
                result.step_s.append(time.perf_counter() - t)
                result.host_rss_gib = max(result.host_rss_gib, host_rss_gib())
        if cuda:
            result.peak_vram_gib = torch.cuda.max_memory_allocated(device) / 2**30
            result.reserved_vram_gib = torch.cuda.max_memory_reserved(device) / 2**30
            result.pinned = pinned_gib()
        result.block_loads = swapper.loads if swapper else 0
        if swapper is not None:
            result.swap_host = tuple(b / 2**30 for b in swapper.host_bytes())
        if not all(math.isfinite(v) for v in result.losses):
            result.error = f"non-finite loss: {result.losses}"
    except Exception as exc:  # report every case, then fail at the end
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if swapper is not None:
            swapper.detach()
        if cuda:
            torch.cuda.empty_cache()
    return result


def release(bundle: Bundle | None) -> None:
    """Free a bundle's model on the device and in host memory (pinned blocks included) before the next load."""
    import torch

    if bundle is not None:
        bundle.stage = bundle.layers = bundle.patcher = bundle.inputs = bundle.target = bundle.lora_init = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # cached pinned blocks (torch >= 2.5)
        if empty_host is not None:
            empty_host()


# ---- report ---------------------------------------------------------------------------------------
def record(result: Result, settings: Settings, flops: Flops | None, peak: float | None,
           reference: Result | None) -> dict:
    """The JSON line of one case; ``reference`` is the first case of the same precision, whose losses
    this one should repeat (block swap moves weights; it does not change the arithmetic)."""
    s = result.s_per_step
    line = {"bench": "gpu", "case": result.case.label, **asdict(result.case), "ok": result.ok, "error": result.error,
            "s_per_step": s, "step_s": result.step_s, "setup_s": round(result.setup_s, 3),
            "tokens_per_s": settings.tokens / s if s else None,
            "peak_vram_gib": result.peak_vram_gib, "reserved_vram_gib": result.reserved_vram_gib,
            "host_rss_gib": result.host_rss_gib, "pinned_gib": result.pinned, "block_loads": result.block_loads,
            "swap_pinned_gib": result.swap_host[0] if result.swap_host else None,
            "swap_weight_gib": result.swap_host[1] if result.swap_host else None,
            "losses": result.losses}
    if flops is not None:
        line["model_flops_per_step"] = flops.model
        line["forward_flops"] = asdict(flops)
        if s and peak:
            line["mfu"] = flops.model / (s * peak * 1e12)
            line["hfu"] = flops.hardware / (s * peak * 1e12)
    if reference is not None and reference is not result and reference.losses and result.losses:
        line["loss_reference"] = reference.case.label
        line["loss_max_rel_diff"] = loss_difference(result, reference)
    return line


def loss_difference(result: Result, reference: Result) -> float:
    """The largest relative difference between the two cases' losses, step by step."""
    pairs = list(zip(result.losses, reference.losses, strict=False))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def table(lines: list[dict], base: dict | None) -> str:
    """The cases as a table; × columns are ratios to ``base`` (the bf16 blocks_to_swap 0 case)."""
    head = (f"{'case':<26} {'s/step':>8} {'×':>5} {'tokens/s':>9} {'MFU':>6} {'VRAM GiB':>9} {'×':>5} "
            f"{'RSS GiB':>8} {'×':>5} {'pinned/weights GiB':>18}  {'loss first -> last':<20} status")
    rows = [head, "-" * len(head)]
    b = base or {}
    for r in lines:
        s, vram, rss, losses = r["s_per_step"], r["peak_vram_gib"], r["host_rss_gib"], r["losses"]
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        status = "ok" if r["ok"] else "FAILED: " + r["error"]
        pinned = (f"{r['swap_pinned_gib']:.2f}/{r['swap_weight_gib']:.2f}"
                  if r.get("swap_weight_gib") is not None else "-")
        rows.append(f"{r['case']:<26} {_num(s, '.3f'):>8} {_ratio(s, b.get('s_per_step')):>5} "
                    f"{_num(r['tokens_per_s'], '.0f'):>9} {mfu:>6} {_num(vram, '.2f'):>9} "
                    f"{_ratio(vram, b.get('peak_vram_gib')):>5} {rss:>8.2f} {_ratio(rss, b.get('host_rss_gib')):>5} {pinned:>18}  "
                    f"{loss:<20} {status}")
    return "\n".join(rows)


# ---- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny Flux (hidden 128, 2 + 4 blocks): a dry run")
    parser.add_argument("--comfyui", type=Path, default=None, help="a ComfyUI tree (default: the dev host)")
    parser.add_argument("--precisions", default="bf16,fp8", help="comma-separated: bf16, fp8 (default both)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case (default 4)")
    parser.add_argument("--resolution", type=int, default=None, help="image side in px (default 1024; 128 --tiny)")
    parser.add_argument("--text-tokens", type=int, default=None, help="T5 tokens (default 512; 16 --tiny)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = rank)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the LoRA")
    parser.add_argument("--seed", type=int, default=0, help="weights, LoRA initialisation and batch")
    parser.add_argument("--in-memory", action="store_true",
                        help="no model file: hand the state dict to ComfyUI's state-dict loader")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="folder for the model file (default: a new temporary folder, removed afterwards)")
    parser.add_argument("--keep-file", action="store_true", help="keep the model file (reuse it with --model)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a model file written earlier by this benchmark (--keep-file): skips writing")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak of the device for MFU (default: known GPUs, see the docstring)")
    parser.add_argument("--time-limit", type=float, default=450.0,
                        help="seconds after which no further case starts (default 450; exit status 3)")
    parser.add_argument("--json", type=Path, default=None, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    if args.model is not None and (args.in_memory or args.keep_file or args.workdir is not None):
        parser.error("--model loads that file: it cannot be combined with --in-memory, --keep-file or --workdir.")
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    return args


def model_file(source, args: argparse.Namespace, workdir: Path) -> Path | None:
    """The model file to load: ``--model``, or written into ``workdir`` now; None with ``--in-memory``."""
    if args.model is not None:
        return args.model
    if args.in_memory:
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    need = source.nbytes + 2**30
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(f"{workdir} has {free / 2**30:.1f} GiB free; the model file needs {need / 2**30:.1f} GiB. "
                         "Pass --workdir on a larger disk, or --in-memory.")
    path = workdir / f"random-flux-seed{source.seed}-bf16.safetensors"
    t0 = time.perf_counter()
    size = source.write(path)
    took = time.perf_counter() - t0
    print(f"wrote {path} ({size / 2**30:.2f} GiB) in {took:.1f} s ({size / 2**30 / max(took, 1e-9):.2f} GiB/s)",
          flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # the budget counts the whole command, imports included
    args = parse_args(argv)
    import_pack()
    import torch
    from _random_flux import FULL, TINY, RandomFlux
    from gpu_smoke import PRECISIONS
    from pipetrainer.training.model.comfy_env import enable_comfy_training_mode, use_comfyui

    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        raise SystemExit(f"Unknown precision(s) {unknown}; choose from {sorted(PRECISIONS)}.")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.comfyui is None:
        from pipetrainer.devkit.host import ensure_host

        args.comfyui = ensure_host()
    use_comfyui(args.comfyui, device.type)
    enable_comfy_training_mode()
    if device.type == "cpu":
        torch.set_num_threads(1)
    settings = Settings(resolution=args.resolution or (128 if args.tiny else 1024),
                        text_tokens=args.text_tokens or (16 if args.tiny else 512),
                        rank=args.rank, lr=args.lr, warmup=args.warmup, steps=args.steps, seed=args.seed)
    source = RandomFlux(TINY if args.tiny else FULL, args.seed, device)
    peak = peak_tflops(device, args.peak_tflops)
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"device: {device}{gpu}, torch {torch.__version__}, ComfyUI {_comfyui_version()}; "
          f"{'tiny' if args.tiny else 'FLUX.1-dev-size'} Flux {source.parameters / 1e9:.3f} B parameters "
          f"({source.nbytes / 2**30:.2f} GiB bf16); {settings.resolution}² image = {settings.tokens - settings.text_tokens}"
          f" image + {settings.text_tokens} text tokens, batch 1, LoRA rank {settings.rank}; {settings.warmup} warm-up"
          f" + {settings.steps} timed steps per case; peak {peak or '?'} TFLOPS", flush=True)
    if device.type != "cuda":
        print("no CUDA device: a dry run; there are no GPU figures (VRAM, MFU) to report", flush=True)
    lines: list[dict] = []
    skipped: list[str] = []
    writes = args.model is None and not args.in_memory
    temporary = writes and args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="pipetrainer-gpu-bench-")) if temporary else args.workdir
    path = None
    try:
        path = model_file(source, args, workdir)
        for precision in args.precisions:
            blocks = source.params["depth"] + source.params["depth_single_blocks"]
            if time.monotonic() - started > args.time_limit:
                skipped += [c.label for c in cases_for(precision, blocks)]
                continue
            lines += run_precision(source, path, precision, settings, device, args, peak, skipped, started)
    finally:
        if writes and args.keep_file and path is not None:
            print(f"kept {path} (reuse it with --model)")
        elif temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        elif writes and path is not None:
            path.unlink(missing_ok=True)
    base = next((line for line in lines if line["case"] == "bf16 swap 0" and line["ok"]), None)
    print(table(lines, base))
    total = time.monotonic() - started
    print(f"total {total:.0f} s" + (" (over the 8-minute budget)" if total > 480 else ""))
    if skipped:
        print(f"skipped after --time-limit {args.time_limit:.0f} s: {', '.join(skipped)}")
    if not all(line["ok"] for line in lines):
        return 1
    return 3 if skipped else 0


def run_precision(source, path: Path | None, precision: str, settings: Settings, device, args, peak: float | None,
                  skipped: list[str], started: float) -> list[dict]:
    """Load the model once at ``precision`` and run its cases; one JSON line each, printed as it finishes."""
    lines = []
    bundle = None
    try:
        t0 = time.perf_counter()
        try:
            bundle = prepare(source, path, precision, settings, device, args.tiny, check=args.model is None)
        except Exception as exc:
            traceback.print_exc()
            failed = Result(Case(precision, 0), error=f"loading failed: {type(exc).__name__}: {exc}")
            return [_emit(record(failed, settings, None, peak, None), args.json)]
        print(f"{precision}: loaded and prepared in {time.perf_counter() - t0:.1f} s "
              f"({bundle.swappable} swappable blocks)", flush=True)
        reference = None
        for case in cases_for(precision, bundle.swappable):
            if time.monotonic() - started > args.time_limit:
                skipped.append(case.label)
                continue
            result = run_case(bundle, case, settings, device)
            if reference is None and result.ok:
                reference = result
            if device.type == "cpu" and result.ok and result.losses != reference.losses:
                # On CPU block swap is exact (training/offload/block_swap.py), so any difference is a bug.
                result.error = f"losses differ from {reference.case.label}'s: {result.losses} vs {reference.losses}"
            lines.append(_emit(record(result, settings, bundle.flops, peak, reference), args.json))
    finally:
        release(bundle)
    return lines


def _emit(line: dict, json_path: Path | None) -> dict:
    text = json.dumps(line)
    print(text, flush=True)
    if json_path is not None:
        with open(json_path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return line


def _comfyui_version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:
        return "?"
    return str(__version__)


if __name__ == "__main__":
    sys.exit(main())
