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
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load_file

from ..cache.masks import FLIP_PROBABILITY, FLIPPED_LATENT, LOSS_MASK, flip_example_mask
from ..cache.reader import read_entries
from ..objective.loss import noisy_input_and_target
from ..objective.loss_weighting import item_scales, scale_labels
from ..objective.timesteps import sample_sigmas
from ..pipelines.base import Batch
from ..spec.options import CacheItem, TimestepSpec
from .joint_latent import join_latent, joined_names, joint_weight


@dataclass(frozen=True)
class TextChoice:
    """One cached text entry an item can train on (a tag-shuffle variant, or the empty caption)."""

    cond: torch.Tensor
    pooled: torch.Tensor | None
    extras: Mapping[str, torch.Tensor]  # the text entry's extras (e.g. its attention mask)


@dataclass(frozen=True)
class Example:
    latent: torch.Tensor  # raw VAE latent [C, H, W] or [C, F, H, W]
    cond: torch.Tensor | None  # [T, D]; None on a rank that builds no model inputs (the last stage)
    pooled: torch.Tensor | None  # [D]
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)  # the family's named extras (ExtraSpec)
    latent_extra_shapes: tuple = ()  # (name, shape) of the latent entry's extras (reference latents), sorted
    # Caption options (training/data/captions.py), first stage only: the tag-shuffle variants drawn among per
    # micro-batch (cond/pooled above are the first), and the empty caption drawn with caption_dropout.
    text_variants: tuple[TextChoice, ...] = ()
    empty_text: TextChoice | None = None
    caption_dropout: float = 0.0
    # Cached variants (cache/masks.py), read on every stage from the latent entry: the VAE encode of the
    # mirrored item (flip) and the loss mask on the latent grid [1, h, w] (white = train).
    flipped: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def shape_key(self) -> tuple:
        """Examples with equal keys stack into one micro-batch (same bucket): the latent shape and the
        shapes of the latent entry's extras (an edit item's references: their count and sizes) decide,
        so every rank groups alike whether or not it read the text (the text width and pooled shape are
        the same for every item of one cache, and the token count is padded or cut to the family's
        length by :func:`stack_text`)."""
        return tuple(self.latent.shape) + self.latent_extra_shapes


_LATENT_KEYS = ("latent", FLIPPED_LATENT, LOSS_MASK)  # not family extras: they never join the shape key
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
            if text:  # caption options: the other tag-shuffle variants and the empty caption
                keyed[item.latent_file].update(item.text_variants + ((item.empty_text_key,) if item.empty_text_key
                                                                     else ()))
    tensors = {k: v for index_file, keys in keyed.items() for k, v in read_entries(index_file, keys).items()}
    choices: dict[str, TextChoice] = {}

    def choice(key: str) -> TextChoice:  # one TextChoice per text entry, shared by the items using it
        if key not in choices:
            choices[key] = _text_choice(tensors[key], text_dtype)
        return choices[key]

    loaded: dict[tuple, Example] = {}
    out = []
    for item in items:
        key = (item.latent_file, item.text_file, item.latent_key, item.text_key, item.text_variants,
               item.empty_text_key, item.caption_dropout)
        if key not in loaded:
            lat = tensors[item.latent_key] if item.latent_key else load_file(item.latent_file)
            cond = pooled = None
            extras = {k: v for k, v in lat.items() if k not in _LATENT_KEYS}
            latent_extra_shapes = tuple((k, tuple(v.shape)) for k, v in sorted(extras.items()))
            variants, empty, dropout = (), None, 0.0
            if text:
                first = choice(item.text_key) if item.text_key else _text_choice(load_file(item.text_file), text_dtype)
                cond, pooled = first.cond, first.pooled
                extras.update(first.extras)
                variants = tuple(choice(k) for k in item.text_variants)
                empty = choice(item.empty_text_key) if item.empty_text_key else None
                dropout = item.caption_dropout
            loaded[key] = Example(lat["latent"], cond, pooled, extras, latent_extra_shapes, variants, empty, dropout,
                                  flipped=lat.get(FLIPPED_LATENT), mask=lat.get(LOSS_MASK))
        out.append(loaded[key])
    return out


def _text_choice(txt: Mapping[str, torch.Tensor], text_dtype: torch.dtype | None) -> TextChoice:
    """A cached text entry's tensors, embeddings in ``text_dtype`` (a no-op for caches stored at it)."""
    cond, pooled = txt["cond"], txt.get("pooled")
    if text_dtype is not None:
        cond = cond.to(text_dtype)
        pooled = pooled.to(text_dtype) if pooled is not None else None
    return TextChoice(cond, pooled, {k: v for k, v in txt.items() if k not in _TEXT_KEYS})


