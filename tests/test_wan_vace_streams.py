"""Wan 2.1 VACE: several control streams, a reference image, and image-only datasets.

The oracles are ComfyUI's own sampling graph: chained ``WanVaceToVideo`` nodes (each given the reference
image, as a chain must be to stack its streams), ``WAN21_Vace.extra_conds`` and ``apply_model``, with the real
(narrow) Wan 2.1 VAE; the node's empty latent and ``trim_latent`` say where the reference frame sits.
Keys: a changed reference image re-encodes its item only. Pairing: the control folder's names
(``clip.2.mp4``, ``clip.2_mask.png``, ``clip_ref.png``) and every problem with them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from pipetrainer.tests.family_rows.wan_vace import wan_vace_small
from pipetrainer.tests.test_wan_vace_cache import _by_source, _write_video
from pipetrainer.training.data.dataset import BucketSettings, DatasetError, scan_dataset
from pipetrainer.training.data.dataset_controls import ControlSet, control_set, is_control_dataset, pair_controls
from pipetrainer.training.pipelines.base import Batch, adapter_for

SETTINGS = BucketSettings(resolutions=(48,), max_frames=5, fps=8.0)  # 12 frames at 16 fps: 6 at 8 -> bucket 5
VIDEO = (".mp4",)


def _node(vae, streams, reference, width, height, length):
    """ComfyUI's chain: one WanVaceToVideo per stream on one conditioning; ``(values, latent, trim)``."""
    from comfy_extras.nodes_wan import WanVaceToVideo

    carrier = [[torch.zeros(1, 1, 1), {}]]
    for pixels, mask in streams:
        out = WanVaceToVideo.execute(carrier, [], vae, width, height, length, 1, 1.0, control_video=pixels,
                                     control_masks=mask, reference_image=reference)
        carrier, _, latent, trim = out.result if hasattr(out, "result") else out
    return carrier[0][1], latent["samples"], trim


def _their_context(model, values, latent):
    return model.extra_conds(noise=torch.zeros_like(latent), device=torch.device("cpu"),
                             vace_frames=values["vace_frames"], vace_mask=values["vace_mask"])


# ---- pairing (pure) ----------------------------------------------------------------------------


def test_streams_masks_and_the_reference_pair_by_name_in_chain_order(tmp_path):
    files = ["a.mp4", "a.2.mp4", "a.2_mask.png", "a_mask.mp4", "a_ref.png", "a.3.webm", "b.mp4", "notes.txt"]
    paired, problems = pair_controls(["a.mp4", "b.mp4", "a.2x.mp4"], files, tmp_path, (".mp4", ".webm", ".png"),
                                     required=["a.mp4", "b.mp4"])
    assert problems == []
    assert [Path(p).name for p in paired["a.mp4"]] == ["a.mp4", "a_mask.mp4", "a.2.mp4", "a.2_mask.png",
                                                       "a.3.webm", "a_ref.png"]
    got = control_set(str(tmp_path / "a.mp4"), paired["a.mp4"])
    assert [(Path(c).name, m and Path(m).name) for c, m in got.streams] == [
        ("a.mp4", "a_mask.mp4"), ("a.2.mp4", "a.2_mask.png"), ("a.3.webm", None)]
    assert Path(got.reference).name == "a_ref.png"
    assert control_set("b.mp4", paired["b.mp4"]) == ControlSet(((str(tmp_path / "b.mp4"), None),))


def test_stream_problems_are_named_with_the_fix(tmp_path):
    files = ["a.mp4", "a.3.mp4", "a.4_mask.png", "a_ref.mp4", "b.mp4"]
    _, problems = pair_controls(["a.mp4", "b.mp4"], files, tmp_path, (".mp4", ".png"), image_extensions=(".png",))
    text = "\n".join(problems)
    assert "a.mp4 has streams 1, 3" in text and "without gaps" in text
    assert "a.4_mask.png" in text and "no control of their stream" in text
    assert "a_ref.mp4" in text and "name_ref.png" in text


def test_an_image_folder_is_vace_when_a_file_has_a_vace_only_name():
    assert not is_control_dataset(["cat.png"], ["cat.png", "cat_1.png"], VIDEO)  # an edit dataset, as before
    assert not is_control_dataset(["cat.png"], ["cat.png"], VIDEO)  # ambiguous: the Cache node decides
    assert is_control_dataset(["cat.png"], ["cat.png", "cat_ref.png"], VIDEO)
    assert is_control_dataset(["cat.png"], ["cat.png", "cat_mask.png"], VIDEO)
    assert is_control_dataset(["cat.png"], ["cat.png", "cat.2.png"], VIDEO)
    assert not is_control_dataset(["cat.png", "cat_ref.png"], ["cat.png", "cat_ref.png"], VIDEO)  # their own stems
    # clips: a video control is VACE; plain images are reference pictures (an image never controls a clip)
    assert is_control_dataset(["cat.mp4"], ["cat.mp4"], VIDEO)
    assert is_control_dataset(["cat.mp4"], ["cat_ref.png"], VIDEO)
    assert not is_control_dataset(["cat.mp4"], ["cat.png", "cat_1.png"], VIDEO)


