"""Image-to-video start-image conditioning from the Cache node (``start_image = first_frame``).

The oracle is ComfyUI's own inference graph for Wan image-to-video: ``CLIP Vision Encode`` (crop none,
as ComfyUI's Wan I2V template sets it) and ``WanImageToVideo`` given the item's first frame with the
real (narrow) Wan 2.1 VAE, then ``WAN21.extra_conds`` of a detected Wan 2.1 I2V model; the cached
``concat_latent`` and ``clip_fea`` must give the family adapter the same conditioning tensors. The CLIP
vision model is ComfyUI's own ``comfy.clip_vision.ClipVisionModel`` built from a small config written
here (ViT-H's stock config is 630 M parameters). Keys: the option and the CLIP-vision model's identity
re-encode the latents with a reason; nothing changed reuses everything; ``none`` keeps the old keys.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from pipetrainer.training.cache.buckets import Bucket
from pipetrainer.training.cache.start_image import StartImage
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import BucketSettings, scan_dataset

SETTINGS = BucketSettings(resolutions=(32,), min_ratio=0.5, max_ratio=2.0, count=3, max_frames=33, fps=7.0)
VIDEO_BUCKET = Bucket(48, 16, 5)  # 24 frames at 24 fps sampled at 7 fps: 7 frames -> the 4k+1 bucket of 5
IMAGE_BUCKET = Bucket(48, 16)
CLIP_VISION_CONFIG = {  # ComfyUI's clip_vision_config_h.json layout, shrunk: 3 layers so -2 is not the last
    "attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "gelu", "hidden_size": 64, "image_size": 224,
    "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 128, "layer_norm_eps": 1e-05,
    "model_type": "clip_vision_model", "num_attention_heads": 2, "num_channels": 3, "num_hidden_layers": 3,
    "patch_size": 14, "projection_dim": 32, "torch_dtype": "float32",
}


def tiny_clip_vision(folder: Path, seed: int):
    """ComfyUI's ``ClipVisionModel`` (what 'Load CLIP Vision' returns) with seeded weights: 0.13 M parameters."""
    import comfy.clip_vision
    from pipetrainer.devkit.fixtures import _randomize_scaled

    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "clip_vision_tiny.json"
    config.write_text(json.dumps(CLIP_VISION_CONFIG), encoding="utf-8")
    model = comfy.clip_vision.ClipVisionModel(str(config))
    state = _randomize_scaled({k: v.float() for k, v in model.get_sd().items()}, seed)
    missing, unexpected = model.load_sd(state)
    assert not missing and not unexpected
    return model


def _write_video(path: Path, frames: int, fps: int, size: tuple[int, int]) -> None:
    import av
    import numpy as np

    w, h = size
    ramp = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            img = ((ramp + 23 * i) % 256).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


@pytest.fixture(scope="module")
def i2v(encoders, tmp_path_factory):
    """One clip and one image cached with start_image none, then first_frame with CLIP vision A (in one cache
    folder): ``dict`` with the results, the folders and the models."""
    from PIL import Image
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae

    root = tmp_path_factory.mktemp("i2v")
    data = root / "data"
    data.mkdir()
    _write_video(data / "clip.mp4", frames=24, fps=24, size=(VIDEO_BUCKET.width, VIDEO_BUCKET.height))
    (data / "clip.txt").write_text("a drifting gradient", encoding="utf-8")
    g = torch.Generator().manual_seed(31)
    still = (torch.rand(IMAGE_BUCKET.height, IMAGE_BUCKET.width, 3, generator=g) * 255).to(torch.uint8)
    Image.fromarray(still.numpy()).save(data / "still.png")
    (data / "still.txt").write_text("a noisy still", encoding="utf-8")
    vae, clip = tiny_wan21_vae(), encoders[1]
    clip_a = tiny_clip_vision(root / "clip_a", seed=41)
    cache = root / "cache"

    def run(start: StartImage | None):
        kw = {} if start is None else {"start_image": start}
        return build_cache(scan_dataset(data, 32, buckets=SETTINGS), vae, clip, cache, **kw)

    results = {"none": run(StartImage()), "clip": run(StartImage("first_frame", clip_a))}
    return {"results": results, "data": data, "cache": cache, "vae": vae, "clip": clip, "clip_a": clip_a,
            "root": root}


def _by_source(result) -> dict[str, object]:
    from pipetrainer.training.data.micro_batches import load_examples

    return {Path(i.source).name: (i, e) for i, e in zip(result.items, load_examples(result.items), strict=True)}


def _comfy_i2v_conds(model, vae, first: torch.Tensor, frames: int, clip_vision):
    """What ComfyUI's Wan I2V graph gives the model for start image ``first``: ``(noise, cond, extra_conds)``."""
    from comfy_extras.nodes_wan import WanImageToVideo

    import nodes

    height, width = first.shape[1:3]
    clip_output = nodes.CLIPVisionEncode().encode(clip_vision, first, "none")[0]
    cond = torch.randn(1, 7, 4096, generator=torch.Generator().manual_seed(9))
    out = WanImageToVideo.execute([[cond, {}]], [[cond, {}]], vae, width, height, frames, 1, start_image=first,
                                  clip_vision_output=clip_output)
    positive, _, latent = out.result if hasattr(out, "result") else out
    values = positive[0][1]
    noise = torch.randn(latent["samples"].shape, generator=torch.Generator().manual_seed(10))
    conds = model.extra_conds(noise=noise, device=torch.device("cpu"), cross_attn=cond,
                              concat_latent_image=values["concat_latent_image"], concat_mask=values["concat_mask"],
                              clip_vision_output=values["clip_vision_output"])
    return noise, cond, conds


