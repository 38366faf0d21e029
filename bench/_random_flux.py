"""A Flux-architecture model from seeded random weights, loaded by ComfyUI's own loader (nothing downloaded).

``FULL`` is FLUX.1-dev's architecture (hidden 3072, 24 heads, 19 double + 38 single blocks, T5 context
4096, CLIP vector 768, guidance embedding: 11.9 B parameters, 23.8 GB in bf16). The weights are written
to a safetensors file one tensor at a time (bench/_safetensors_stream.py; each tensor is drawn on the
compute device, so a GPU makes them in seconds) and loaded back through
``training.model_source.load_model`` with the recipe's ``weight_dtype``, exactly as a training rank
loads a UNETLoader model: ComfyUI's detection, its fp8 conversion at load (``fp8_e4m3fn`` turns the
bf16 file into fp8 weights), its manual-cast layers. ``in_memory`` skips the file (for a machine whose
disk is small or slow) and hands the same state dict to ``comfy.sd.load_diffusion_model_state_dict``,
the function ``load_diffusion_model`` calls after reading the file: only the file read differs.

``TINY`` (hidden 128, 1 head, 2 double + 4 single blocks) is for a CPU dry run. ComfyUI's shape
detection cannot see a tiny Flux (it pins 24 heads and rotary axes [16, 56, 56], so hidden 3072), so
for it :func:`detection_as` makes ``comfy.model_detection.detect_unet_config`` answer the tiny
configuration while the file loads; the rest of the loader runs unchanged.

Weights: N(0, 0.02), RMSNorm scales 1 + N(0, 0.02) (as devkit/fixtures.py), each tensor from its own
generator seeded by ``seed`` and its position, so any tensor can be drawn again to check what loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from _safetensors_stream import Plan, write_streamed

FULL = {
    "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072,
    "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38, "axes_dim": [16, 56, 56],
    "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
}
TINY = {**FULL, "vec_in_dim": 32, "context_in_dim": 64, "hidden_size": 128, "num_heads": 1, "depth": 2,
        "depth_single_blocks": 4}
STD = 0.02


def unet_config(params: Mapping) -> dict:
    """What ComfyUI's detection returns for a Flux.1 model of these parameters (on this ComfyUI)."""
    from pipetrainer.devkit.fixtures import flux_params

    return {"image_model": "flux", **flux_params(**params)}


def weight_plan(params: Mapping, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every weight of ComfyUI's ``Flux`` with these parameters: name -> (shape, dtype), in module order."""
    from comfy.ldm.flux.model import Flux

    config = unet_config(params)
    model = Flux(operations=torch.nn, dtype=dtype, device="meta", **config)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _is_norm_scale(name: str) -> bool:
    return name.endswith((".scale", "norm.weight"))  # RMSNorm: .scale on 0.3.75, .weight on newer ComfyUI


class RandomFlux:
    """Seeded random weights for :func:`weight_plan`, drawn on ``device`` tensor by tensor."""

    def __init__(self, params: Mapping, seed: int, device: torch.device | str) -> None:
        self.params = dict(params)
        self.plan: Plan = weight_plan(params)
        self.seed = seed
        self.device = torch.device(device)
        self._index = {name: i for i, name in enumerate(self.plan)}

    @property
    def parameters(self) -> int:
        return sum(int(torch.Size(shape).numel()) for shape, _ in self.plan.values())

    @property
    def nbytes(self) -> int:
        return sum(int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in self.plan.values())

    def make(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor ``name`` (the same values every time), on the generating device."""
        plan_shape, plan_dtype = self.plan[name]
        g = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + self._index[name])
        t = torch.randn(plan_shape, generator=g, device=self.device, dtype=torch.float32) * STD
        if _is_norm_scale(name):
            t += 1.0
        return t.to(dtype or plan_dtype)

    def write(self, path: Path) -> int:
        """Write the model as a safetensors file (streamed); return its size in bytes."""
        return write_streamed(path, self.plan, self.make, metadata={"pipetrainer_bench": f"random flux seed {self.seed}"})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in host memory (what ComfyUI's loader would read from the file)."""
        return {name: self.make(name).cpu() for name in self.plan}

    def check_loaded(self, diffusion_model: torch.nn.Module, names: int = 4) -> None:
        """Raise unless the loaded model has these parameters and, for a few weights spread over the
        model, exactly these values (cast to the loaded dtype, as ComfyUI's loader casts them)."""
        import comfy.utils

        problems = [f"{k}: loaded {getattr(diffusion_model.params, k, None)!r}, written {v!r}"
                    for k, v in self.params.items() if getattr(diffusion_model.params, k, None) != v]
        keys = list(self.plan)
        picks = {keys[0], keys[-1], *(keys[i * len(keys) // names] for i in range(1, names))}
        picks |= {next(k for k in keys if _is_norm_scale(k))}
        for name in sorted(picks):
            loaded = comfy.utils.get_attr(diffusion_model, name).detach()
            expected = self.make(name).to(loaded.device).to(loaded.dtype)  # cast where ComfyUI cast it
            if not torch.equal(loaded.float(), expected.float()):
                problems.append(f"{name}: the loaded values differ from the written ones")
        if problems:
            raise RuntimeError("ComfyUI's loader did not load the random Flux as written: " + "; ".join(problems))


@contextlib.contextmanager
def detection_as(config: Mapping) -> Iterator[None]:
    """While inside, ComfyUI's shape detection answers ``config`` (a tiny Flux it cannot detect itself)."""
    import comfy.model_detection as detection

    original = detection.detect_unet_config

    def detect(*_args, **_kwargs) -> dict:
        return dict(config)

    detection.detect_unet_config = detect
    try:
        yield
    finally:
        detection.detect_unet_config = original


def load(source: RandomFlux, path: Path | None, weight_dtype: str, compute_dtype: str, tiny: bool):
    """A ComfyUI ModelPatcher of ``source``: from ``path`` through the trainer's ``load_model``, or, with
    ``path`` None, from its state dict in memory through ComfyUI's state-dict loader."""
    import comfy.sd
    from pipetrainer.training.model.model_source import load_model, model_options, use_compute_dtype
    from pipetrainer.training.spec.options import ModelRecipe

    with detection_as(unet_config(source.params)) if tiny else contextlib.nullcontext():
        if path is not None:
            return load_model(ModelRecipe("diffusion_model", str(path), weight_dtype), compute_dtype)
        patcher = comfy.sd.load_diffusion_model_state_dict(source.state_dict(),
                                                            model_options=model_options(weight_dtype, compute_dtype))
    if patcher is None:
        raise RuntimeError("ComfyUI did not detect the random Flux state dict as a model.")
    use_compute_dtype(patcher, compute_dtype)
    return patcher
