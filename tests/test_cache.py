"""The cache with the real tiny VAE and CLIP: every change re-encodes exactly what it must, no more.

One base cache of the demo dataset is built once per module; each test works on its own copy of the
dataset folder and cache folder, so only the encodes a test causes are paid for.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from pipetrainer.training.cache.reader import CacheReadError
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import BucketSettings, scan_dataset
from pipetrainer.training.data.micro_batches import load_examples


@pytest.fixture(scope="module")
def base(encoders, fixture_paths, tmp_path_factory):
    """The demo dataset (4 images) and its cache at 64 px."""
    root = tmp_path_factory.mktemp("cache_base")
    data = root / "data"
    shutil.copytree(fixture_paths.dataset, data)
    vae, clip = encoders
    result = build_cache(scan_dataset(data, 64), vae, clip, root / "cache")
    assert result.report.encoded == {"latent": 4, "text": 4}
    return root


@pytest.fixture
def work(base, tmp_path):
    """A private copy of the base dataset and cache: ``(dataset folder, cache folder)``."""
    shutil.copytree(base / "data", tmp_path / "data")
    shutil.copytree(base / "cache", tmp_path / "cache")
    return tmp_path / "data", tmp_path / "cache"


def _cache(work, encoders, resolution=64, **kw):
    data, cache = work
    vae, clip = kw.pop("vae", None) or encoders[0], encoders[1]
    return build_cache(scan_dataset(data, resolution, **kw), vae, clip, cache)


def test_unchanged_cache_reuses_everything_and_loads_for_training(work, encoders):
    first = _cache(work, encoders)  # a copied folder: new paths, same bytes -> hashed, nothing encoded
    assert first.report.encoded == {} and first.report.reused == {"latent": 4, "text": 4}
    again = _cache(work, encoders)
    assert again.report.encoded == {} and again.report.rehashed == []
    assert [i.latent_key for i in again.items] == [i.latent_key for i in first.items]
    examples = load_examples(again.items)
    assert examples[0].latent.shape == (16, 8, 8) and examples[0].cond.shape == (77, 768)
    assert (again.latent_channels, again.text_dim, again.pooled_dim) == (16, 768, 768)


def test_changed_caption_reencodes_only_that_text(work, encoders):
    data, _ = work
    _cache(work, encoders)
    (data / "demo_01.txt").write_text("a completely different caption", encoding="utf-8")
    r = _cache(work, encoders).report
    assert r.encoded == {"text": 1} and r.reused == {"latent": 4, "text": 3}
    assert r.reencoded == ["demo_01.png text: caption changed"]


def test_swapped_vae_reencodes_every_latent(work, encoders, tmp_path):
    import comfy.sd
    import comfy.utils
    from pipetrainer.devkit.fixtures import build_tiny_taesd16

    _cache(work, encoders)
    other = build_tiny_taesd16(tmp_path / "other_vae.safetensors", seed=12345)
    vae2 = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(other)))
    r = _cache(work, encoders, vae=vae2).report
    assert r.encoded == {"latent": 4} and r.reused == {"text": 4}
    assert all(line.endswith("latent: VAE changed (weights or dtype)") for line in r.reencoded)


def test_changed_resolution_rebuckets_the_latents(work, encoders):
    before = _cache(work, encoders)
    after = _cache(work, encoders, resolution=96)
    assert after.report.encoded == {"latent": 4} and after.report.reused == {"text": 4}
    assert "preprocessing changed (height 64 -> 96, width 64 -> 96)" in after.report.reencoded[0]
    assert {i.bucket for i in before.items} == {"64x64x1"} and {i.bucket for i in after.items} == {"96x96x1"}
    assert load_examples(after.items[:1])[0].latent.shape == (16, 12, 12)


def test_touched_mtime_with_same_bytes_reencodes_nothing(work, encoders):
    data, _ = work
    _cache(work, encoders)
    st = (data / "demo_02.png").stat()
    os.utime(data / "demo_02.png", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    r = _cache(work, encoders).report
    assert r.rehashed == ["demo_02.png"] and r.encoded == {} and r.reencoded == []
    assert _cache(work, encoders).report.rehashed == []  # the new mtime is remembered


def test_corrupt_shard_is_detected_and_repaired(work, encoders):
    _cache(work, encoders)
    data, cache = work
    good = _cache(work, encoders).items
    shard = next((cache / "shards").iterdir())
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the middle of the shard
    shard.write_bytes(bytes(raw))
    with pytest.raises(CacheReadError, match="damaged"):
        load_examples(good)
    r = _cache(work, encoders).report
    assert sum(r.reencoded_kinds.values()) == 1 and "checksum mismatch" in r.reencoded[0]
    repaired = _cache(work, encoders)
    assert repaired.report.encoded == {}
    assert len(load_examples(repaired.items)) == 4


def test_torn_write_at_the_shard_end_is_ignored_and_cut(work, encoders):
    _, cache = work
    _cache(work, encoders)
    shard = next((cache / "shards").iterdir())
    size = shard.stat().st_size
    with open(shard, "ab") as f:  # what a process killed between write and index commit leaves behind
        f.write(b"\x00partial record" * 100)
    r = _cache(work, encoders).report
    assert r.encoded == {} and r.reencoded == []
    (work[0] / "demo_00.txt").write_text("a new caption", encoding="utf-8")
    result = _cache(work, encoders)
    assert result.report.encoded == {"text": 1}
    shards = sorted((cache / "shards").iterdir())
    assert len(shards) == 1 and shards[0].stat().st_size > size  # the tail was cut, then appended to
    assert len(load_examples(result.items)) == 4


def test_one_bad_file_is_skipped_with_its_reason(work, encoders):
    data, _ = work
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (data / "broken.txt").write_text("broken", encoding="utf-8")
    result = _cache(work, encoders)
    assert len(result.items) == 4
    assert len(result.report.skipped) == 1 and result.report.skipped[0].startswith("broken.png: cannot read it")


def test_aspect_buckets_and_multi_resolution(work, encoders):
    data, _ = work
    Image.new("RGB", (128, 64), (200, 10, 10)).save(data / "wide.png")
    (data / "wide.txt").write_text("a wide red picture", encoding="utf-8")
    settings = BucketSettings(resolutions=(64, 48), min_ratio=0.5, max_ratio=2.0, count=3, multiple=16)
    result = _cache(work, encoders, buckets=settings)
    by_source = {}
    for item in result.items:
        by_source.setdefault(Path(item.source).name, []).append(item.bucket)
    assert by_source["wide.png"] == ["96x48x1", "64x32x1"]  # the 2:1 bucket at each resolution
    assert by_source["demo_00.png"] == ["64x64x1", "48x48x1"]
    latents = {e.latent.shape for e in load_examples(result.items)}
    assert latents == {(16, 8, 8), (16, 6, 6), (16, 6, 12), (16, 4, 8)}


def _write_video(path: Path, frames: int, fps: int, size: tuple[int, int]) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            img = np.full((size[1], size[0], 3), (i * 9) % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def test_video_is_resampled_bucketed_and_keyed(work, encoders):
    data, _ = work
    _write_video(data / "clip.mp4", frames=24, fps=24, size=(96, 64))  # 1 s of video
    (data / "clip.txt").write_text("a short clip", encoding="utf-8")
    settings = BucketSettings(resolutions=(64,), min_ratio=0.5, max_ratio=2.0, count=3, max_frames=33, fps=7.0)
    result = _cache(work, encoders, buckets=settings)
    clip_item = next(i for i in result.items if i.source.endswith("clip.mp4"))
    assert clip_item.bucket == "96x48x5"  # 7 frames at 7 fps -> the 4k+1 bucket of 5 frames
    latent = load_examples([clip_item])[0].latent
    assert latent.shape == (16, 5, 6, 12)  # image VAE: frame by frame, channels first
    assert not torch.equal(latent[:, 0], latent[:, -1])  # frames are really sampled over time
    faster = _cache(work, encoders, buckets=BucketSettings(**{**settings.__dict__, "fps": 10.0}))
    assert any(line.startswith("clip.mp4 latent: preprocessing changed") for line in faster.report.reencoded)
    assert next(i for i in faster.items if i.source.endswith("clip.mp4")).bucket == "96x48x9"


def test_silent_corruption_found_by_training_is_repaired_by_the_next_cache_run(work, encoders):
    _, cache = work
    items = _cache(work, encoders).items
    shard = next((cache / "shards").iterdir())
    st = shard.stat()
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # same size, and the mtime is put back: revalidation cannot see it
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _cache(work, encoders).report.encoded == {}
    with pytest.raises(CacheReadError, match="run the 'Cache Latents & Text' node again"):
        load_examples(items)
    r = _cache(work, encoders).report  # training's read marked the shard for a re-check
    assert sum(r.reencoded_kinds.values()) == 1 and "checksum mismatch" in r.reencoded[0]
    assert len(load_examples(_cache(work, encoders).items)) == 4


def test_a_different_file_with_the_same_size_and_mtime_is_not_trusted(work, encoders):
    data, _ = work
    _cache(work, encoders)
    a = data / "demo_00.png"
    st = a.stat()
    other = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(other, format="PNG")
    assert len(other.getvalue()) <= st.st_size
    replacement = data / "incoming.bin"
    replacement.write_bytes(other.getvalue().ljust(st.st_size, b"\0"))  # decoders ignore bytes after IEND
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))  # what `cp -p` / `rsync -t` leave behind
    os.replace(replacement, a)
    assert (a.stat().st_size, a.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    r = _cache(work, encoders).report
    assert r.rehashed == ["demo_00.png"] and r.skipped == []
    assert r.reencoded == ["demo_00.png latent: source bytes changed"]


def test_changed_clip_skip_reencodes_every_caption_and_nothing_else(work, encoders):
    _, clip = encoders
    plain = _cache(work, encoders)
    skipped = clip.clone()
    skipped.clip_layer(-2)  # what CLIPSetLastLayer does
    r = build_cache(scan_dataset(work[0], 64), encoders[0], skipped, work[1])
    assert r.report.encoded == {"text": 4} and r.report.reused == {"latent": 4}
    assert len(r.report.reencoded) == 4
    assert all(line.endswith("text: text encoder changed (layer None -> -2)") for line in r.report.reencoded)
    old, new = load_examples(plain.items), load_examples(r.items)
    assert all(not torch.equal(a.cond, b.cond) for a, b in zip(old, new, strict=True))
    assert all(torch.equal(a.latent, b.latent) for a, b in zip(old, new, strict=True))
    back = _cache(work, encoders)  # the default layer's entries are still there
    assert back.report.encoded == {} and [i.text_key for i in back.items] == [i.text_key for i in plain.items]


def _clip_lora(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    key = "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(seed)
    return {f"{key}.lora_up.weight": torch.randn(768, rank, generator=g) * 0.1,
            f"{key}.lora_down.weight": torch.randn(rank, 768, generator=g) * 0.1,
            f"{key}.alpha": torch.tensor(float(rank))}


def test_text_encoder_identity_keys_tokenizer_options_and_lora_patches(encoders):
    import comfy.sd
    from pipetrainer.training.cache.encoders import text_encoder_identity, weights_fingerprint

    _, clip = encoders
    plain = text_encoder_identity(clip)
    assert text_encoder_identity(clip.clone()) == plain
    padded = clip.clone()
    padded.set_tokenizer_option("clip_l_min_padding", 4)
    assert text_encoder_identity(padded)["tokenizer"] != plain["tokenizer"]
    _, lora = comfy.sd.load_lora_for_models(None, clip, _clip_lora(1), 0, 1.0)
    _, weaker = comfy.sd.load_lora_for_models(None, clip, _clip_lora(1), 0, 0.5)
    _, other = comfy.sd.load_lora_for_models(None, clip, _clip_lora(2), 0, 1.0)
    ids = [text_encoder_identity(c) for c in (lora, weaker, other)]
    assert len({i["patches"] for i in ids} | {plain["patches"]}) == 4
    assert all(i["weights"] == plain["weights"] for i in ids)
    before = clip.encode_from_tokens(clip.tokenize("a cat"))
    lora.encode_from_tokens(lora.tokenize("a cat"))  # loads the LoRA'd clone: its patches now sit in the weights
    assert weights_fingerprint(clip.cond_stage_model) != plain["weights"].split(":")[0]
    assert text_encoder_identity(clip) == plain  # the identity reads the backed-up original weights
    assert torch.equal(clip.encode_from_tokens(clip.tokenize("a cat")), before)  # ComfyUI unpatches on reload


def test_lora_on_the_text_encoder_reencodes_the_captions(work, encoders):
    import comfy.sd

    _cache(work, encoders)
    _, lora = comfy.sd.load_lora_for_models(None, encoders[1], _clip_lora(3), 0, 1.0)
    r = build_cache(scan_dataset(work[0], 64), encoders[0], lora, work[1]).report
    assert r.encoded == {"text": 4} and r.reused == {"latent": 4}
    assert all(line.endswith("text: text encoder changed (patches changed)") for line in r.reencoded)
    assert _cache(work, encoders).report.encoded == {}  # the plain encoder's identity is unchanged


def test_a_text_encoder_the_key_cannot_describe_is_refused(work, encoders):
    from pipetrainer.training.cache.encoders import UnkeyableTextEncoder, text_encoder_problems

    patched = encoders[1].clone()
    patched.patcher.add_object_patch("clip_l.transformer.text_model.final_layer_norm", torch.nn.Identity())
    problems = text_encoder_problems(patched)
    assert len(problems) == 1 and "object patches" in problems[0] and "LoRA loader" in problems[0]
    with pytest.raises(UnkeyableTextEncoder, match="object patches"):
        build_cache(scan_dataset(work[0], 64), encoders[0], patched, work[1])


def test_a_compute_dtype_object_patch_is_keyed_not_refused(encoders):
    """Current ComfyUI puts ``manual_cast_dtype`` on every CLIP it loads: keyed, so a change re-encodes."""
    from pipetrainer.training.cache.encoders import text_encoder_identity, text_encoder_problems

    plain = encoders[1].clone()
    plain.patcher.object_patches.pop("manual_cast_dtype", None)
    fp32, bf16 = encoders[1].clone(), encoders[1].clone()
    fp32.patcher.add_object_patch("manual_cast_dtype", torch.float32)
    bf16.patcher.add_object_patch("manual_cast_dtype", torch.bfloat16)
    assert text_encoder_problems(fp32) == []
    identities = [text_encoder_identity(c) for c in (plain, fp32, bf16)]
    assert [i["compute"] for i in identities] == [None, "torch.float32", "torch.bfloat16"]
    assert len({json.dumps(i, sort_keys=True) for i in identities}) == 3
