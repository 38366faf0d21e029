"""Regularization (prior) images mixed into training by whole micro-batches.

A micro-batch holds one bucket shape, so it is either a training or a regularization micro-batch. Which
one is a pure function of its index ``i`` on each replica: a regularization one when
``floor((i + 1) * ratio) > floor(i * ratio)``. So the first ``N`` micro-batches hold exactly
``floor(N * ratio)`` regularization ones (any ``N`` in a row: that or one more), every replica mixes
alike (a step's micro-batches have the same kinds on every replica), and nothing depends on earlier
draws: resume at any step and the first and last pipeline stage (built independently) agree.

Each kind draws from its own :class:`~training.data.MicroBatches` stream, consumed in order: training
micro-batch ``i`` is the training stream's ``i - floor(i * ratio)``-th, a regularization one the
regularization stream's ``floor(i * ratio)``-th. With regularization off the training stream sees
exactly the indices it saw before the option existed. The regularization stream has its own seed
(:data:`SEED_OFFSET` from the run's), so its shuffles, noise and sigmas are its own, and its labels carry
``weight`` as the micro-batch's ``item_scale`` (the labels contract of training/objective/loss.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction

import torch

from ..objective.loss_weighting import scale_labels
from .micro_batches import MicroBatches

SEED_OFFSET = 2**40  # the regularization stream's seed: the run's + this (no overlap with any real run's noise)
_RATIO_DENOMINATOR = 10**6  # ratios are exact fractions, so every rank counts alike and N * 0.29 gives 29 per 100


def exact_ratio(ratio: float) -> Fraction:
    """``ratio`` as the nearest fraction with a denominator up to 10^6 (0.29 is 29/100, not 0.28999...)."""
    return Fraction(ratio).limit_denominator(_RATIO_DENOMINATOR)


def regularization_before(micro: int, ratio: Fraction) -> int:
    """How many of micro-batches ``0 .. micro - 1`` are regularization ones: ``floor(micro * ratio)``."""
    return (micro * ratio.numerator) // ratio.denominator


def is_regularization(micro: int, ratio: Fraction) -> bool:
    """Whether micro-batch ``micro`` (of one replica) draws from the regularization images."""
    return regularization_before(micro + 1, ratio) > regularization_before(micro, ratio)


class MixedMicroBatches:
    """Training and regularization micro-batches interleaved by :func:`is_regularization`."""

    def __init__(self, training: MicroBatches, regularization: MicroBatches, ratio: float, weight: float):
        self.training = training
        self.regularization = regularization
        self.ratio = exact_ratio(ratio)
        self.weight = float(weight)

    def build(self, micro: int):
        """``(first-stage inputs, labels)`` of micro-batch ``micro`` of this replica."""
        before = regularization_before(micro, self.ratio)
        if not is_regularization(micro, self.ratio):
            return self.training.build(micro - before)
        inputs, labels = self.regularization.build(before)
        return inputs, scale_labels(labels, torch.tensor(self.weight))

    def iterate(self, first_micro: int) -> Iterator:
        micro = first_micro
        while True:
            yield self.build(micro)
            micro += 1


def regularization_seed(seed: int) -> int:
    """The regularization stream's seed for a run of ``seed``."""
    return seed + SEED_OFFSET
