"""Micro-batches for the pipeline, reproducible from ``(seed, micro-batch index)`` alone.

The first pipeline stage consumes the inputs and the last consumes the targets; with several stages
they are different processes, so both build the same micro-batch independently. Everything random is
drawn from a generator seeded by the global micro-batch index, which also makes resume exact: a run
continued at step N draws exactly what an uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from .loss import noisy_input_and_target, sample_sigmas
from .spec import CacheItem


@dataclass(frozen=True)
class Example:
    latent: torch.Tensor  # raw VAE latent [C, H, W]
    cond: torch.Tensor  # [T, D]
    pooled: torch.Tensor | None  # [D]


def load_examples(items: Sequence[CacheItem]) -> list[Example]:
    """Read every cached item once (latents and embeddings are small next to the model)."""
    loaded: dict[tuple[str, str], Example] = {}
    out = []
    for item in items:
        key = (item.latent_file, item.text_file)
        if key not in loaded:
            lat = load_file(item.latent_file)
            txt = load_file(item.text_file)
            loaded[key] = Example(lat["latent"], txt["cond"], txt.get("pooled"))
        out.append(loaded[key])
    return out


class MicroBatches:
    """Deterministic micro-batches: item order is a per-epoch shuffle, noise is per micro-batch."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int, model, adapter,
                 timestep_sampling: str, device: torch.device, replica: int = 0, replicas: int = 1):
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.model = model  # ComfyUI BaseModel: latent_format, model_sampling, dtypes
        self.adapter = adapter
        self.timestep_sampling = timestep_sampling
        self.device = device
        self.replica = replica
        self.replicas = replicas
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def _indices(self, micro: int) -> list[int]:
        n = len(self.examples)
        start = (micro * self.replicas + self.replica) * self.batch_size
        return [self._order(pos // n)[pos % n] for pos in range(start, start + self.batch_size)]

    def compute_dtype(self) -> torch.dtype:
        return self.model.manual_cast_dtype or self.model.get_dtype()

    def build(self, micro: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``(first-stage inputs, target)`` of global micro-batch ``micro``."""
        batch = [self.examples[i] for i in self._indices(micro)]
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + micro * self.replicas + self.replica) % (2**63))
        x0 = self.model.process_latent_in(torch.stack([b.latent.float() for b in batch]))
        noise = torch.randn(x0.shape, generator=g)
        sigma = sample_sigmas(len(batch), self.timestep_sampling, g, self.model.model_sampling)
        noisy, timestep, target = noisy_input_and_target(self.model.model_sampling, x0, noise, sigma)
        dtype = self.compute_dtype()
        cond = torch.stack([b.cond for b in batch]).to(dtype)
        pooled = torch.stack([b.pooled for b in batch]).to(dtype) if batch[0].pooled is not None else None
        inputs = self.adapter.first_stage_inputs(noisy.to(dtype), timestep, cond, pooled)
        return tuple(t.to(self.device) for t in inputs), target.to(self.device)

    def iterate(self, first_micro: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        micro = first_micro
        while True:
            yield self.build(micro)
            micro += 1
