"""Worker peak RSS on the Flux-min fixture for each base format: bf16, fp8, scaled fp8, GGUF Q8_0.

Usage: ``python -m pipetrainer.devkit.bench_quant_rss <work folder> [--gguf <ComfyUI-GGUF folder>]``
(with the pack importable as ``pipetrainer``, e.g. through tests' conftest or training/process/entry.py's
``import_pack``). Each format trains two steps (attention LoRA rank 4, bf16 compute, one stage) in the
real process tree; the figure is the rank's ``peak_rss_mb`` from its ``rank_done`` event (whole
process: Python, torch, DeepSpeed, PEFT, ComfyUI, the model). The quantized files are written from
the Flux-min fixture by devkit/quant_fixtures.py (Linear weights quantized, the rest kept).
Each line also gives the sampled peak split into anonymous memory and file-backed pages (a model file
that is memory-mapped and read counts in RSS too) and the phase it was reached in.
``--only`` picks formats; ``--q4k`` adds GGUF Q4_K.

Measured on 2 CPU cores (0.3.75, MiB, worker peak RSS): bf16 2738 (at load: the safetensors pages plus
the loaded copy), fp8 2130, scaled fp8 2139 (both during the step: ComfyUI's bf16 casts of the fp8
weights kept for the backward), GGUF Q8_0 1869 and Q4_K 1818. Q8_0 was 2740 before ComfyUI-GGUF's
loader stopped being given the deferred (weightless) state dict, whose Linears it then filled with fp32
zeros, and before its layers stopped keeping the dequantized weights for the backward (training/quant/gguf.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time
from pathlib import Path


class ProcessTreeSampler:
    """Samples ``/proc/<pid>/status`` of every descendant of this process while a run goes on.

    ``peak_rss_mb`` from the rank says how much, not what: anonymous memory (tensors the process
    allocated) and file-backed pages (a memory-mapped model file that was read) count alike in it.
    The sampler keeps, per process, the sample with the largest VmRSS split into RssAnon and RssFile,
    with its time (matched to the run's last event before it: the phase of the peak).
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peaks: dict[int, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcessTreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _children(pid: int) -> list[int]:
        try:
            tasks = Path(f"/proc/{pid}/task").iterdir()
            return [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            return []

    def _descendants(self) -> list[int]:
        todo, seen = self._children(os.getpid()), []
        while todo:
            pid = todo.pop()
            seen.append(pid)
            todo.extend(self._children(pid))
        return seen

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._descendants():
                try:
                    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                except (OSError, ValueError):
                    continue
                mib = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile") if k in fields}
                if mib.get("VmRSS", 0) > self.peaks.get(pid, {}).get("VmRSS", -1):
                    self.peaks[pid] = {**mib, "time": time.time()}
            time.sleep(self.interval)

    def largest(self) -> dict[str, float]:
        """The peak sample of the process with the largest peak (the rank, in a one-stage run)."""
        return max(self.peaks.values(), key=lambda p: p["VmRSS"], default={})


def phase_at(events: list[dict], when: float) -> str:
    """The last event before ``when`` (its phase, or its type): where the run was at the peak."""
    before = [e for e in events if e.get("time", 0) <= when]
    return (before[-1].get("phase") or before[-1]["type"]) if before else "?"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--gguf", default=os.environ.get("COMFYUI_GGUF_PATH", ""))
    parser.add_argument("--only", nargs="*", help="formats to run (bf16 fp8 scaled_fp8 gguf_Q8_0 gguf_Q4_K)")
    parser.add_argument("--q4k", action="store_true", help="also GGUF Q4_K (random valid blocks)")
    args = parser.parse_args(argv)

    from ..training.model.comfy_env import use_comfyui
    from .host import ensure_host

    root = Path(os.environ["COMFYUI_PATH"]) if os.environ.get("COMFYUI_PATH") else ensure_host()
    use_comfyui(root, "cpu")
    from ..tests.helpers import make_spec, run_training
    from ..training.cache.store import build_cache
    from ..training.data.dataset import scan_dataset
    from ..training.spec.options import LoraSpec
    from . import fixtures, quant_fixtures

    paths = fixtures.ensure_fixtures(root, flux=True)
    flux = root / "models" / "diffusion_models" / fixtures.FLUX_FILE
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    files = {"bf16": (flux, "diffusion_model")}
    builders = {"fp8": quant_fixtures.write_fp8, "scaled_fp8": quant_fixtures.write_scaled_fp8}
    for name, build in builders.items():
        target = work / f"flux-{name}.safetensors"
        if not target.exists():
            build(flux, target)
        files[name] = (target, "diffusion_model")
    for qtype in ("Q8_0", "Q4_K") if args.q4k else ("Q8_0",):
        if not args.gguf:
            break
        target = work / f"flux-{qtype}.gguf"
        if not target.exists():
            quant_fixtures.write_gguf(flux, target, qtype, arch="flux")
        files[f"gguf_{qtype}"] = (target, "gguf")
    if args.only:
        files = {k: v for k, v in files.items() if k in args.only}

    import comfy.sd
    import comfy.utils

    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(paths.vae)))
    clip = comfy.sd.load_clip([str(paths.clip)], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    cache = build_cache(scan_dataset(paths.dataset, 64), vae, clip, work / "cache")
    del vae, clip

    results = {}
    for name, (path, loader) in files.items():
        spec = make_spec(path, cache.items[:1], work / f"run-{name}", root, steps=2, dtype="bf16",
                         lora=LoraSpec(rank=4, alpha=4.0, targets="attention"))
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, loader=loader, extension_path=args.gguf))
        with ProcessTreeSampler() as sampler:
            code, events = run_training(spec, timeout=1800)
        peak = sampler.largest()
        done = [e for e in events if e["type"] == "rank_done"]
        if code != 0 or not done:
            print(f"{name}: failed ({code}): {[e for e in events if e['type'] == 'error'][:1]}", flush=True)
            continue
        results[name] = done[0]["peak_rss_mb"]
        print(f"{name}: file {path.stat().st_size / 2**20:.0f} MiB, worker peak RSS {results[name]:.0f} MiB "
              f"(sampled peak {peak.get('VmRSS', 0):.0f} MiB = anon {peak.get('RssAnon', 0):.0f} + file "
              f"{peak.get('RssFile', 0):.0f}, after '{phase_at(events, peak.get('time', 0))}')", flush=True)
    return results


if __name__ == "__main__":
    main()
