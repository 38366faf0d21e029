"""Micro-batches for the pipeline, reproducible from ``(seed, micro-batch index)`` alone.

The first pipeline stage consumes the inputs and the last consumes the targets; with several stages
they are different processes, so both build the same micro-batch independently. Everything random is
drawn from a generator seeded by the global micro-batch index, which also makes resume exact: a run
continued at step N draws exactly what an uninterrupted run would have drawn.

Batching policy: a micro-batch holds items of one latent shape (one bucket); captions of different
token counts share it, their conds brought to one length by the family adapter's ``text_length``
(zero tokens appended, or cut). Each bucket draws from its own stream of per-epoch shuffles, so a
bucket's last partial batch continues with the next shuffle's items, never with repeats of the
batch's own; an epoch has ceil(items / batch size) batches of each bucket, buckets interleaved at
random. Only a bucket smaller than the batch size repeats items within a micro-batch, since DeepSpeed
micro-batches all have one size.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from .cache.reader import read_entries
from .loss import noisy_input_and_target
from .pipelines.base import Batch
from .spec import CacheItem, TimestepSpec
from .timesteps import sample_sigmas


@dataclass(frozen=True)
class Example:
    latent: torch.Tensor  # raw VAE latent [C, H, W] or [C, F, H, W]
    cond: torch.Tensor | None  # [T, D]; None on a rank that builds no model inputs (the last stage)
    pooled: torch.Tensor | None  # [D]
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)  # the family's named extras (ExtraSpec)
    latent_extra_shapes: tuple = ()  # (name, shape) of the latent entry's extras (reference latents), sorted

    @property
    def shape_key(self) -> tuple:
        """Examples with equal keys stack into one micro-batch (same bucket): the latent shape and the
        shapes of the latent entry's extras (an edit item's references: their count and sizes) decide,
        so every rank groups alike whether or not it read the text (the text width and pooled shape are
        the same for every item of one cache, and the token count is padded or cut to the family's
        length by :func:`stack_text`)."""
        return tuple(self.latent.shape) + self.latent_extra_shapes


_LATENT_KEYS = ("latent",)
_TEXT_KEYS = ("cond", "pooled")


def load_examples(items: Sequence[CacheItem], text: bool = True,
                  text_dtype: torch.dtype | None = None) -> list[Example]:
    """Read every cached item once (latents and embeddings are small next to the model).

    ``text=False`` reads latents only: the last pipeline stage needs the targets (latents and noise),
    not the model inputs. ``text_dtype`` keeps embeddings in the compute dtype: a cache stores them at
    the training dtype already (a no-op then); older caches hold fp32, cast here once.
    Every other tensor of an entry is a named extra (caches written before extras have none)."""
    keyed: dict[str, set[str]] = {}
    for item in items:
        if item.latent_key:
            keyed.setdefault(item.latent_file, set()).update((item.latent_key, item.text_key) if text else
                                                             (item.latent_key,))
    tensors = {k: v for index_file, keys in keyed.items() for k, v in read_entries(index_file, keys).items()}
    loaded: dict[tuple[str, str, str, str], Example] = {}
    out = []
    for item in items:
        key = (item.latent_file, item.text_file, item.latent_key, item.text_key)
        if key not in loaded:
            lat = tensors[item.latent_key] if item.latent_key else load_file(item.latent_file)
            cond = pooled = None
            extras = {k: v for k, v in lat.items() if k not in _LATENT_KEYS}
            latent_extra_shapes = tuple((k, tuple(v.shape)) for k, v in sorted(extras.items()))
            if text:
                txt = tensors[item.text_key] if item.text_key else load_file(item.text_file)
                cond, pooled = txt["cond"], txt.get("pooled")
                if text_dtype is not None:
                    cond = cond.to(text_dtype)
                    pooled = pooled.to(text_dtype) if pooled is not None else None
                extras.update({k: v for k, v in txt.items() if k not in _TEXT_KEYS})
            loaded[key] = Example(lat["latent"], cond, pooled, extras, latent_extra_shapes)
        out.append(loaded[key])
    return out


def bucket_groups(examples: Sequence[Example]) -> list[list[int]]:
    """Indices of the examples grouped by latent shape, groups in a fixed order."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.shape_key, []).append(i)
    return [groups[k] for k in sorted(groups, key=repr)]


