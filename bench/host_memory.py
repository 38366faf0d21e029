"""Benchmark: host memory of the whole machine while a LoRA trains, ComfyUI's process included.

This process plays ComfyUI: it loads a real-layout Flux (hidden 3072, 24 heads; ``--double-blocks`` +
``--single-blocks``, default 2 + 3 = 1.15 B parameters, seeded random bf16 weights, built on the first
run) with the stock path of ``Load Diffusion Model (PipeTrainer)``, caches the demo dataset, and runs
the Train LoRA node's own ``execute`` (1 and 2 pipeline stages, ``training_dtype`` bf16, the file's
dtype). A sampler thread reads the proportional set size (PSS, from
``/proc/<pid>/smaps_rollup``: shared file pages are split between the processes that map them, so the
sum is what the machine holds) of this process and every descendant (the supervisor and its ranks) four
times a second. Printed per run: the file size; ComfyUI's PSS after its loader ran and its peak while the
ranks train; each other process's peak; the peak of the sum at one instant (x = over the file size);
s/step (median of the steps after the first, from the run's events).

    .venv/bin/python bench/host_memory.py [--stages 1 2] [--steps 4] [--workdir DIR]
    COMFYUI_PATH=$PWD/.host/current/ComfyUI .host/current/venv/bin/python bench/host_memory.py

``--native`` also times ComfyUI's own trainer (``TrainLoraNode``, comfy_extras/nodes_train.py) on the
same model, latents, conditioning, rank and dtype, where the host's trainer takes that model.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _pack import import_pack

SAMPLE_S = 0.25
RANK = 16


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(root: int) -> dict[int, str]:
    """Every live process under ``root``, with a short name from its command line."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                parent[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in out:
                out[child] = _name(child)
                frontier.append(child)
    return out


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return "?"
    for word in words:
        if word.startswith("--rank") or "rank" in word.rsplit("/", 1)[-1]:
            return word.rsplit("/", 1)[-1]
    return " ".join(w.rsplit("/", 1)[-1] for w in words[:3])[:60]


