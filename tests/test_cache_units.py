"""Cache parts on their own: keys and reasons, latent layout, shard writers, the index's claims."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from pipetrainer.training.cache.encoders import latent_layout
from pipetrainer.training.cache.index import CacheIndex
from pipetrainer.training.cache.keys import (
    LATENT_FORMAT_VERSION,
    change_reason,
    encoder_signature,
    latent_components,
    latent_key,
    prep_signature,
    text_components,
    text_key,
)
from pipetrainer.training.cache.shards import ShardWriter, checksum, pack, read_span, unpack


def test_every_key_input_changes_the_key_and_names_the_reason():
    prep = {"width": 64, "height": 64, "frames": 1}
    base = latent_key("src", prep_signature(prep), "vae:fp32")
    assert latent_key("src2", prep_signature(prep), "vae:fp32") != base
    assert latent_key("src", prep_signature({**prep, "width": 80}), "vae:fp32") != base
    assert latent_key("src", prep_signature(prep), "vae:bf16") != base
    assert latent_key("src", prep_signature(dict(reversed(prep.items()))), "vae:fp32") == base
    assert text_key("a cat", "clip") != text_key("a dog", "clip") != text_key("a dog", "clip2")
    old, new = latent_components("s", prep, "v1"), latent_components("s", {**prep, "width": 80}, "v2")
    assert change_reason(old, new) == "preprocessing changed (width 64 -> 80); VAE changed (weights or dtype)"
    assert change_reason(text_components("a", "c"), text_components("b", "c")) == "caption changed"


def test_every_part_of_the_text_encoder_identity_changes_the_key_and_is_named():
    identity = {"weights": "f" * 40 + ":torch.float16", "layer": None,
                "tokenizer": {"class": "comfy.sd1_clip.SD1Tokenizer", "options": {}}, "patches": None}
    base = text_key("a cat", encoder_signature(identity))
    assert text_key("a cat", encoder_signature(dict(reversed(identity.items())))) == base
    changes = {"layer": -2, "patches": "0" * 40, "weights": "e" * 40 + ":torch.float16",
               "tokenizer": {"class": "comfy.sd1_clip.SD1Tokenizer", "options": {"clip_l_min_padding": 4}}}
    for part, value in changes.items():
        other = {**identity, part: value}
        assert text_key("a cat", encoder_signature(other)) != base
        assert change_reason(text_components("a cat", identity), text_components("a cat", other)) == (
            "text encoder changed (layer None -> -2)" if part == "layer" else f"text encoder changed ({part} changed)")


def test_an_older_text_format_is_named_as_such_and_latents_keep_their_format():
    old = {**text_components("a", "clip:fp16"), "v": 3}
    assert change_reason(old, text_components("a", {"weights": "clip:fp16", "layer": -2})) == \
        "cache format version changed"
    assert latent_components("s", {}, "v")["v"] == LATENT_FORMAT_VERSION == 3  # text v4 left latents alone


def test_latent_layout_for_image_and_video_vaes():
    assert latent_layout(torch.zeros(1, 16, 8, 8), 1).shape == (16, 8, 8)
    assert latent_layout(torch.zeros(5, 16, 8, 8), 5).shape == (16, 5, 8, 8)  # image VAE, frame by frame
    assert latent_layout(torch.zeros(1, 16, 2, 8, 8), 5).shape == (16, 2, 8, 8)  # video VAE


def test_records_round_trip_and_a_flipped_byte_is_caught(tmp_path):
    index = CacheIndex(tmp_path)
    writer = ShardWriter(tmp_path / "shards", index.shard_end)
    data = pack({"latent": torch.arange(12.0).reshape(3, 4)})
    shard, offset = writer.append(data)
    writer.close()
    path = tmp_path / "shards" / shard
    assert torch.equal(unpack(read_span(path, offset, len(data), checksum(data)))["latent"],
                       torch.arange(12.0).reshape(3, 4))
    raw = bytearray(path.read_bytes())
    raw[offset + len(data) - 1] ^= 1
    path.write_bytes(bytes(raw))
    try:
        read_span(path, offset, len(data), checksum(data))
    except ValueError as exc:
        assert "checksum mismatch" in str(exc)
    else:
        raise AssertionError("a flipped byte was not detected")
    index.close()


_HOLD_SHARD = """
import fcntl, sys, time
f = open(sys.argv[1], "ab"); fcntl.flock(f.fileno(), fcntl.LOCK_EX); print("locked", flush=True); time.sleep(60)
"""


def test_a_shard_locked_by_another_process_is_never_appended_to(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    held = shards / "shard-held.bin"
    held.write_bytes(b"")
    other = subprocess.Popen([sys.executable, "-c", _HOLD_SHARD, str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        index = CacheIndex(tmp_path)
        writer = ShardWriter(shards, index.shard_end)
        name, _ = writer.append(b"abc")
        writer.close()
        index.close()
        assert name != held.name and held.stat().st_size == 0
    finally:
        other.kill()
        other.wait()


def test_claims_block_live_holders_and_expire_with_dead_ones(tmp_path):
    mine = CacheIndex(tmp_path)
    assert mine.claim("k1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine.db.execute("INSERT OR REPLACE INTO claims VALUES (?,?,?,?)", ("k2", mine.host, dead.pid, 0.0))
    mine.db.execute("INSERT OR REPLACE INTO claims VALUES (?,?,?,?)", ("k3", mine.host, os.getppid(), 0.0))
    assert mine.claim("k2")  # its holder is gone
    assert not mine.claim("k3")  # its holder (a live process) still encodes it
    mine.close()


def test_an_old_index_gains_the_new_source_columns(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "index.sqlite")
    old.execute("CREATE TABLE sources (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, digest TEXT, probe TEXT)")
    old.execute("INSERT INTO sources VALUES ('/a.png', 1, 2, 'd', '[1, 1, 0.0]')")
    old.commit()
    old.close()
    index = CacheIndex(tmp_path)
    source = index.sources()["/a.png"]
    assert (source.ctime_ns, source.inode) == (None, None)
    assert not source.unchanged(os.stat(tmp_path / "index.sqlite"))  # hashed again, never trusted
    index.close()


def test_the_report_on_the_node_keeps_the_counts_and_a_few_files_of_each_kind():
    """The node's own text is short enough not to be cut by the node; the ``report`` output keeps every file."""
    from collections import Counter

    from pipetrainer.training.cache.report import CacheReport

    report = CacheReport(cached=Counter(latent=2, text=2), skipped=[f"f{i}.png: cannot read it" for i in range(10)],
                         reencoded=["a.png latent: VAE changed"], notes=["a note"], buckets=Counter({"64x64x1": 2}))
    lines = report.summary().splitlines()
    assert lines[0] == report.text().splitlines()[0] and "buckets: 64x64x1 (2)" in lines and "a note" in lines
    assert [line for line in lines if line.startswith("skipped f")] == [f"skipped f{i}.png: cannot read it"
                                                                        for i in range(3)]
    assert "skipped 7 more: the node's report output lists every file" in lines
    assert "re-encoded a.png latent: VAE changed" in lines and not any("1 more" in line for line in lines)
    assert all(f"f{i}.png" in report.text() for i in range(10))