def stack_text(conds: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """``[B, length, ...]``: every ``[T, ...]`` cond (or text mask) cut to ``length`` tokens or followed by zeros."""
    out = conds[0].new_zeros(len(conds), length, *conds[0].shape[1:])
    for i, c in enumerate(conds):
        n = min(length, c.shape[0])
        out[i, :n] = c[:n]
    return out


class MicroBatches:
    """Deterministic micro-batches: item order is a per-bucket stream of shuffles, noise is per micro-batch."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int, model, adapter,
                 timesteps: TimestepSpec, device: torch.device, replica: int = 0, replicas: int = 1,
                 family_options: object = None):
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.model = model  # ComfyUI BaseModel: latent_format, model_sampling, dtypes
        self.adapter = adapter
        self.timesteps = timesteps
        self.family_options = family_options  # the family's typed options (training.pipelines.options)
        self.device = device
        self.replica = replica
        self.replicas = replicas
        self._groups = bucket_groups(examples)
        self._per_epoch = [-(-len(g) // batch_size) for g in self._groups]  # batches of each bucket per epoch
        self._batches_per_epoch = sum(self._per_epoch)
        self._orders: dict[tuple[int, int], list[int]] = {}
        self._plans: dict[int, list[tuple[int, int]]] = {}
        self._carry: dict[int, tuple[int, int, list[int]]] = {}  # bucket -> (next batch, stream position, handed on)

    def _bucket_order(self, bucket: int, epoch: int) -> list[int]:
        """The ``epoch``-th shuffle of one bucket's items (its stream is these shuffles in a row)."""
        key = (bucket, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self._groups):
                self._orders.clear()
            order = list(self._groups[bucket])
            random.Random(f"{self.seed}:{bucket}:{epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def _epoch_plan(self, epoch: int) -> list[tuple[int, int]]:
        """``(bucket, that bucket's batch number)`` of each micro-batch of ``epoch``, in drawing order:
        every bucket gives ceil(items / batch size) batches per epoch, the buckets interleaved at random."""
        if epoch not in self._plans:
            labels = [b for b, m in enumerate(self._per_epoch) for _ in range(m)]
            random.Random(self.seed * 7919 + epoch).shuffle(labels)
            seen = [0] * len(self._groups)
            plan = []
            for b in labels:
                plan.append((b, epoch * self._per_epoch[b] + seen[b]))
                seen[b] += 1
            self._plans = {epoch: plan}
        return self._plans[epoch]

    def _bucket_batch(self, bucket: int, number: int) -> list[int]:
        """Batch ``number`` of a bucket: the next ``batch_size`` items of its stream of shuffles.

        A batch that runs past the end of a shuffle continues with the next one, whose first items may
        already be in it: such an item is handed on to the following batch, which takes it first. So a
        bucket of at least ``batch_size`` items never repeats an item within a micro-batch, and still
        draws every item once per shuffle. A bucket smaller than the batch size has to repeat items:
        every micro-batch has the same size.

        Hand-ons reach at most the next batch, so the state before a batch is known without replaying
        from the start unless shuffles are shorter than a few batches; the state after the last batch
        asked for is kept, so drawing batches in order never replays.
        """
        n, size = len(self._groups[bucket]), self.batch_size
        if n < size:
            return [self._bucket_order(bucket, p // n)[p % n] for p in range(number * size, (number + 1) * size)]
        first = number
        while first > 0 and self._may_hand_on(n, first):
            first -= 1
        carried = self._carry.get(bucket)
        if carried is not None and first <= carried[0] <= number:
            first, pos, handed = carried
        else:
            pos, handed = first * size, []
        for _ in range(first, number + 1):
            pending, handed, batch = handed, [], []
            for item in pending:
                (handed if item in batch or len(batch) == size else batch).append(item)
            while len(batch) < size:
                item = self._bucket_order(bucket, pos // n)[pos % n]
                pos += 1
                (handed if item in batch else batch).append(item)
        self._carry[bucket] = (number + 1, pos, handed)
        return batch

    def _may_hand_on(self, n: int, number: int) -> bool:
        """Whether items can be handed on to batch ``number`` (from a batch that read two shuffles):
        the stream positions its two predecessors and it may read span two shuffles of ``n``."""
        size = self.batch_size
        lo, hi = max(0, (number - 2) * size), (number + 1) * size - 2
        return lo // n != hi // n

    def _indices(self, micro: int) -> list[int]:
        epoch, j = divmod(micro * self.replicas + self.replica, self._batches_per_epoch)
        return self._bucket_batch(*self._epoch_plan(epoch)[j])

    def compute_dtype(self) -> torch.dtype:
        return self.model.manual_cast_dtype or self.model.get_dtype()

    def build(self, micro: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """``(first-stage inputs, target)`` of global micro-batch ``micro``; the target is
        ``(target, loss weight)`` when the family masks the loss."""
        batch = [self.examples[i] for i in self._indices(micro)]
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + micro * self.replicas + self.replica) % (2**63))
        x0 = self.processed_latents([b.latent for b in batch])
        noise = torch.randn(x0.shape, generator=g)
        sigma = self.sigmas(len(batch), g, tuple(x0.shape[1:]))
        return self.assemble(batch, x0, noise, sigma)

    def sigmas(self, n: int, generator: torch.Generator, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """``n`` sigmas of the run's timestep sampling for latents of ``latent_shape`` (``[C, ...]``)."""
        tokens = self.adapter.image_tokens(self.model.diffusion_model, latent_shape)
        return sample_sigmas(n, self.timesteps, generator, self.model.model_sampling, tokens)

    def assemble(self, batch: Sequence[Example], x0: torch.Tensor, noise: torch.Tensor,
                 sigma: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """``(first-stage inputs, target)`` of ``batch`` (its processed latents ``x0``) noised with
        ``noise`` at ``sigma``: the one place micro-batches become model inputs, for training and
        validation alike."""
        noisy, timestep, target = noisy_input_and_target(self.model.model_sampling, x0, noise, sigma)
        mask = self.adapter.loss_mask(tuple(x0.shape[1:]), self.family_options)
        labels = target.to(self.device) if mask is None else (target.to(self.device), mask[None].to(self.device))
        dtype = self.compute_dtype()
        if batch[0].cond is None:  # a last stage: DeepSpeed reads only the target there
            return (), labels
        length = self.adapter.text_length([len(b.cond) for b in batch])
        cond = stack_text([b.cond for b in batch], length).to(dtype)
        pooled = torch.stack([b.pooled for b in batch]).to(dtype) if batch[0].pooled is not None else None
        inputs = self.adapter.first_stage_inputs(Batch(
            noisy=noisy.to(dtype), timestep=timestep, cond=cond, pooled=pooled,
            extras=self._stacked_extras(batch, length, dtype), options=self.family_options, clean=x0.to(dtype),
        ))
        return tuple(t.to(self.device) for t in inputs), labels

    def processed_latents(self, latents: Sequence[torch.Tensor]) -> torch.Tensor:
        """Raw cached VAE latents of one shape, stacked, as the model takes them (``process_latent_in``);
        on a video model an image latent ``[C, H, W]`` trains as a 1-frame video."""
        values = [lat.float() for lat in latents]
        if self.adapter.geometry(self.model.diffusion_model).video:
            values = [lat.unsqueeze(1) if lat.ndim == 3 else lat for lat in values]
        return self.model.process_latent_in(torch.stack(values))

    def _stacked_extras(self, batch: Sequence[Example], text_length: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The family's extras of the micro-batch, stacked (float ones in the compute dtype); a text-aligned
        extra (a text attention mask) is brought to the text length like the conds."""
        specs = self.adapter.extras(self.model.diffusion_model)
        out = {}
        for name, spec in specs.items():
            if name not in batch[0].extras:
                continue  # optional, or missing: preflight reports required extras missing from a cache
            values = [b.extras[name] for b in batch]
            if spec.is_latent:
                stacked = self.processed_latents(values)
            else:
                stacked = stack_text(values, text_length) if spec.follows_text else torch.stack(values)
            out[name] = stacked.to(dtype) if stacked.is_floating_point() else stacked
        return out

    def iterate(self, first_micro: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        micro = first_micro
        while True:
            yield self.build(micro)
            micro += 1