class PssSampler:
    """Peak PSS of this process, of each descendant and of their sum at one instant."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.peak_self = 0
        self.peak_total = 0
        self.peaks: dict[int, tuple[str, int]] = {}
        self.samples: list[tuple[float, int, int]] = []  # (time.time(), this process, sum)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            own = pss_bytes(self.me)
            total = own
            for pid, name in descendants(self.me).items():
                value = pss_bytes(pid)
                total += value
                if value > self.peaks.get(pid, ("", 0))[1]:
                    self.peaks[pid] = (name, value)
            self.peak_self = max(self.peak_self, own)
            self.peak_total = max(self.peak_total, total)
            self.samples.append((time.time(), own, total))
            self._stop.wait(SAMPLE_S)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def model_file(folder: Path, double_blocks: int, single_blocks: int) -> Path:
    from pipetrainer.devkit.fixtures import build_min_flux

    path = folder / f"bench-flux-{double_blocks}d{single_blocks}s.safetensors"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.building")
        build_min_flux(tmp, seed=11, double_blocks=double_blocks, single_blocks=single_blocks)
        tmp.replace(path)
    return path


def demo_cache(workdir: Path):
    import comfy.sd
    import comfy.utils
    from pipetrainer.devkit.fixtures import ensure_fixtures
    from pipetrainer.devkit.host import ensure_host
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    fixtures = ensure_fixtures(ensure_host())
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixtures.vae)))
    clip = comfy.sd.load_clip([str(fixtures.clip)], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    return build_cache(scan_dataset(fixtures.dataset, 64), vae, clip, workdir / "cache"), vae, clip


def step_times(run_dir: Path) -> list[float]:
    from pipetrainer.training.process.events import read_all

    return [e["time"] for e in read_all(run_dir) if e["type"] == "step"]


def seconds_per_step(times: list[float]) -> float | None:
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)] or [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def train_once(model_name: str, cache, stages: int, steps: int) -> dict:
    """Load the model as the loader node does, then run the Train node; PSS sampled throughout."""
    from pipetrainer.nodes import train
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel
    from pipetrainer.nodes.run import paths
    from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

    name = f"bench-host-memory-{secrets.token_hex(3)}"
    train.WARM_POOL.enabled = False
    with PssSampler() as sampler:
        time.sleep(2 * SAMPLE_S)
        before_load = pss_bytes(os.getpid())
        model = PipeTrainerLoadDiffusionModel.execute(model_name, "default").result[0]
        time.sleep(2 * SAMPLE_S)
        after_load = pss_bytes(os.getpid())
        sampler.peak_self = 0  # from here: ComfyUI while the ranks train
        try:
            train.PipeTrainerTrain.execute(
                model, cache, LoraSpec(rank=RANK, alpha=float(RANK)), OptimizerSpec(lr=1e-4, weight_decay=0.0), name,
                steps=steps, batch_size=1, gradient_accumulation=stages, seed=0, save_every=0, training_dtype="bf16",
                gradient_checkpointing=True, pipeline_stages=stages, partition_method="parameters", resume=False)
            [run_dir] = Path(paths.runs_root()).glob(f"{name}-*")
            steps_at = step_times(run_dir)
        finally:
            for run in Path(paths.runs_root()).glob(f"{name}-*"):
                shutil.rmtree(run, ignore_errors=True)
            Path(paths.lora_output_path(name)).unlink(missing_ok=True)
    del model
    # while the ranks train: from the first step's report to the last one's (set-up and the end excluded)
    training = [s for s in sampler.samples if steps_at and steps_at[0] - 1.0 <= s[0] <= steps_at[-1]]
    return {"before_load": before_load, "after_load": after_load,
            "comfy_training": max((s[1] for s in training), default=0),
            "total_training": max((s[2] for s in training), default=0), "total": sampler.peak_total,
            "others": sorted(sampler.peaks.values(), key=lambda p: -p[1]), "s_per_step": seconds_per_step(steps_at)}


def native_seconds_per_step(model_name: str, cache, vae, clip, steps: int) -> str:
    """ComfyUI's own TrainLoraNode on the same model, latents, conditioning, rank and dtype, or why not."""
    try:
        import comfy.utils
        import comfy_extras.nodes_train as native
        import numpy as np
        import torch
        from PIL import Image
        from pipetrainer.devkit.fixtures import ensure_fixtures
        from pipetrainer.devkit.host import ensure_host
        from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

        import nodes

        model = PipeTrainerLoadDiffusionModel.execute(model_name, "default").result[0]
        images = sorted(p for p in ensure_fixtures(ensure_host()).dataset.iterdir() if p.suffix == ".png")
        pixels = [torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize((64, 64)), np.float32) / 255)[None]
                  for p in images]  # the dataset the Train runs use, at their 64 px
        latents = torch.cat([vae.encode(x) for x in pixels])
        positive = nodes.CLIPTextEncode().encode(clip, "a photo")[0]
        node = native.TrainLoraNode
        ticks: list[float] = []  # the trainer reports each step through ComfyUI's progress bar
        comfy.utils.set_progress_bar_global_hook(lambda *_args, **_kwargs: ticks.append(time.monotonic()))
        ours = dict(batch_size=1, grad_accumulation_steps=1, steps=1 + steps, learning_rate=1e-4, rank=RANK,
                    optimizer="AdamW", loss_function="MSE", seed=0, training_dtype="bf16", lora_dtype="bf16",
                    algorithm="LoRA", gradient_checkpointing=True, existing_lora="[None]")
        # the host's other inputs at their defaults (newer ComfyUI adds offloading, buckets, ...)
        defaults = {i.id: i.default for i in node.define_schema().inputs if getattr(i, "default", None) is not None}
        kwargs = {**defaults, **ours}
        kwargs = {k: v for k, v in kwargs.items() if k not in ("model", "latents", "positive")}
        # one latent dict per image: 0.3.75's trainer fails on a single batched dict (unset multi_res)
        node.execute([model], [{"samples": x[None]} for x in latents], [positive],
                     **{k: [v] for k, v in kwargs.items()})
        gaps = [b - a for a, b in zip(ticks[1:], ticks[2:], strict=False)]
        return f"{statistics.median(gaps):.2f}" if gaps else f"not measured: {len(ticks)} progress reports"
    except Exception as exc:  # noqa: BLE001 - reported: the host's trainer may not take this model here
        return f"not measured: {type(exc).__name__}: {str(exc)[:160]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--double-blocks", type=int, default=2)
    parser.add_argument("--single-blocks", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="keeps the model file between runs")
    parser.add_argument("--native", action="store_true", help="also time ComfyUI's own TrainLoraNode")
    args = parser.parse_args(argv)
    if len(args.stages) > 1 or (args.native and args.stages):  # each measurement in a fresh process
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pipetrainer-host-memory-"))
        common = ["--steps", str(args.steps), "--double-blocks", str(args.double_blocks),
                  "--single-blocks", str(args.single_blocks), "--workdir", str(workdir)]
        runs = [["--stages", str(n)] for n in args.stages] + ([["--stages", "--native"]] if args.native else [])
        codes = [subprocess.run([sys.executable, __file__, *run, *common]).returncode for run in runs]
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        return max(codes)

    import_pack()
    from pipetrainer.devkit.host import ensure_host
    from pipetrainer.training.model.comfy_env import use_comfyui

    use_comfyui(ensure_host(), "cpu")
    import folder_paths

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pipetrainer-host-memory-"))
    models = workdir / "models"
    models.mkdir(parents=True, exist_ok=True)
    folder_paths.add_model_folder_path("diffusion_models", str(models))
    path = model_file(models, args.double_blocks, args.single_blocks)
    size = path.stat().st_size
    cache, vae, clip = demo_cache(workdir)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    if args.stages:
        print(f"model: Flux layout {args.double_blocks}d+{args.single_blocks}s, {params / 1e9:.2f} B parameters, "
              f"file {gb(size)} (bf16); LoRA rank {RANK}, training_dtype bf16, {args.steps} steps")
    for stages in args.stages:
        r = train_once(path.name, cache, stages, args.steps)
        print(f"\n{stages} stage(s):")
        print(f"  ComfyUI before its loader     {gb(r['before_load'])}  (imports, the cache's encoders)")
        print(f"  ComfyUI after its loader      {gb(r['after_load'])}  ({r['after_load'] / size:.2f}x the file)")
        print(f"  ComfyUI while ranks train     {gb(r['comfy_training'])}  ({r['comfy_training'] / size:.2f}x)")
        for name, value in r["others"]:
            print(f"  {name:<29} {gb(value)}  ({value / size:.2f}x)  peak")
        print(f"  machine while ranks train     {gb(r['total_training'])}  ({r['total_training'] / size:.2f}x the file)")
        print(f"  machine, whole node (peak)    {gb(r['total'])}  ({r['total'] / size:.2f}x the file)")
        step = r["s_per_step"]
        print(f"  s/step                        {step:.2f}" if step else "  s/step                        -")
    if args.native:
        print(f"\nComfyUI TrainLoraNode s/step: {native_seconds_per_step(path.name, cache, vae, clip, args.steps)}")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


if __name__ == "__main__":
    raise SystemExit(main())