def test_a_reference_frame_is_left_out_of_the_loss():
    """Per item, a [F, h, w] loss mask weighs each latent frame; a spatial [1, h, w] one every frame. The
    reference frame's item mask is 0 there and the item's own spatial mask on its frames."""
    from types import SimpleNamespace

    from pipetrainer.training.data.micro_batches import MicroBatches

    x0 = torch.zeros(2, 16, 3, 2, 2)
    framed = torch.ones(3, 2, 2)
    framed[0] = 0
    spatial = torch.tensor([[[1.0, 0.5], [0.0, 1.0]]])
    weight = MicroBatches.loss_weight(None, [SimpleNamespace(mask=framed), SimpleNamespace(mask=spatial)], x0,
                                      torch.ones(1, 3, 1, 1))
    assert weight.shape == (2, 1, 3, 2, 2)
    assert torch.equal(weight[0, 0], framed) and torch.equal(weight[1, 0], spatial.expand(3, 2, 2))

    from pipetrainer.training.cache.vace_control import with_reference_frame

    latent, reference = torch.randn(16, 2, 2, 2), torch.randn(1, 16, 1, 2, 2)
    grown = with_reference_frame(latent, reference, spatial)  # the item's own loss mask stays on its frames
    assert torch.equal(grown["latent"], torch.cat([reference[0], latent], dim=1))
    assert torch.equal(grown["loss_mask"], torch.cat([torch.zeros(1, 2, 2), spatial, spatial]))


# ---- the model: ComfyUI's chained conditioning -------------------------------------------------


def test_two_streams_with_a_reference_match_the_chained_nodes_and_apply_model(comfy_root):
    """The cache's context of two streams and a reference = the chained nodes' conditioning after extra_conds;
    its reference frame sits where the node's latent grows (trim 1); the staged forward with it = apply_model."""
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.vace_control import VACE_CONTEXT, stream_contexts

    model, vae = wan_vace_small().model, tiny_wan21_vae()
    g = torch.Generator().manual_seed(12)
    streams = [(torch.rand(5, 32, 32, 3, generator=g), (torch.rand(5, 32, 32, generator=g) > 0.5).float()),
               (torch.rand(5, 32, 32, 3, generator=g), None)]
    reference = torch.rand(1, 32, 32, 3, generator=g)
    values, latent, trim = _node(vae, streams, reference, 32, 32, 5)
    theirs = _their_context(model, values, latent)
    cached = stream_contexts(vae, streams, reference)
    assert trim == 1 and latent.shape == (1, 16, 3, 4, 4) and cached.shape == (2, 96, 3, 4, 4)
    assert torch.equal(cached[None], theirs["vace_context"].cond)
    assert theirs["vace_strength"].cond == [1.0, 1.0]

    noise = torch.randn(latent.shape, generator=g)
    cond = torch.randn(1, 5, 16, generator=g)
    sigma = torch.tensor([0.7])
    batch = Batch(noise, model.model_sampling.timestep(sigma), cond, extras={VACE_CONTEXT: cached[None]})
    with torch.no_grad():
        out = adapter_for("WanVace").first_stage_inputs(batch)
        for layer in adapter_for("WanVace").stage_layers(model.diffusion_model):
            out = layer(out)
        comfy = model.apply_model(noise, sigma, c_crossattn=cond, vace_context=theirs["vace_context"].cond,
                                  vace_strength=theirs["vace_strength"].cond)
    denoised = model.model_sampling.calculate_denoised(sigma, out.float(), noise)
    assert torch.allclose(denoised, comfy, rtol=0, atol=1e-6 * comfy.abs().max().item())


# ---- the Cache node ----------------------------------------------------------------------------


