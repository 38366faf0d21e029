"""Wan 2.1 VACE from the nodes: control clips paired by the Dataset node, cached by the Cache node, trained.

The oracle of the cached ``vace_context`` is ComfyUI's own sampling graph: ``WanVaceToVideo`` given the
control clip (and mask) read at the item's bucket, then ``WAN21_Vace.extra_conds``, with the real (narrow)
Wan 2.1 VAE. Keys: a changed control clip re-encodes its item only, with the reason. The dataset check
names every missing, unpaired, doubled or short control in one message. The slow test trains a detected
tiny WAN21_Vace file (written here; ComfyUI's detection reads the VACE blocks from the weights) through
the real process on the cached latents and control streams.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.cache.vace_control import VaceControl
from pipetrainer.training.data.dataset import BucketSettings, DatasetError, scan_dataset

SETTINGS = BucketSettings(resolutions=(48,), max_frames=5, fps=8.0)  # 12 frames at 16 fps: 6 at 8 -> bucket 5


def _write_video(path: Path, frames: int, fps: int, size: tuple[int, int], seed: int) -> None:
    import av
    import numpy as np

    w, h = size
    base = np.random.default_rng(seed).integers(0, 256, (h, w, 3))
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            img = ((base + 31 * i) % 256).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _vace_dataset(root: Path) -> tuple[Path, Path]:
    """Two captioned clips; clip a has a control video and a still mask, clip b a control video and a mask video."""
    from PIL import Image

    data, control = root / "data", root / "control"
    data.mkdir(parents=True)
    control.mkdir()
    for i, name in enumerate("ab"):
        _write_video(data / f"{name}.mp4", 12, 16, (48, 48), seed=i)
        (data / f"{name}.txt").write_text(f"clip {name}", encoding="utf-8")
        _write_video(control / f"{name}.mp4", 12, 16, (64, 48), seed=10 + i)  # another size: read like its clip
    g = torch.Generator().manual_seed(3)
    still = ((torch.rand(48, 64, generator=g) > 0.5) * 255).to(torch.uint8)
    Image.fromarray(still.numpy(), mode="L").save(control / "a_mask.png")
    _write_video(control / "b_mask.mp4", 12, 16, (64, 48), seed=20)
    (control / "notes.txt").write_text("ignored", encoding="utf-8")
    return data, control


# ---- the Dataset node's pairing ----------------------------------------------------------------


def test_control_clips_and_masks_pair_with_their_clips_by_name(tmp_path):
    data, control = _vace_dataset(tmp_path)
    dataset = scan_dataset(data, 48, buckets=SETTINGS, control_folder=control)
    got = {Path(e.path).name: tuple(Path(c).name for c in e.controls) for e in dataset.entries}
    assert got == {"a.mp4": ("a.mp4", "a_mask.png"), "b.mp4": ("b.mp4", "b_mask.mp4")}
    assert all(e.references == () for e in dataset.entries)  # controls are not edit references
    assert "VACE control clips in" in dataset.report() and "2 with a mask" in dataset.report()


def test_every_control_problem_is_named_in_one_pass(tmp_path):
    data, control = _vace_dataset(tmp_path)
    _write_video(data / "c.mp4", 12, 16, (48, 48), seed=4)
    (data / "c.txt").write_text("clip c", encoding="utf-8")  # no control
    _write_video(control / "b.mov", 12, 16, (48, 48), seed=5)  # a second control for b
    _write_video(control / "zzz.mp4", 12, 16, (48, 48), seed=6)  # pairs with nothing
    _write_video(control / "a.mp4", 4, 16, (64, 48), seed=7)  # 2 frames at 8 fps, a trains 5
    with pytest.raises(DatasetError) as err:
        scan_dataset(data, 48, buckets=SETTINGS, control_folder=control)
    text = str(err.value)
    assert "c.mp4 (needs c.mp4 or another video type)" in text and "no VACE control clip" in text
    assert "b.mov and b.mp4" in text and "Keep one of each" in text
    assert "zzz.mp4" in text and "pair with no training clip" in text
    assert "a.mp4 has 2 frames at 8 fps, and a.mp4 trains 5 frames" in text and "at least as long" in text


def test_an_image_control_for_a_clip_is_refused_and_image_references_pair_as_before(tmp_path):
    from PIL import Image

    data, control = _vace_dataset(tmp_path)
    (control / "b.mp4").unlink()
    Image.new("RGB", (48, 48), (9, 9, 9)).save(control / "b.png")
    with pytest.raises(DatasetError, match=r"b\.png is an image, and b\.mp4 trains 5 frames"):
        scan_dataset(data, 48, buckets=SETTINGS, control_folder=control)

    edit, refs = tmp_path / "edit", tmp_path / "refs"  # an image-only dataset: edit references, unchanged
    edit.mkdir()
    refs.mkdir()
    Image.new("RGB", (32, 32)).save(edit / "cat.png")
    (edit / "cat.txt").write_text("a cat", encoding="utf-8")
    Image.new("RGB", (32, 32)).save(refs / "cat.png")
    Image.new("RGB", (32, 32)).save(refs / "cat_1.jpg")
    [entry] = scan_dataset(edit, 32, control_folder=refs).entries
    assert [Path(r).name for r in entry.references] == ["cat.png", "cat_1.jpg"] and entry.controls == ()


# ---- the Cache node ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vace(encoders, tmp_path_factory):
    """The VACE dataset cached with vace_control on: ``dict`` with the result, folders, VAE and CLIP."""
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae

    root = tmp_path_factory.mktemp("vace")
    data, control = _vace_dataset(root)
    vae, clip = tiny_wan21_vae(), encoders[1]
    result = build_cache(scan_dataset(data, 48, buckets=SETTINGS, control_folder=control), vae, clip,
                         root / "cache", vace=VaceControl("on", vae))
    return {"result": result, "root": root, "data": data, "control": control, "vae": vae, "clip": clip}


def _by_source(result) -> dict:
    from pipetrainer.training.data.micro_batches import load_examples

    return {Path(i.source).name: e for i, e in zip(result.items, load_examples(result.items), strict=True)}


def test_cached_vace_context_is_what_wanvacetovideo_gives_the_model(vace, comfy_root):
    """Per clip: the cached vace_context = WanVaceToVideo (strength 1) + WAN21_Vace.extra_conds of its control
    clip and mask read at the clip's bucket, frame rate and frame count; a still mask is every frame's mask."""
    from comfy_extras.nodes_wan import WanVaceToVideo
    from PIL import Image
    from pipetrainer.tests.family_rows.wan_vace import wan_vace_small
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import fit_pixels, load_video

    result, control = vace["result"], vace["control"]
    assert result.report.skipped == [] and len(result.items) == 2
    examples = _by_source(result)
    model = wan_vace_small().model
    bucket = Bucket(48, 48, 5)
    with Image.open(control / "a_mask.png") as img:  # resized and cropped as an image item is
        still = torch.from_numpy(fit_pixels(img, bucket, mode="L").copy())
    masks = {"a": still[None].repeat(5, 1, 1), "b": load_video(str(control / "b_mask.mp4"), bucket, 8.0).mean(-1)}
    for name in "ab":
        pixels = load_video(str(control / f"{name}.mp4"), bucket, 8.0)
        node = WanVaceToVideo.execute([[torch.zeros(1, 1, 1), {}]], [], vace["vae"], 48, 48, 5, 1, 1.0,
                                      control_video=pixels, control_masks=masks[name])
        values = (node.result if hasattr(node, "result") else node)[0][0][1]
        theirs = model.extra_conds(noise=torch.zeros(1, 16, 2, 6, 6), device=torch.device("cpu"),
                                   vace_frames=values["vace_frames"], vace_mask=values["vace_mask"])["vace_context"]
        got = examples[f"{name}.mp4"].extras["vace_context"]
        assert got.shape == (1, 96, 2, 6, 6) and examples[f"{name}.mp4"].latent.shape == (16, 2, 6, 6)
        assert torch.equal(got[None], theirs.cond), name


def test_a_changed_control_reencodes_only_its_item_with_the_reason(vace, tmp_path):
    shutil.copytree(vace["root"], tmp_path / "copy")  # later runs must not change the module's cache
    root = tmp_path / "copy"
    dataset = scan_dataset(root / "data", 48, buckets=SETTINGS, control_folder=root / "control")
    again = build_cache(dataset, vace["vae"], vace["clip"], root / "cache", vace=VaceControl("on", vace["vae"]))
    assert again.report.encoded == {} and again.report.reused == {"latent": 2, "text": 2}
    before = {Path(i.source).name: i.latent_key for i in again.items}

    _write_video(root / "control" / "b.mp4", 12, 16, (64, 48), seed=99)
    dataset = scan_dataset(root / "data", 48, buckets=SETTINGS, control_folder=root / "control")
    changed = build_cache(dataset, vace["vae"], vace["clip"], root / "cache", vace=VaceControl("on", vace["vae"]))
    assert changed.report.reencoded == ["b.mp4 latent: VACE control changed (control changed)"]
    assert changed.report.reused == {"latent": 1, "text": 2}
    after = {Path(i.source).name: i.latent_key for i in changed.items}
    assert after["a.mp4"] == before["a.mp4"] and after["b.mp4"] != before["b.mp4"]
    assert not torch.equal(_by_source(changed)["b.mp4"].extras["vace_context"],
                           _by_source(again)["b.mp4"].extras["vace_context"])

    from PIL import Image

    Image.new("L", (64, 48), 255).save(root / "control" / "a_mask.png")  # the mask counts too
    dataset = scan_dataset(root / "data", 48, buckets=SETTINGS, control_folder=root / "control")
    masked = build_cache(dataset, vace["vae"], vace["clip"], root / "cache", vace=VaceControl("on", vace["vae"]))
    assert masked.report.reencoded == ["a.mp4 latent: VACE control changed (mask changed)"]

    off = build_cache(dataset, vace["vae"], vace["clip"], root / "cache")  # off: plain latents, keys of their own
    assert "vace_context" not in _by_source(off)["a.mp4"].extras
    assert not {i.latent_key for i in off.items} & set(after.values())


def test_the_cache_node_option_is_checked_against_the_dataset(vace, tmp_path):
    from pipetrainer.nodes.cache import PipeTrainerCache

    inputs = {i.id: i for i in PipeTrainerCache.define_schema().inputs}
    assert inputs["vace_control"].options == ["off", "on"] and inputs["vace_control"].default == "off"
    assert inputs["vace_control"].optional
    paired = scan_dataset(vace["data"], 48, buckets=SETTINGS, control_folder=vace["control"])
    assert VaceControl("on").problems(paired.entries) == []
    [unused] = VaceControl("off").problems(paired.entries)
    assert "vace_control is off" in unused and "set vace_control on" in unused
    plain = scan_dataset(vace["data"], 48, buckets=SETTINGS)
    [without] = VaceControl("on").problems(plain.entries)
    assert "a.mp4, b.mp4" in without and "control_folder" in without
    [flip] = VaceControl("on").problems(paired.entries, "random")
    assert "flip" in flip
    assert VaceControl("sometimes").problems(paired.entries)


def test_the_disk_estimate_counts_the_control_stream(vace):
    from pipetrainer.nodes.checks.preflight import dataset_latent_elements

    paired = scan_dataset(vace["data"], 48, buckets=SETTINGS, control_folder=vace["control"])
    plain = scan_dataset(vace["data"], 48, buckets=SETTINGS)
    frames = lambda n: (n - 1) // 4 + 1  # noqa: E731 - Wan's 4k+1 rule
    extra = dataset_latent_elements(paired, 16, 8, frames) - dataset_latent_elements(plain, 16, 8, frames)
    stored = sum(e.extras["vace_context"].numel() for e in _by_source(vace["result"]).values())
    assert extra == stored == 2 * 96 * 2 * 6 * 6


# ---- training --------------------------------------------------------------------------------


def _build_tiny_vace(path: Path, seed: int = 2131) -> Path:
    """A Wan 2.1 VACE file ComfyUI's detection accepts: dim 128 (1 head), 2 main and 1 VACE block, UMT5's
    4096-wide text input (pinned by detection), ``vace_in_dim`` 96 read from ``vace_patch_embedding``."""
    from comfy.ldm.wan.model import VaceWanModel
    from pipetrainer.devkit.fixtures import _randomize_scaled
    from safetensors.torch import save_file

    model = VaceWanModel(patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=256, freq_dim=256, text_dim=4096,
                         out_dim=16, num_heads=1, num_layers=2, vace_layers=1, vace_in_dim=96, device="meta",
                         operations=torch.nn)
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    save_file(_randomize_scaled(state, seed), str(path))
    return path


@pytest.mark.slow
def test_a_vace_lora_trains_on_the_cached_control_streams(vace, comfy_root, tmp_path):
    """The real process tree on a detected tiny WAN21_Vace file: the cached latents and vace_context of the
    Cache node (the text is seeded 4096-wide: the tiny CLIP-L cannot give UMT5's width) train finite,
    changing losses and a non-zero LoRA; without the control stream the same run is refused before step 0."""
    import math

    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.training.spec.options import CacheItem, LoraSpec
    from safetensors.torch import save_file

    model_file = _build_tiny_vace(tmp_path / "tiny-wan21-vace.safetensors")
    g = torch.Generator().manual_seed(11)
    items, plain = [], []
    for name, example in sorted(_by_source(vace["result"]).items()):
        latent, text = tmp_path / f"{name}.latent.safetensors", tmp_path / f"{name}.text.safetensors"
        save_file({"latent": example.latent.float(), "vace_context": example.extras["vace_context"]}, str(latent))
        save_file({"cond": torch.randn(5, 4096, generator=g)}, str(text))
        items.append(CacheItem(str(latent), str(text), name, f"clip {name}"))
        bare = tmp_path / f"{name}.bare.safetensors"
        save_file({"latent": example.latent.float()}, str(bare))
        plain.append(CacheItem(str(bare), str(text), name, f"clip {name}"))

    spec = make_spec(model_file, items, tmp_path / "run", comfy_root, steps=3, pipeline_stages=1,
                     lora=LoraSpec(rank=4, alpha=4.0, targets="all_linear"))
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] == "error"]
    assert next(e for e in events if e["type"] == "setup")["family"] == "WanVace"
    got = losses(events)
    assert len(got) == 3 and all(math.isfinite(v) for v in got) and len(set(got)) > 1
    from safetensors import safe_open

    with safe_open(spec.lora_output, "pt") as f:
        keys = list(f.keys())
        assert any(f.get_tensor(k).abs().max() > 0 for k in keys if k.endswith("lora_B.weight"))
    assert any("vace_blocks" in k for k in keys)

    refused = make_spec(model_file, plain, tmp_path / "bare", comfy_root, steps=1, pipeline_stages=1)
    code, events = run_training(refused)
    assert code != 0 and not losses(events)
    assert any("vace_context" in e.get("message", "") for e in events if e["type"] == "error")
