"""Micro-batches group by latent shape only: captions of any token count share a batch, padded to the
family's text length, and a bucket of at least ``batch_size`` items never repeats an item in a batch.

In-process with the real ``MicroBatches`` and the tiny SD3-family model (its ``model_sampling`` and
latent format build the inputs exactly as the training ranks do).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from pipetrainer.training.data.micro_batches import Example, MicroBatches, stack_text
from pipetrainer.training.pipelines.base import adapter_for
from pipetrainer.training.spec.options import TimestepSpec

WIDTH = 768  # the tiny MMDiT's context and pooled width (CLIP-L)


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model


def _example(i: int, tokens: int, latent_hw: tuple[int, int] = (8, 8)) -> Example:
    g = torch.Generator().manual_seed(i)
    return Example(torch.randn(16, *latent_hw, generator=g), torch.randn(tokens, WIDTH, generator=g),
                   torch.randn(WIDTH, generator=g))


def _batches(examples, batch_size: int, model=None, seed: int = 5) -> MicroBatches:
    adapter = adapter_for("SD3")
    return MicroBatches(examples, batch_size, seed, model, adapter, TimestepSpec(), torch.device("cpu"),
                        family_options=adapter.options_type())


def test_four_caption_lengths_at_batch_four_make_one_micro_batch_of_four_distinct_items(tiny_model):
    lengths = [77, 154, 231, 100]  # one and several CLIP chunks, and a length no chunking gives
    examples = [_example(i, n) for i, n in enumerate(lengths)]
    batches = _batches(examples, 4, tiny_model)
    assert batches._batches_per_epoch == 1
    assert sorted(batches._indices(0)) == [0, 1, 2, 3]
    inputs, target = batches.build(0)
    noisy, timestep, cond, pooled = inputs
    assert noisy.shape == target.shape == (4, 16, 8, 8) and timestep.shape == (4,)
    assert cond.shape == (4, max(lengths), WIDTH) and pooled.shape == (4, WIDTH)
    matched = []
    for row in cond:
        hits = [i for i, e in enumerate(examples)
                if torch.equal(row[:len(e.cond)], e.cond) and not row[len(e.cond):].any()]
        assert len(hits) == 1  # the item's own tokens, then zero tokens only
        matched.append(hits[0])
    assert sorted(matched) == [0, 1, 2, 3]
    assert sorted(matched) == sorted(batches._indices(0))


def test_latent_shapes_still_split_buckets():
    examples = [_example(i, 77 * (1 + i % 2), (8, 8) if i < 5 else (6, 12)) for i in range(8)]
    batches = _batches(examples, 2)
    for m in range(40):
        idx = batches._indices(m)
        assert len({examples[i].latent.shape for i in idx}) == 1


@pytest.mark.parametrize(("items", "batch_size"), [(5, 2), (6, 4), (7, 3), (4, 4), (13, 4), (9, 8), (5, 4), (6, 5), (10, 8)])
def test_a_bucket_of_at_least_batch_size_items_never_repeats_an_item_in_a_micro_batch(items, batch_size):
    examples = [_example(i, 77 + i) for i in range(items)]
    batches = _batches(examples, batch_size)
    per_epoch = -(-items // batch_size)
    drawn = [batches._indices(m) for m in range(per_epoch * 50)]
    assert all(len(set(idx)) == batch_size for idx in drawn)
    counts = Counter(i for idx in drawn for i in idx)
    assert max(counts.values()) - min(counts.values()) <= 1  # a stream of shuffles: every item equally often
    first = [i for idx in drawn[:per_epoch] for i in idx]
    assert set(first) == set(range(items))  # the first epoch sees every item
    # the same draws from a fresh object (what a resumed run or another stage computes), in any order
    again = _batches(examples, batch_size)
    order = list(range(len(drawn)))[::-7] + list(range(len(drawn)))[::-1]
    assert [again._indices(m) for m in order] == [drawn[m] for m in order]


def test_a_bucket_smaller_than_the_batch_repeats_its_items_to_fill_the_batch():
    examples = [_example(i, 77) for i in range(3)]
    idx = _batches(examples, 4)._indices(0)
    assert len(idx) == 4 and set(idx) == {0, 1, 2}


def test_stack_text_pads_with_zero_tokens_and_cuts_to_the_length():
    a, b = torch.ones(3, 2), torch.full((5, 2), 2.0)
    padded = stack_text([a, b], 5)
    assert torch.equal(padded[0, :3], a) and not padded[0, 3:].any() and torch.equal(padded[1], b)
    cut = stack_text([a, b], 4)
    assert cut.shape == (2, 4, 2) and torch.equal(cut[1], b[:4])


def test_hidream_llama_stacks_of_two_lengths_share_a_micro_batch(comfy_root):
    """Captions of more than 128 Llama tokens give Llama stacks ``[E, L, D]`` of their own ``L``: two of them
    share a micro-batch, each brought to the longest with zero tokens after its own (the token axis is the
    second), and HiDream's embed stage takes the batch."""
    from pipetrainer.tests.family_rows.hidream import LLAMA, LLAMA_LAYERS, LLAMA_WIDTH, POOLED, TEXT, hidream_small

    model = hidream_small().model  # skips on a ComfyUI without comfy.model_base.HiDream, naming it
    adapter = adapter_for("HiDream")
    g = torch.Generator().manual_seed(3)
    lengths = [6, 9]
    examples = [Example(torch.randn(16, 8, 6, generator=g), torch.randn(5, TEXT, generator=g),
                        torch.randn(POOLED, generator=g),
                        extras={LLAMA: torch.randn(LLAMA_LAYERS, n, LLAMA_WIDTH, generator=g)}) for n in lengths]
    batches = MicroBatches(examples, 2, 5, model, adapter, TimestepSpec(), torch.device("cpu"),
                           family_options=adapter.options_type())
    inputs, _ = batches.build(0)
    llama = inputs[-1]
    assert llama.shape == (2, LLAMA_LAYERS, max(lengths), LLAMA_WIDTH)
    for row in llama:
        own = [e.extras[LLAMA] for e in examples if torch.equal(row[:, :e.extras[LLAMA].shape[1]], e.extras[LLAMA])]
        assert len(own) == 1 and not row[:, own[0].shape[1]:].any()
    layers = adapter.stage_layers(model.diffusion_model)
    with torch.no_grad():
        out = layers[0](inputs)
    assert out[0].shape[0] == 2 and all(torch.isfinite(t).all() for t in out if t.is_floating_point())
