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

The code: bench/_gpu_model.py (settings, loading the model and building its LoRA stage and batch),
bench/_gpu_cases.py (the case list and one case's run), bench/_gpu_measure.py (memory, peak and FLOP
measurements), bench/_gpu_report.py (JSON lines and the table); this script parses the command line,
writes the model file and runs the precisions in turn.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _gpu_cases import Case, Result, cases_for, run_case
from _gpu_measure import peak_tflops
from _gpu_model import Settings, prepare, release
from _gpu_report import emit, record, table
from _pack import import_pack


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
            return [emit(record(failed, settings, None, peak, None), args.json)]
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
            lines.append(emit(record(result, settings, bundle.flops, peak, reference), args.json))
    finally:
        release(bundle)
    return lines


def _comfyui_version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:
        return "?"
    return str(__version__)


if __name__ == "__main__":
    sys.exit(main())
