"""Validation loss: a held-out set evaluated at fixed sigmas and fixed noise.

The training loss of one step is one random draw of items, noise and sigma: it jumps from step to step
and cannot be compared across runs. The validation loss takes the same held-out items, the same noise
and the same sigmas at every evaluation and in every run (they are drawn from :data:`VALIDATION_SEED`,
never from the run's seed), so its curve shows what the LoRA learned, and two runs' curves compare.

Each held-out item is evaluated at ``sigmas`` noise levels drawn once from the run's own timestep
sampling (the model's schedule, shift and bounds: an expert of Wan 2.2 A14B is validated on its own
range); one (item, sigma) is one micro-batch of one example, so memory never exceeds training's, and
the loss is the mean over all of them, computed by the pipeline's own forward (DeepSpeed's
``eval_batch``) with the training loss function.

The split of a cache into training and held-out items is decided by each item's content key, so the
same items are held out in every run of the same dataset, whatever the order or the seed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

import torch

from ..spec.options import CacheItem
from .micro_batches import Example, MicroBatches

VALIDATION_SEED = 7_340_033  # fixed on purpose: the same noise and sigmas in every run, whatever its seed


def _item_rank(item: CacheItem) -> str:
    ident = f"{item.latent_key or item.latent_file}|{item.text_key or item.text_file}"
    return hashlib.sha256(ident.encode()).hexdigest()


def split_items(items: Sequence[CacheItem], fraction: float) -> tuple[tuple[CacheItem, ...], tuple[CacheItem, ...]]:
    """``(training items, held-out items)``: ``ceil(fraction * distinct items)`` distinct examples held out,
    chosen by content key (stable across runs and orders); repeats of one example stay on one side."""
    distinct = sorted({_item_rank(i) for i in items})
    if fraction <= 0 or not distinct:
        return tuple(items), ()
    held = set(distinct[: math.ceil(fraction * len(distinct))])
    return tuple(i for i in items if _item_rank(i) not in held), distinct_items(i for i in items if _item_rank(i) in held)


def distinct_items(items) -> tuple[CacheItem, ...]:
    """Each example once (a dataset's repeats would only evaluate the same thing again), in order."""
    seen: set[str] = set()
    out = []
    for item in items:
        rank = _item_rank(item)
        if rank not in seen:
            seen.add(rank)
            out.append(item)
    return tuple(out)


def split_problems(train: Sequence[CacheItem], held_out: Sequence[CacheItem], fraction: float) -> list[str]:
    """What is wrong with a fraction split (nothing left to train on, or nothing held out)."""
    if fraction > 0 and not train:
        return [f"validation fraction {fraction} holds out every item: lower it or add images to the dataset."]
    if fraction > 0 and not held_out:
        return [f"validation fraction {fraction} holds out no item: raise it."]
    return []


def evaluation_due(step: int, every: int, total: int) -> bool:
    """Whether to evaluate after ``step``: every ``every`` steps and at the last step (0 = before training)."""
    return every > 0 and (step % every == 0 or step == total)


class ValidationBatches:
    """The held-out micro-batches, in one fixed order: item by item, each at its fixed sigmas.

    ``builder`` is the run's :class:`MicroBatches` (it knows the model's sampling, the family adapter and
    the devices); the held-out examples are noised and assembled by exactly the code that assembles
    training micro-batches.
    """

    def __init__(self, examples: Sequence[Example], sigmas_per_item: int, builder: MicroBatches):
        self.examples = list(examples)
        self.per_item = sigmas_per_item
        self.builder = builder

    def __len__(self) -> int:
        return len(self.examples) * self.per_item

    def noise_and_sigma(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x0, noise, sigma)`` of validation micro-batch ``index`` (batch size 1)."""
        item, level = divmod(index, self.per_item)
        example = self.examples[item]
        x0, shapes = self.builder.joined([example], [example.latent])
        # The same levels for every item of a shape: one generator per evaluation, not per item.
        sigmas = self.builder.sigmas(self.per_item, torch.Generator().manual_seed(VALIDATION_SEED),
                                     tuple((shapes[0] if shapes else x0.shape)[1:]))
        g = torch.Generator().manual_seed(VALIDATION_SEED + 1 + index)
        noise = torch.randn(x0.shape, generator=g)
        return x0, noise, sigmas[level:level + 1]

    def build(self, index: int):
        x0, noise, sigma = self.noise_and_sigma(index)
        batch = [self.examples[index // self.per_item]]
        shapes = self.builder.joined(batch, [batch[0].latent])[1]  # packed streams
        return self.builder.assemble(batch, x0, noise, sigma, shapes)

    def __iter__(self) -> Iterator:
        return (self.build(i) for i in range(len(self)))