def test_cached_start_image_equals_what_wanimagetovideo_and_clip_vision_encode_build(i2v, comfy_root, fixture_paths):
    """For a 5-frame clip and a 1-frame image: the adapter's network input from the cached extras equals
    ``c_concat`` (mask + processed start-image latent) and ``clip_fea`` of ComfyUI's I2V graph."""
    from pipetrainer.tests.family_rows.wan_video import ROWS
    from pipetrainer.training.cache.media import load_image, load_video
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    model = next(r for r in ROWS if r.name == "Wan21-I2V").load(comfy_root, fixture_paths).model
    adapter = adapter_for("Wan")
    cached = _by_source(i2v["results"]["clip"])
    assert cached["clip.mp4"][0].bucket == VIDEO_BUCKET.name and cached["still.png"][0].bucket == IMAGE_BUCKET.name
    firsts = {"clip.mp4": load_video(str(i2v["data"] / "clip.mp4"), VIDEO_BUCKET, SETTINGS.fps),
              "still.png": load_image(str(i2v["data"] / "still.png"), IMAGE_BUCKET)}
    for name, pixels in firsts.items():
        example = cached[name][1]
        frames = pixels.shape[0]
        noise, cond, theirs = _comfy_i2v_conds(model, i2v["vae"], pixels[:1], frames, i2v["clip_a"])
        raw = example.extras["concat_latent"]
        assert raw.shape == example.latent.shape == noise.shape[1:], name
        extras = {"concat_latent": model.process_latent_in(raw[None]), "clip_fea": example.extras["clip_fea"][None]}
        t = model.model_sampling.timestep(torch.tensor([0.5]))
        x, _, _, clip_fea = adapter.first_stage_inputs(Batch(noise, t, cond, extras=extras))
        c_concat = theirs["c_concat"].cond
        assert torch.equal(x[:, :16], noise)
        assert torch.allclose(x[:, 16:], c_concat, atol=1e-5 * c_concat.abs().max().item(), rtol=0), name
        fea = theirs["clip_fea"].cond
        assert clip_fea.shape == fea.shape == (1, 257, CLIP_VISION_CONFIG["hidden_size"])
        assert torch.allclose(clip_fea, fea.float(), atol=1e-5 * fea.abs().max().item(), rtol=0), name
        if frames > 1:  # the gray frames really differ from the clip; the causal VAE's first frame does not
            assert torch.allclose(raw[:, 0], example.latent[:, 0], atol=1e-5 * raw.abs().max().item(), rtol=0)
            assert not torch.allclose(raw[:, 1:], example.latent[:, 1:], atol=1e-3, rtol=0)
        else:  # WanImageToVideo with length 1 encodes the start image alone: the item's own latent
            assert torch.equal(raw, example.latent)


def test_start_image_and_clip_vision_model_are_keyed_and_unchanged_settings_reuse(i2v, tmp_path):
    """Switching the option or the CLIP-vision model re-encodes every latent (never a caption) with the
    reason; nothing changed reuses all; ``none`` keeps the keys a cache made before the option had."""
    results = i2v["results"]
    none, clip = results["none"], results["clip"]
    assert clip.report.reencoded_kinds == {"latent": 2} and clip.report.reused == {"text": 2}
    assert sorted(clip.report.reencoded) == [
        "clip.mp4 latent: start-image conditioning changed (none -> first_frame)",
        "still.png latent: start-image conditioning changed (none -> first_frame)"]
    keys = {m: {i.latent_key for i in r.items} for m, r in results.items()}
    assert len(keys["none"] | keys["clip"]) == 4
    assert [i.text_key for i in none.items] == [i.text_key for i in clip.items]
    assert "concat_latent" not in _by_source(none)["clip.mp4"][1].extras

    shutil.copytree(i2v["cache"], tmp_path / "cache")  # later runs must not change the module's cache
    again = build_cache(scan_dataset(i2v["data"], 32, buckets=SETTINGS), i2v["vae"], i2v["clip"], tmp_path / "cache",
                        start_image=StartImage("first_frame", i2v["clip_a"]))
    assert again.report.encoded == {} and again.report.reused == {"latent": 2, "text": 2}
    assert {i.latent_key for i in again.items} == keys["clip"]
    clip_b = tiny_clip_vision(tmp_path / "clip_b", seed=42)
    other = build_cache(scan_dataset(i2v["data"], 32, buckets=SETTINGS), i2v["vae"], i2v["clip"], tmp_path / "cache",
                        start_image=StartImage("first_frame", clip_b))
    assert other.report.reencoded_kinds == {"latent": 2} and other.report.reused == {"text": 2}
    assert sorted(other.report.reencoded) == [
        "clip.mp4 latent: start-image conditioning changed (clip_vision changed)",
        "still.png latent: start-image conditioning changed (clip_vision changed)"]
    assert not {i.latent_key for i in other.items} & (keys["clip"] | keys["none"])
    legacy = build_cache(scan_dataset(i2v["data"], 32, buckets=SETTINGS), i2v["vae"], i2v["clip"], tmp_path / "cache")
    assert legacy.report.encoded == {} and {i.latent_key for i in legacy.items} == keys["none"]