def test_a_clip_with_two_streams_and_a_reference_caches_what_comfyui_samples(encoders, tmp_path):
    """A clip, its two control streams (a still mask on the first) and a reference image through the Dataset
    and Cache nodes: vace_context = the chained nodes' (each with the reference); the training latent has the
    node's reference latent in front of the clip's, the node's latent length, and a loss mask 0 there."""
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import fit_pixels, load_image, load_video
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.cache.vace_control import VaceControl

    data, control = tmp_path / "data", tmp_path / "control"
    data.mkdir()
    control.mkdir()
    _write_video(data / "a.mp4", 12, 16, (48, 48), seed=0)
    (data / "a.txt").write_text("clip a", encoding="utf-8")
    _write_video(control / "a.mp4", 12, 16, (64, 48), seed=1)
    _write_video(control / "a.2.mp4", 12, 16, (48, 48), seed=2)
    Image.new("L", (48, 48), 0).save(control / "a_mask.png")
    Image.new("L", (24, 48), 255).save(control / "a_mask_right.png")  # not a VACE name: refused below
    with pytest.raises(DatasetError, match="a_mask_right.png"):
        scan_dataset(data, 48, buckets=SETTINGS, control_folder=control)
    (control / "a_mask_right.png").unlink()
    Image.new("RGB", (96, 64), (220, 30, 60)).save(control / "a_ref.png")
    dataset = scan_dataset(data, 48, buckets=SETTINGS, control_folder=control)
    assert "a reference image" in dataset.report()
    vae = tiny_wan21_vae()
    result = build_cache(dataset, vae, encoders[1], tmp_path / "cache", vace=VaceControl("on", vae))
    assert result.report.skipped == []
    example = _by_source(result)["a.mp4"]

    bucket = Bucket(48, 48, 5)
    with Image.open(control / "a_mask.png") as img:
        still = torch.from_numpy(fit_pixels(img, bucket, mode="L").copy())[None].repeat(5, 1, 1)
    streams = [(load_video(str(control / "a.mp4"), bucket, 8.0), still),
               (load_video(str(control / "a.2.mp4"), bucket, 8.0), None)]
    reference = load_image(str(control / "a_ref.png"), Bucket(48, 48))
    values, latent, trim = _node(vae, streams, reference, 48, 48, 5)
    theirs = _their_context(wan_vace_small().model, values, latent)["vace_context"].cond
    assert torch.equal(example.extras["vace_context"][None], theirs)
    assert trim == 1 and example.latent.shape == latent.shape[1:] == (16, 3, 6, 6)
    assert torch.equal(example.latent[:, :1], values["vace_frames"][0][0, :16, :1])
    clip = vae.encode(load_video(str(data / "a.mp4"), bucket, 8.0))[0]
    assert torch.equal(example.latent[:, 1:], clip.float())
    assert example.mask.shape == (3, 6, 6) and example.mask[0].abs().max() == 0 and example.mask[1:].min() == 1

    from pipetrainer.nodes.checks.preflight import dataset_latent_elements  # the disk estimate counts it all

    stored = example.latent.numel() + example.extras["vace_context"].numel() + example.mask.numel()
    assert dataset_latent_elements(dataset, 16, 8, lambda n: (n - 1) // 4 + 1) == stored


def test_an_image_dataset_trains_one_frame_clips(encoders, tmp_path):
    """Plain control images (what the Dataset node reads as edit references) are VACE control images for the
    Cache node with vace_control on: 1-frame contexts = WanVaceToVideo with length 1."""
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import load_image
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.cache.vace_control import VaceControl

    data, control = _images(tmp_path, reference=False)
    plain = scan_dataset(data, 48, control_folder=control)
    assert all(len(e.references) == 1 and not e.controls for e in plain.entries)  # the Dataset cannot tell
    vae = tiny_wan21_vae()
    vace = VaceControl("on", vae)
    assert vace.problems(plain.entries) and vace.problems(vace.dataset(plain).entries) == []
    result = build_cache(vace.dataset(plain), vae, encoders[1], tmp_path / "cache", vace=vace)
    examples = _by_source(result)
    model = wan_vace_small().model
    for name in "xy":
        pixels = load_image(str(control / f"{name}.png"), Bucket(48, 48))
        values, latent, trim = _node(vae, [(pixels, None)], None, 48, 48, 1)
        theirs = _their_context(model, values, latent)["vace_context"].cond
        assert trim == 0 and torch.equal(examples[f"{name}.png"].extras["vace_context"][None], theirs), name
        assert "reference_0" not in examples[f"{name}.png"].extras  # not an edit reference any more
        assert examples[f"{name}.png"].latent.shape == (16, 1, 6, 6) and examples[f"{name}.png"].mask is None


@pytest.fixture(scope="module")
def with_reference(encoders, tmp_path_factory):
    """Two images with control images, y with a reference image, cached with vace_control on."""
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.cache.vace_control import VaceControl

    root = tmp_path_factory.mktemp("vace_ref")
    data, control = _images(root, reference=True)
    dataset = scan_dataset(data, 48, control_folder=control)  # y_ref.png: a VACE name, a VACE folder
    vae = tiny_wan21_vae()
    result = build_cache(dataset, vae, encoders[1], root / "cache", vace=VaceControl("on", vae))
    return {"result": result, "root": root, "vae": vae, "clip": encoders[1]}


def test_a_reference_grows_its_item_and_a_changed_one_reencodes_only_it(with_reference, tmp_path):
    """The reference frame is in front of y's latent and context as the node puts it (trim 1); x keeps its one
    frame; changing y_ref.png re-encodes y only, with the reason."""
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import load_image
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.cache.vace_control import VaceControl

    vae, control = with_reference["vae"], with_reference["root"] / "control"
    examples = _by_source(with_reference["result"])
    reference = load_image(str(control / "y_ref.png"), Bucket(48, 48))
    pixels = load_image(str(control / "y.png"), Bucket(48, 48))
    values, latent, trim = _node(vae, [(pixels, None)], reference, 48, 48, 1)
    y = examples["y.png"]
    assert trim == 1 and y.latent.shape == latent.shape[1:] == (16, 2, 6, 6)
    theirs = _their_context(wan_vace_small().model, values, latent)["vace_context"].cond
    assert torch.equal(y.extras["vace_context"][None], theirs)
    assert torch.equal(y.latent[:, :1], values["vace_frames"][0][0, :16, :1])
    assert y.mask.shape == (2, 6, 6) and y.mask[0].abs().max() == 0 and y.mask[1].min() == 1
    assert examples["x.png"].latent.shape == (16, 1, 6, 6) and examples["x.png"].mask is None

    shutil.copytree(with_reference["root"], tmp_path / "copy")  # the module's cache stays as it is
    root = tmp_path / "copy"
    again = build_cache(scan_dataset(root / "data", 48, control_folder=root / "control"), vae,
                        with_reference["clip"], root / "cache", vace=VaceControl("on", vae))
    assert again.report.encoded == {} and again.report.reused == {"latent": 2, "text": 2}
    shutil.copy(root / "control" / "x.png", root / "control" / "y_ref.png")
    changed = build_cache(scan_dataset(root / "data", 48, control_folder=root / "control"), vae,
                          with_reference["clip"], root / "cache", vace=VaceControl("on", vae))
    assert changed.report.reencoded == ["y.png latent: VACE control changed (reference changed)"]
    assert changed.report.reused == {"latent": 1, "text": 2}
    assert not torch.equal(_by_source(changed)["y.png"].latent[:, 0], y.latent[:, 0])
    assert torch.equal(_by_source(changed)["x.png"].latent, examples["x.png"].latent)


@pytest.mark.slow
def test_a_lora_trains_on_images_with_a_reference_frame(with_reference, comfy_root, tmp_path):
    """The real process tree on a detected tiny WAN21_Vace file: 1-frame items and one with its reference frame
    (a per-frame loss mask) train finite, changing losses."""
    import math

    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.tests.test_wan_vace_cache import _build_tiny_vace
    from pipetrainer.training.spec.options import CacheItem, LoraSpec
    from safetensors.torch import save_file

    model_file = _build_tiny_vace(tmp_path / "tiny-wan21-vace.safetensors")
    g = torch.Generator().manual_seed(13)
    items = []
    for name, example in sorted(_by_source(with_reference["result"]).items()):
        latent, text = tmp_path / f"{name}.latent.safetensors", tmp_path / f"{name}.text.safetensors"
        tensors = {"latent": example.latent.float(), "vace_context": example.extras["vace_context"]}
        if example.mask is not None:
            tensors["loss_mask"] = example.mask
        save_file(tensors, str(latent))
        save_file({"cond": torch.randn(5, 4096, generator=g)}, str(text))
        items.append(CacheItem(str(latent), str(text), name, f"image {name}"))
    spec = make_spec(model_file, items, tmp_path / "run", comfy_root, steps=2, pipeline_stages=1,
                     lora=LoraSpec(rank=4, alpha=4.0, targets="all_linear"))
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] == "error"]
    got = losses(events)
    assert len(got) == 2 and all(math.isfinite(v) for v in got)


def _images(root: Path, reference: bool) -> tuple[Path, Path]:
    data, control = root / "data", root / "control"
    data.mkdir(parents=True)
    control.mkdir()
    g = torch.Generator().manual_seed(5)
    for name in "xy":
        for folder in (data, control):
            pixels = (torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8)
            Image.fromarray(pixels.numpy()).save(folder / f"{name}.png")
        (data / f"{name}.txt").write_text(f"image {name}", encoding="utf-8")
    if reference:
        Image.new("RGB", (48, 48), (10, 200, 90)).save(control / "y_ref.png")
    return data, control
