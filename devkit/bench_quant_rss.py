"""Worker peak RSS on the Flux-min fixture for each base format: bf16, fp8, scaled fp8, GGUF Q8_0.

Usage: ``python -m pipetrainer.devkit.bench_quant_rss <work folder> [--gguf <ComfyUI-GGUF folder>]``
(with the pack importable as ``pipetrainer``, e.g. through tests' conftest or training/entry.py's
``import_pack``). Each format trains two steps (attention LoRA rank 4, bf16 compute, one stage) in the
real process tree; the figure is the rank's ``peak_rss_mb`` from its ``rank_done`` event (whole
process: Python, torch, DeepSpeed, PEFT, ComfyUI, the model). The quantized files are written from
the Flux-min fixture by devkit/quant_fixtures.py (Linear weights quantized, the rest kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--gguf", default=os.environ.get("COMFYUI_GGUF_PATH", ""))
    args = parser.parse_args(argv)

    from ..training.comfy_env import use_comfyui
    from .host import ensure_host

    root = Path(os.environ["COMFYUI_PATH"]) if os.environ.get("COMFYUI_PATH") else ensure_host()
    use_comfyui(root, "cpu")
    from ..tests.helpers import make_spec, run_training
    from ..training.cache.store import build_cache
    from ..training.dataset import scan_dataset
    from ..training.spec import LoraSpec
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
    if args.gguf:
        target = work / "flux-Q8_0.gguf"
        if not target.exists():
            quant_fixtures.write_gguf(flux, target, "Q8_0", arch="flux")
        files["gguf_Q8_0"] = (target, "gguf")

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
        code, events = run_training(spec, timeout=1800)
        done = [e for e in events if e["type"] == "rank_done"]
        if code != 0 or not done:
            print(f"{name}: failed ({code}): {[e for e in events if e['type'] == 'error'][:1]}", flush=True)
            continue
        results[name] = done[0]["peak_rss_mb"]
        print(f"{name}: file {path.stat().st_size / 2**20:.0f} MiB, worker peak RSS {results[name]:.0f} MiB", flush=True)
    return results


if __name__ == "__main__":
    main()