def _wan_inputs(model_type: str, in_dim: int):
    """What a Wan layout takes, from the family adapter on a meta-device ComfyUI ``WanModel`` (no weights)."""
    import torch.nn as nn
    from comfy.ldm.wan.model import WanModel
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.checks import ModelInputs

    dm = WanModel(model_type=model_type, patch_size=(1, 2, 2), in_dim=in_dim, dim=128, ffn_dim=256, freq_dim=256,
                  text_dim=64, out_dim=16, num_heads=1, num_layers=1, device="meta", operations=nn)
    adapter = adapter_for("Wan")
    geometry = dataclasses.replace(adapter.geometry(dm), min_patches=1)  # the tiny test latents are 8x4
    return ModelInputs("Wan", 16, geometry, 0, 0, dict(adapter.extras(dm)))


def test_preflight_names_the_cache_option_and_refuses_a_start_image_for_text_to_video(i2v):
    from pipetrainer.nodes.checks.preflight import read_cached_shapes
    from pipetrainer.training.pipelines.checks import cache_vs_model_problems

    shapes = {m: read_cached_shapes(r.items) for m, r in i2v["results"].items()}
    # A first_frame cache without a CLIP vision model holds the same entries less 'clip_fea'.
    shapes["first_frame"] = dataclasses.replace(shapes["clip"], extras={
        e: {k: v for k, v in x.items() if k != "clip_fea"} for e, x in shapes["clip"].extras.items()})
    wan21_i2v, wan22_i2v, t2v = _wan_inputs("i2v", 36), _wan_inputs("t2v", 36), _wan_inputs("t2v", 16)

    (missing21,) = cache_vs_model_problems(shapes["none"], wan21_i2v)
    assert "'concat_latent'" in missing21 and "set start_image to first_frame" in missing21
    assert "clip_vision input" in missing21 and "Load CLIP Vision" in missing21
    (missing22,) = cache_vs_model_problems(shapes["none"], wan22_i2v)
    assert "set start_image to first_frame" in missing22 and "clip_vision" not in missing22

    assert cache_vs_model_problems(shapes["first_frame"], wan21_i2v) == []  # clip_fea is optional
    assert cache_vs_model_problems(shapes["first_frame"], wan22_i2v) == []
    (wrong,) = cache_vs_model_problems(shapes["clip"], wan21_i2v)  # the tiny CLIP is 64 wide, not ViT-H's 1280
    assert "'clip_fea'" in wrong and "does not fit" in wrong

    # Decision: a start image cached for a model that takes none is an error (the user meant I2V training).
    (ignored,) = cache_vs_model_problems(shapes["first_frame"], t2v)
    assert "'concat_latent'" in ignored and "not an image-to-video model" in ignored and "start_image to none" in ignored
    assert len(cache_vs_model_problems(shapes["clip"], t2v)) == 1
    (extra_clip,) = cache_vs_model_problems(shapes["clip"], wan22_i2v)
    assert "'clip_fea'" in extra_clip and "disconnect clip_vision" in extra_clip
    assert cache_vs_model_problems(shapes["none"], t2v) == []


def test_cache_node_offers_the_option_and_refuses_an_unused_clip_vision(i2v):
    from pipetrainer.nodes.cache import PipeTrainerCache

    inputs = {i.id: i for i in PipeTrainerCache.define_schema().inputs}
    assert inputs["start_image"].options == ["none", "first_frame", "first_frame_alone", "first_last_frames",
                                             "first_keyframe", "last_keyframe"]
    assert inputs["start_image"].default == "none"
    assert inputs["start_image"].optional and inputs["clip_vision"].optional
    assert inputs["clip_vision"].get_io_type() == "CLIP_VISION"
    assert StartImage("first_frame", i2v["clip_a"]).problems() == []
    (unused,) = StartImage("none", i2v["clip_a"]).problems()
    assert "start_image is none" in unused and "first_frame" in unused
    assert StartImage("last_frame").problems()


def test_without_a_clip_vision_model_only_the_start_latent_is_made():
    pixels, latent = torch.rand(1, 16, 48, 3), torch.randn(16, 1, 2, 6)
    out = StartImage("first_frame").encode(pixels, latent, encode_latent=None)  # one frame: no second encode
    assert list(out) == ["concat_latent"] and torch.equal(out["concat_latent"], latent)
    assert StartImage().encode(pixels, latent, encode_latent=None) == {}
    assert StartImage().identity() is None  # none: the latent key stays what it was before the option
