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

from .cache.reader import read_entries
from .loss import noisy_input_and_target, sample_sigmas
from .spec import CacheItem


@dataclass(frozen=True)
class Example:
    latent: torch.Tensor  # raw VAE latent [C, H, W]
    cond: torch.Tensor  # [T, D]
    pooled: torch.Tensor | None  # [D]

    @property
    def shape_key(self) -> tuple:
        """Examples with equal keys stack into one micro-batch (same bucket)."""
        return tuple(self.latent.shape), tuple(self.cond.shape), None if self.pooled is None else tuple(self.pooled.shape)


def load_examples(items: Sequence[CacheItem]) -> list[Example]:
    """Read every cached item once (latents and embeddings are small next to the model)."""
    keyed: dict[str, set[str]] = {}
    for item in items:
        if item.latent_key:
            keyed.setdefault(item.latent_file, set()).update((item.latent_key, item.text_key))
    tensors = {k: v for index_file, keys in keyed.items() for k, v in read_entries(index_file, keys).items()}
    loaded: dict[tuple[str, str, str, str], Example] = {}
    out = []
    for item in items:
        key = (item.latent_file, item.text_file, item.latent_key, item.text_key)
        if key not in loaded:
            lat = tensors[item.latent_key] if item.latent_key else load_file(item.latent_file)
            txt = tensors[item.text_key] if item.text_key else load_file(item.text_file)
            loaded[key] = Example(lat["latent"], txt["cond"], txt.get("pooled"))
        out.append(loaded[key])
    return out


def bucket_groups(examples: Sequence[Example]) -> list[list[int]]:
    """Indices of the examples grouped by shape, groups in a fixed order."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.shape_key, []).append(i)
    return [groups[k] for k in sorted(groups, key=repr)]


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
        self._groups = bucket_groups(examples)
        self._batches_per_epoch = sum(-(-len(g) // batch_size) for g in self._groups)
        self._epoch_batches: dict[int, list[list[int]]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def _bucket_batches(self, epoch: int) -> list[list[int]]:
        """Several buckets: each bucket shuffled and cut into batches (the last one topped up from
        the same bucket), then the batches of all buckets shuffled; one epoch at a time."""
        if epoch not in self._epoch_batches:
            rng = random.Random(self.seed * 7919 + epoch)
            batches = []
            for group in self._groups:
                order = list(group)
                rng.shuffle(order)
                for s in range(0, len(order), self.batch_size):
                    chunk = order[s:s + self.batch_size]
                    batches.append(chunk + [order[j % len(order)] for j in range(self.batch_size - len(chunk))])
            rng.shuffle(batches)
            self._epoch_batches = {epoch: batches}
        return self._epoch_batches[epoch]

    def _indices(self, micro: int) -> list[int]:
        if len(self._groups) > 1:
            epoch, j = divmod(micro * self.replicas + self.replica, self._batches_per_epoch)
            return self._bucket_batches(epoch)[j]
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