def with_text(example: Example, text: TextChoice) -> Example:
    """``example`` trained on ``text``: its cond, pooled and text extras swapped, its latent extras kept."""
    latent_names = {name for name, _ in example.latent_extra_shapes}
    extras = {k: v for k, v in example.extras.items() if k in latent_names}
    extras.update(text.extras)
    return replace(example, cond=text.cond, pooled=text.pooled, extras=extras)


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


def stack_padded(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, ...]`` of tensors of one rank whose sizes differ on some axes: each axis brought to the largest
    size, zeros after an item's own values (ragged token sequences, wherever their token axis is)."""
    sizes = [max(v.shape[axis] for v in values) for axis in range(values[0].ndim)]
    out = values[0].new_zeros(len(values), *sizes)
    for i, value in enumerate(values):
        out[(i, *(slice(0, n) for n in value.shape))] = value
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
        ``(target, loss weight)`` when the family or the items' loss masks weigh the loss."""
        batch = self.flipped(self.captioned([self.examples[i] for i in self._indices(micro)], micro), micro)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + micro * self.replicas + self.replica) % (2**63))
        x0, shapes = self.joined(batch, [b.latent for b in batch])
        noise = torch.randn(x0.shape, generator=g)
        sigma = self.sigmas(len(batch), g, tuple((shapes[0] if shapes else x0.shape)[1:]))
        inputs, labels = self.assemble(batch, x0, noise, sigma, shapes)
        # Loss weighting by sigma (training only: validation losses stay unweighted, comparable across runs).
        scale = item_scales(self.timesteps.loss_weighting, sigma, self.model.model_sampling)
        return inputs, (labels if scale is None else scale_labels(labels, scale))

    def captioned(self, batch: list[Example], micro: int) -> list[Example]:
        """Each item's text in micro-batch ``micro``: the empty caption with probability caption_dropout,
        else one of its tag-shuffle variants (training/data/captions.py).

        Drawn from a generator of its own, seeded by the run seed and the global micro-batch index,
        two draws per position in the batch: the noise stream is the same with the options on or off,
        and every stage, replica layout or resumed run that builds micro-batch ``micro`` draws alike.
        Only the first stage reads text; the last (no cond) needs no choice.
        """
        if not batch or batch[0].cond is None or not any(b.text_variants or b.caption_dropout for b in batch):
            return batch
        rng = random.Random(f"captions:{self.seed}:{micro * self.replicas + self.replica}")
        out = []
        for b in batch:
            drop, pick = rng.random(), rng.random()
            if b.empty_text is not None and drop < b.caption_dropout:
                out.append(with_text(b, b.empty_text))
            elif b.text_variants:
                out.append(with_text(b, b.text_variants[int(pick * len(b.text_variants))]))
            else:
                out.append(b)
        return out

    def flipped(self, batch: list[Example], micro: int) -> list[Example]:
        """Each item with a cached flip trains mirrored with probability 1/2 in micro-batch ``micro``:
        its flipped latent, and the mirror of its mask grid.

        One draw per position in the batch from a generator of its own, seeded by the run seed and the
        global micro-batch index: the noise stream is unchanged, and the first and the last pipeline
        stage (which reads no text, but the same latent entries) decide every flip alike.
        """
        if not any(b.flipped is not None for b in batch):
            return batch
        rng = random.Random(f"flip:{self.seed}:{micro * self.replicas + self.replica}")
        out = []
        for b in batch:
            if rng.random() < FLIP_PROBABILITY and b.flipped is not None:
                b = replace(b, latent=b.flipped, flipped=b.latent, mask=flip_example_mask(b.mask))
            out.append(b)
        return out

    def loss_weight(self, batch: Sequence[Example], x0: torch.Tensor,
                    family_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The loss weight of ``batch``: the family's mask (``[...]`` of one item) times each item's own
        loss mask (``[1, h, w]`` on the latent grid, broadcast over channels and frames, or ``[F, h, w]``
        per latent frame of a clip, e.g. a VACE reference frame left out; items without one weigh 1); None
        when neither exists (plain MSE, as before masks)."""
        family = None if family_mask is None else family_mask[None]
        if all(b.mask is None for b in batch):
            return family
        h, w = (int(v) for v in x0.shape[-2:])
        frames = int(x0.shape[2]) if x0.ndim == 5 else 1
        ones = torch.ones(1, h, w)
        items = torch.stack([(ones if b.mask is None else b.mask.float()).reshape(-1, h, w).expand(frames, h, w)
                             for b in batch])
        items = items.reshape(len(batch), 1, *([1] * (x0.ndim - 5)), *([frames] if x0.ndim == 5 else []), h, w)
        return items if family is None else family.float() * items

    def sigmas(self, n: int, generator: torch.Generator, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """``n`` sigmas of the run's timestep sampling for latents of ``latent_shape`` (``[C, ...]``)."""
        tokens = self.adapter.image_tokens(self.model.diffusion_model, latent_shape)
        return sample_sigmas(n, self.timesteps, generator, self.model.model_sampling, tokens)

    def assemble(self, batch: Sequence[Example], x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                 latent_shapes: tuple = ()) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """``(first-stage inputs, target)`` of ``batch`` (its processed latents ``x0``) noised with
        ``noise`` at ``sigma``: the one place micro-batches become model inputs, for training and
        validation alike. ``latent_shapes``: the streams packed in ``x0`` (:meth:`joined`), if any."""
        noisy, timestep, target = noisy_input_and_target(self.model.model_sampling, x0, noise, sigma)
        first = torch.empty(latent_shapes[0], device="meta") if latent_shapes else x0  # the first stream's shape
        mask = self.loss_weight(batch, first, self.adapter.loss_mask(tuple(first.shape[1:]), self.family_options))
        mask = joint_weight(mask, latent_shapes) if latent_shapes else mask
        labels = target.to(self.device) if mask is None else (target.to(self.device), mask.to(self.device))
        dtype = self.compute_dtype()
        if batch[0].cond is None:  # a last stage: DeepSpeed reads only the target there
            return (), labels
        length = self.adapter.text_length([len(b.cond) for b in batch])
        cond = stack_text([b.cond for b in batch], length).to(dtype)
        pooled = torch.stack([b.pooled for b in batch]).to(dtype) if batch[0].pooled is not None else None
        inputs = self.adapter.first_stage_inputs(Batch(
            noisy=noisy.to(dtype), timestep=timestep, cond=cond, pooled=pooled,
            extras=self._stacked_extras(batch, length, dtype), options=self.family_options, clean=x0.to(dtype),
            latent_shapes=tuple(latent_shapes), text_lengths=tuple(min(len(b.cond), length) for b in batch),
        ))
        return tuple(t.to(self.device) for t in inputs), labels

    def joined(self, batch: Sequence[Example], latents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple]:
        """``(x0, ())`` of the raw cached ``latents`` (:meth:`processed_latents`), or for a family whose model takes
        several latents as one (``ExtraSpec.joins_latent``) those latents packed with the further streams and
        processed as ComfyUI's sampler processes the pack, and the streams' shapes (training/data/joint_latent.py
        says why the objective then needs nothing else)."""
        names = joined_names(self.adapter.extras(self.model.diffusion_model))
        if not names:
            return self.processed_latents(latents), ()
        missing = [n for n in names if any(n not in b.extras for b in batch)]
        streams = [torch.stack([b.extras[n].float() for b in batch]) for n in names] if not missing else []
        return join_latent(self.model, self.stacked_latents(latents), streams, missing)

    def stacked_latents(self, latents: Sequence[torch.Tensor]) -> torch.Tensor:
        """Raw cached VAE latents of one shape, stacked in float32; on a video model an image latent ``[C, H, W]``
        trains as a 1-frame video."""
        values = [lat.float() for lat in latents]
        if self.adapter.geometry(self.model.diffusion_model).video:
            values = [lat.unsqueeze(1) if lat.ndim == 3 else lat for lat in values]
        return torch.stack(values)

    def processed_latents(self, latents: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`stacked_latents` as the model takes them (``process_latent_in``)."""
        return self.model.process_latent_in(self.stacked_latents(latents))

    def _stacked_extras(self, batch: Sequence[Example], text_length: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The family's extras of the micro-batch, stacked (float ones in the compute dtype, or float32 where the spec
        says ComfyUI keeps them so); a text-aligned
        extra (a text attention mask) is brought to the text length like the conds."""
        specs = self.adapter.extras(self.model.diffusion_model)
        out = {}
        for name, spec in specs.items():
            if spec.joins_latent:
                continue  # packed into the latent itself (joined)
            given = [b.extras[name] for b in batch if name in b.extras]
            if given and len(given) < len(batch) and spec.shape[:1] == ("*",) and not spec.required:
                # a token sequence some captions have and others not (HunyuanImage's ByT5 states of quoted
                # text): the others get none, padded with zeros below like any shorter sequence
                empty = given[0].new_zeros((0, *given[0].shape[1:]))
                values = [b.extras.get(name, empty) for b in batch]
            elif name not in batch[0].extras:
                continue  # optional, or missing: preflight reports required extras missing from a cache
            else:
                values = [b.extras[name] for b in batch]
            if spec.is_latent:
                stacked = self.processed_latents(values)
            else:
                if spec.follows_text:
                    stacked = stack_text(values, text_length)
                elif "*" in spec.shape and len({v.shape for v in values}) > 1:  # ragged token sequences (T5
                    stacked = stack_padded(values)  # ids, ByT5, HiDream's Llama layers): zeros after, any axis
                else:
                    stacked = torch.stack(values)
            if stacked.is_floating_point():
                stacked = stacked.to(torch.float32 if spec.keeps_float32 else dtype)
            out[name] = stacked
        return out

    def iterate(self, first_micro: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        micro = first_micro
        while True:
            yield self.build(micro)
            micro += 1
