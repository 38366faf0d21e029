"""Text embeddings are stored at the training dtype, and caches written in fp32 before still read.

Oracles: the safetensors file format itself (the record's header, parsed here by hand, names each
tensor's dtype and byte span), torch's own fp32 -> bf16 rounding of the fp32 embeddings, and the text
key formula of the caches written before the storage dtype was a choice (spelled out below).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import pytest
import torch
from pipetrainer.training.cache.encoders import ComfyEncoders
from pipetrainer.training.cache.index import CacheIndex
from pipetrainer.training.cache.keys import change_reason, encoder_signature, text_components, text_key
from pipetrainer.training.cache.reader import read_entries
from pipetrainer.training.cache.store import fill_cache
from pipetrainer.training.data.dataset import scan_dataset
from pipetrainer.training.data.micro_batches import load_examples

_BYTES = {"BF16": 2, "F32": 4}


def _record_header(cache_dir, key: str) -> dict:
    """The safetensors header of one cache record, read from the shard bytes (format: u64 little-endian
    header length, then the JSON header)."""
    index = CacheIndex(cache_dir)
    try:
        entry = index.entry(key)
    finally:
        index.close()
    with open(cache_dir / "shards" / entry.shard, "rb") as f:
        f.seek(entry.offset)
        data = f.read(entry.length)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    assert 8 + n + max(v["data_offsets"][1] for v in header.values()) == entry.length  # nothing else stored
    return header


class _Remembered(ComfyEncoders):
    """ComfyUI's encoders, each caption encoded once for every cache built here (CLIP-L is the slow part)."""

    def __init__(self, vae, clip, memo: dict):
        super().__init__(vae, clip)
        self.memo = memo

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        if caption not in self.memo:
            self.memo[caption] = super().encode_text(caption)
        return {k: v.clone() for k, v in self.memo[caption].items()}


class _RoundedText(_Remembered):
    """The same encoders, the fp32 embeddings rounded through bf16 and stored as fp32 (an old-format cache
    holding bf16-rounded values): the oracle a bf16-stored cache must train like."""

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16).to(torch.float32) for k, v in super().encode_text(caption).items()}


@pytest.fixture(scope="module")
def caches(encoders, fixture_paths, tmp_path_factory):
    """The demo dataset cached three ways: fp32 (the old format), bf16, and fp32 holding bf16-rounded values."""
    root = tmp_path_factory.mktemp("cache_dtype")
    data = root / "data"
    shutil.copytree(fixture_paths.dataset, data)
    vae, clip = encoders
    dataset = scan_dataset(data, 64)
    memo: dict = {}
    return {
        "fp32": (root / "fp32", fill_cache(dataset, _Remembered(vae, clip, memo), root / "fp32")),
        "bf16": (root / "bf16", fill_cache(dataset, _Remembered(vae, clip, memo), root / "bf16", text_dtype="bf16")),
        "rounded": (root / "rounded", fill_cache(dataset, _RoundedText(vae, clip, memo), root / "rounded")),
    }


def test_bf16_cache_stores_embeddings_as_bf16_bytes_equal_to_rounded_fp32(caches):
    (fp32_dir, fp32), (bf16_dir, bf16) = caches["fp32"], caches["bf16"]
    assert [i.latent_key for i in fp32.items] == [i.latent_key for i in bf16.items]  # latents are shared
    for old, new in zip(fp32.items, bf16.items, strict=True):
        assert old.text_key != new.text_key  # the storage dtype is in the key
        h32, h16 = _record_header(fp32_dir, old.text_key), _record_header(bf16_dir, new.text_key)
        assert set(h16) == set(h32) == {"cond", "pooled"}
        for name in h16:
            assert (h32[name]["dtype"], h16[name]["dtype"]) == ("F32", "BF16")
            numel = torch.Size(h16[name]["shape"]).numel()
            start, end = h16[name]["data_offsets"]
            assert end - start == numel * 2 and h16[name]["shape"] == h32[name]["shape"]
    keys = [i.text_key for i in fp32.items[:2]]
    read32 = read_entries(fp32.items[0].text_file, keys)
    read16 = read_entries(bf16.items[0].text_file, [i.text_key for i in bf16.items[:2]])
    for k32, k16 in zip(keys, [i.text_key for i in bf16.items[:2]], strict=True):
        for name in ("cond", "pooled"):
            assert read16[k16][name].dtype == torch.bfloat16
            assert torch.equal(read16[k16][name], read32[k32][name].to(torch.bfloat16))
            assert not torch.equal(read16[k16][name].float(), read32[k32][name])  # the rounding is real


def test_fp32_caches_keep_their_keys_and_load_at_the_training_dtype(caches, encoders):
    """The text key of an fp32 store is the one caches had before the choice (the old formula, written
    out), so an existing cache is found; its fp32 entries load at any training dtype."""
    fp32_dir, fp32 = caches["fp32"]
    sig = encoder_signature(ComfyEncoders(*encoders).text_identity())
    item = fp32.items[0]
    old_formula = hashlib.blake2b("\x1f".join(("text", "4", sig, item.caption)).encode(), digest_size=20).hexdigest()
    assert item.text_key == old_formula == text_key(item.caption, sig)
    assert text_key(item.caption, sig, "bf16") != old_formula
    assert change_reason(text_components("a", "clip"), text_components("a", "clip", "bf16")) == \
        "stored text dtype changed"

    (bf16_example,) = load_examples(caches["bf16"][1].items[:1], text_dtype=torch.bfloat16)
    (old_example,) = load_examples(fp32.items[:1], text_dtype=torch.bfloat16)
    (old_fp32,) = load_examples(fp32.items[:1], text_dtype=torch.float32)
    assert old_example.cond.dtype == old_example.pooled.dtype == torch.bfloat16
    assert torch.equal(old_example.cond, bf16_example.cond) and torch.equal(old_example.pooled, bf16_example.pooled)
    assert old_fp32.cond.dtype == torch.float32 and torch.equal(old_fp32.cond.to(torch.bfloat16), bf16_example.cond)
    with pytest.raises(ValueError, match="bf16, fp32"):
        text_key("a", sig, "fp16")


@pytest.mark.slow
def test_a_bf16_cache_trains_like_fp32_conds_rounded_to_bf16(caches, fixture_paths, comfy_root, tmp_path):
    """Two real runs in fp32: from the bf16-stored cache, and from an fp32 cache holding the same
    embeddings rounded to bf16 by torch. Same losses, bit for bit."""
    from pipetrainer.tests.helpers import losses, make_spec, run_training

    runs = {}
    for name in ("bf16", "rounded"):
        spec = make_spec(fixture_paths.mmdit, caches[name][1].items, tmp_path / name, comfy_root, steps=2)
        code, events = run_training(spec)
        assert code == 0, [e for e in events if e["type"] == "error"]
        runs[name] = losses(events)
    assert len(runs["bf16"]) == 2 and runs["bf16"] == runs["rounded"], runs
