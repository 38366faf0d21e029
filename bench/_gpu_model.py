"""bench/gpu.py's model side: the run's settings, and one loaded Flux with its LoRA stage and fixed batch.

:func:`prepare` loads the random Flux (bench/_random_flux.py) at one precision through the trainer's
loader, builds the adapter's stage layers, injects the LoRA and draws the batch (bench/gpu_smoke.py);
the resulting :class:`Bundle` serves every case of that precision, and :func:`release` frees it before
the next load. Torch and the pack are imported inside the functions (after bench/_pack.py has made
``pipetrainer`` importable).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

from _gpu_measure import Flops

LORA_TARGETS = "attention_mlp"


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
