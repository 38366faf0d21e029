"""Horizontal flip as a cached variant, and masked loss (mask folder or alpha channel).

Oracles are independent of the code under test: ComfyUI's own ``VAE.encode`` of the mirrored pixels
(read with Pillow at the bucket size, so no resize is involved), a second dataset of mirrored images
and mirrored masks cached from scratch (its latent and mask must be the first one's flipped variants),
and MSE computed by hand over the elements a mask keeps.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from pipetrainer.training.cache.masks import FLIPPED_LATENT, LOSS_MASK
from pipetrainer.training.cache.reader import read_entries
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import DatasetError, scan_dataset
from pipetrainer.training.data.dataset_masks import pair_masks
from pipetrainer.training.data.micro_batches import Example, MicroBatches, load_examples
from pipetrainer.training.objective.loss import mse_loss
from pipetrainer.training.pipelines.base import adapter_for
from pipetrainer.training.spec.options import TimestepSpec

SIZE = 64  # the bucket size: sources are written at it, so the oracles need no resize


# ---- pairing and options (pure) -------------------------------------------------------------------
def test_masks_pair_by_stem_and_every_problem_names_its_files(tmp_path):
    paired, problems = pair_masks(["a.jpg", "b.png", "c.mp4"], ["a.png", "c.webp"], tmp_path, required=["a.jpg", "c.mp4"])
    assert problems == [] and {k: Path(v).name for k, v in paired.items()} == {"a.jpg": "a.png", "c.mp4": "c.webp"}
    _, problems = pair_masks(["a.jpg", "b.png", "d.png"], ["a.png", "a.webp", "zz.png", "d.png"], tmp_path / "m")
    assert len(problems) == 3
    assert "a.png and a.webp" in problems[0]
    assert "1 training file(s) have no mask" in problems[1] and "b.png (needs b.png)" in problems[1]
    assert "zz.png" in problems[2] and str(tmp_path / "m") in problems[2]


def _write(folder: Path, name: str, pixels: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(folder / name)
    return folder / name


def _asymmetric(seed: int) -> np.ndarray:
    """A 64x64 RGB picture whose mirror differs from it (a bright bar on one side, a smooth ramp)."""
    rng = np.random.default_rng(seed)
    img = np.zeros((SIZE, SIZE, 3), np.uint8)
    img[:] = np.linspace(20, 200, SIZE, dtype=np.uint8)[None, :, None]
    img[:, 6:18] = rng.integers(0, 255, 3, dtype=np.uint8)
    img[40:56, 30:60, 1] = 255
    return img


def _mask(seed: int) -> np.ndarray:
    """A grey-level mask: black left strip, white block, a soft ramp (the area averages are not 0/1)."""
    m = np.full((SIZE, SIZE), 255, np.uint8)
    m[:, :20] = 0
    m[:30, 40:] = np.linspace(0, 255, SIZE - 40, dtype=np.uint8)[None, :]
    m[seed:seed + 5, 25:27] = 128
    return m


def _dataset(root: Path, mirrored: bool = False) -> Path:
    """Two asymmetric images with captions and masks (mirrored: the same, left-right mirrored)."""
    flip = (lambda a: a[:, ::-1].copy()) if mirrored else (lambda a: a)
    for i in range(2):
        _write(root / "data", f"item_{i}.png", flip(_asymmetric(i)))
        (root / "data" / f"item_{i}.txt").write_text(f"a test picture number {i}", encoding="utf-8")
        _write(root / "masks", f"item_{i}.png", flip(_mask(3 + 7 * i)))
    return root


def test_scan_dataset_attaches_masks_and_refuses_what_it_cannot_do(tmp_path):
    root = _dataset(tmp_path)
    spec = scan_dataset(root / "data", SIZE, flip="random", mask="folder", mask_folder=root / "masks")
    assert [Path(e.mask).name for e in spec.entries] == ["item_0.png", "item_1.png"]
    assert "horizontal flip" in spec.report() and "loss masks from" in spec.report()
    (root / "masks" / "item_1.png").rename(root / "masks" / "other.png")
    with pytest.raises(DatasetError, match=r"(?s)item_1\.png \(needs item_1\.png\).*other\.png"):
        scan_dataset(root / "data", SIZE, mask="folder", mask_folder=root / "masks")
    with pytest.raises(DatasetError, match="mask_folder is empty"):
        scan_dataset(root / "data", SIZE, mask="folder")
    with pytest.raises(DatasetError, match="flip cannot be used with a control folder"):
        scan_dataset(root / "data", SIZE, flip="random", control_folder=root / "masks")
    with pytest.raises(DatasetError, match="is the dataset folder"):
        scan_dataset(root / "data", SIZE, mask="folder", mask_folder=root / "data")


def test_dataset_node_takes_flip_and_masks_and_reruns_when_a_mask_changes(comfy_root, tmp_path):
    from pipetrainer.nodes.dataset import PipeTrainerDataset

    root = _dataset(tmp_path)
    data, masks = str(root / "data"), str(root / "masks")
    out = PipeTrainerDataset.execute(data, SIZE, 1, "error", flip="random", mask="folder", mask_folder=masks)
    assert out.result[0].flip == "random" and Path(out.result[0].entries[0].mask).name == "item_0.png"
    before = PipeTrainerDataset.fingerprint_inputs(data, mask_folder=masks)
    _write(root / "masks", "item_0.png", np.zeros((SIZE, SIZE), np.uint8) + 7)
    assert PipeTrainerDataset.fingerprint_inputs(data, mask_folder=masks) != before
    (root / "masks" / "item_0.png").unlink()
    with pytest.raises(ValueError, match=r"item_0\.png"):
        PipeTrainerDataset.execute(data, SIZE, 1, "error", mask="folder", mask_folder=masks)


# ---- caching with the real VAE ----------------------------------------------------------------------
def _cache(root: Path, encoders, cache: Path | None = None, **options):
    vae, clip = encoders
    return build_cache(scan_dataset(root / "data", SIZE, **options), vae, clip, cache or root / "cache")


def _entry(result, name: str) -> dict[str, torch.Tensor]:
    item = next(i for i in result.items if Path(i.source).name == name)
    return read_entries(item.latent_file, [item.latent_key])[item.latent_key]


def _pixels(path: Path, mirror: bool) -> torch.Tensor:
    with Image.open(path) as img:
        img = ImageOps.mirror(img.convert("RGB")) if mirror else img.convert("RGB")
        return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]


FOLDER = {"flip": "random", "mask": "folder"}


@pytest.fixture(scope="module")
def cached(encoders, tmp_path_factory):
    """The dataset cached plainly first, then with flip and folder masks (the same cache folder)."""
    root = _dataset(tmp_path_factory.mktemp("flipmask"))
    plain = _cache(root, encoders)
    flipped = _cache(root, encoders, **FOLDER, mask_folder=root / "masks")
    return root, plain, flipped


def test_the_flipped_latent_is_the_vae_encode_of_the_mirrored_image(cached, encoders):
    vae, _ = encoders
    root, plain, result = cached
    for name in ("item_0.png", "item_1.png"):
        entry = _entry(result, name)
        mirrored = vae.encode(_pixels(root / "data" / name, mirror=True)).float()[0]
        torch.testing.assert_close(entry[FLIPPED_LATENT].float(), mirrored, rtol=0, atol=1e-6)
        assert not torch.allclose(entry[FLIPPED_LATENT].float(), entry["latent"].float().flip(-1), atol=1e-3)
        torch.testing.assert_close(entry["latent"], _entry(plain, name)["latent"], rtol=0, atol=0)


def test_the_cached_mask_is_area_averaged_to_the_latent_grid(cached):
    root, _, result = cached
    entry = _entry(result, "item_1.png")
    assert entry[LOSS_MASK].shape == (1, 8, 8) and entry["latent"].shape[-2:] == (8, 8)
    pixels = torch.from_numpy(_mask(10).astype(np.float32) / 255.0)
    oracle = pixels.reshape(8, 8, 8, 8).mean(dim=(1, 3))  # mean of each 8x8 pixel cell
    torch.testing.assert_close(entry[LOSS_MASK][0], oracle, rtol=0, atol=1e-6)
    assert entry[LOSS_MASK][0, :, :2].abs().max() == 0 and 0 < entry[LOSS_MASK][0, 0, 2] < 1  # black strip, edge


def test_the_flipped_mask_matches_the_mask_of_the_mirrored_item(cached, encoders, tmp_path):
    """A dataset of the mirrored images and mirrored masks, cached from scratch, holds exactly the first
    dataset's flipped variants: its latent is the flipped latent, its mask the flip of the mask grid (up
    to the order in which area averaging sums a cell)."""
    root, _, result = cached
    mirror = _dataset(tmp_path, mirrored=True)
    other = _cache(mirror, encoders, root / "cache", mask="folder", mask_folder=mirror / "masks")  # captions reused
    for name in ("item_0.png", "item_1.png"):
        a, b = _entry(result, name), _entry(other, name)
        torch.testing.assert_close(b["latent"], a[FLIPPED_LATENT], rtol=0, atol=0)
        torch.testing.assert_close(b[LOSS_MASK], a[LOSS_MASK].flip(-1), rtol=0, atol=1e-6)
        example = load_examples([next(i for i in result.items if Path(i.source).name == name)], text=False)[0]
        torch.testing.assert_close(example.flipped, a[FLIPPED_LATENT], rtol=0, atol=0)
        assert example.mask is not None and not example.extras  # variants, not family extras


def test_turning_flip_and_masks_on_reencodes_with_a_reason_and_off_reuses_the_old_entries(cached, encoders):
    root, plain, result = cached
    assert result.report.reencoded_kinds == {"latent": 2} and result.report.reused["text"] == 2
    assert sorted(result.report.reencoded) == [
        f"item_{i}.png latent: flip variant changed (none -> horizontal); loss mask changed (none -> folder)"
        for i in range(2)]
    again = _cache(root, encoders)  # options off: the old keys, found in the index
    assert again.report.encoded == {} and [i.latent_key for i in again.items] == [i.latent_key for i in plain.items]
    assert FLIPPED_LATENT not in _entry(again, "item_0.png")


def test_a_changed_mask_file_reencodes_exactly_its_item(cached, encoders, tmp_path):
    root, _, _ = cached
    work = tmp_path / "work"
    for part in ("data", "masks", "cache"):
        shutil.copytree(root / part, work / part)
    options = dict(FOLDER, mask_folder=work / "masks")
    assert _cache(work, encoders, **options).report.encoded == {}
    _write(work / "masks", "item_0.png", np.full((SIZE, SIZE), 255, np.uint8))
    r = _cache(work, encoders, **options)
    assert r.report.encoded == {"latent": 1} and r.report.reused == {"latent": 1, "text": 2}
    assert r.report.reencoded == ["item_0.png latent: loss mask changed (file changed)"]
    assert torch.equal(_entry(r, "item_0.png")[LOSS_MASK], torch.ones(1, 8, 8))


def test_alpha_masks_come_from_the_alpha_channel_and_images_without_alpha_are_skipped(cached, encoders, tmp_path):
    rgba = np.concatenate([_asymmetric(4), np.full((SIZE, SIZE, 1), 255, np.uint8)], axis=2)
    rgba[:, : SIZE // 2, 3] = 0  # the left half transparent
    _write(tmp_path / "data", "clear.png", rgba)
    _write(tmp_path / "data", "opaque.png", _asymmetric(5))
    for i, name in enumerate(("clear", "opaque")):  # the captions of `cached`: their embeddings are reused
        (tmp_path / "data" / f"{name}.txt").write_text(f"a test picture number {i}", encoding="utf-8")
    r = _cache(tmp_path, encoders, cached[0] / "cache", mask="alpha")
    mask = _entry(r, "clear.png")[LOSS_MASK]
    assert torch.equal(mask, torch.cat([torch.zeros(1, 8, 4), torch.ones(1, 8, 4)], dim=2))
    assert [Path(i.source).name for i in r.items] == ["clear.png"]
    assert len(r.report.skipped) == 1 and r.report.skipped[0].startswith("opaque.png:")
    assert "no alpha channel" in r.report.skipped[0]


def test_a_video_clip_caches_one_area_averaged_mask_and_a_mirrored_clip_latent(encoders, tmp_path):
    """A clip with a mask image named like it, cached with the real (narrow) Wan 2.1 VAE: one
    ``[1, h, w]`` mask on the latent grid (the mask image, at the bucket size, averaged over each 8 x 8
    cell), and a mirrored latent of the clip's shape, unlike the clip's own (the picture is asymmetric)."""
    import av
    import torch.nn.functional as F
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.data.dataset import BucketSettings

    width, height = 48, 16  # the 3:1 bucket at resolution 32 with ratios up to 3: no resize, no crop
    data, masks = tmp_path / "data", tmp_path / "masks"
    data.mkdir()
    with av.open(str(data / "clip.mp4"), "w") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(9):
            img = np.zeros((height, width, 3), np.uint8)
            img[:, : 8 + 2 * i] = 220  # a bar growing from the left edge
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    (data / "clip.txt").write_text("a growing bar", encoding="utf-8")
    mask = np.full((height, width), 255, np.uint8)
    mask[:, :20] = 0
    mask[:4, 30:] = 64
    _write(masks, "clip.png", mask)
    settings = BucketSettings(resolutions=(32,), min_ratio=1 / 3, max_ratio=3.0, count=3, max_frames=9, fps=8.0)
    spec = scan_dataset(data, 32, buckets=settings, flip="random", mask="folder", mask_folder=masks)
    result = build_cache(spec, tiny_wan21_vae(), encoders[1], tmp_path / "cache")
    (item,) = result.items
    assert item.bucket == f"{width}x{height}x9"
    entry = read_entries(item.latent_file, [item.latent_key])[item.latent_key]
    latent, flipped, cached_mask = entry["latent"], entry[FLIPPED_LATENT], entry[LOSS_MASK]
    assert latent.shape == (16, 3, height // 8, width // 8) and flipped.shape == latent.shape
    expected = F.avg_pool2d(torch.from_numpy(mask).float()[None, None] / 255.0, 8)[0]
    torch.testing.assert_close(cached_mask, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(latent, flipped, atol=1e-3)


# ---- training: masked loss and flip choices ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_sd3(fixture_paths):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model


def _example(seed: int, mask: torch.Tensor | None = None, flipped: bool = False, text: bool = True) -> Example:
    g = torch.Generator().manual_seed(seed)
    latent, cond, pooled = torch.randn(16, 8, 8, generator=g), torch.randn(5, 768, generator=g), torch.randn(768, generator=g)
    other = torch.randn(16, 8, 8, generator=g) if flipped else None
    return Example(latent, cond if text else None, pooled if text else None, flipped=other, mask=mask)


def _batches(model, examples, seed: int = 11, batch_size: int = 2) -> MicroBatches:
    adapter = adapter_for("SD3")
    return MicroBatches(examples, batch_size, seed, model, adapter, TimestepSpec(), torch.device("cpu"),
                        family_options=adapter.options_type())


def _rows(batches: MicroBatches, micro: int) -> list[int]:
    return batches._indices(micro)


def test_an_all_black_mask_gives_zero_loss_to_its_item(tiny_sd3):
    """The loss of a batch with a fully masked item equals the other item's loss alone."""
    examples = [_example(1, mask=torch.zeros(1, 8, 8)), _example(2)]
    batches = _batches(tiny_sd3, examples)
    for micro in range(3):
        _, labels = batches.build(micro)
        target, weight = labels
        prediction = torch.randn(target.shape, generator=torch.Generator().manual_seed(micro))
        other = _rows(batches, micro).index(1)
        alone = (prediction[other] - target[other]).pow(2).mean()
        torch.testing.assert_close(mse_loss(prediction, labels), alone, rtol=1e-6, atol=0)
        assert weight.shape == (2, 1, 8, 8)


def test_a_half_mask_gives_the_mse_over_the_white_half_only(tiny_sd3):
    half = torch.cat([torch.ones(1, 8, 4), torch.zeros(1, 8, 4)], dim=2)
    batches = _batches(tiny_sd3, [_example(3, mask=half), _example(4, mask=half)])
    _, (target, weight) = batches.build(0)
    prediction = torch.randn(target.shape, generator=torch.Generator().manual_seed(9))
    expected = (prediction[..., :4] - target[..., :4]).pow(2).mean()
    torch.testing.assert_close(mse_loss(prediction, (target, weight)), expected, rtol=1e-6, atol=0)
    unmasked = _batches(tiny_sd3, [_example(3), _example(4)]).build(0)[1]
    assert torch.equal(unmasked, target)  # masks change the weight, never the noise or the target


def test_flip_choices_are_about_half_deterministic_and_alike_on_first_and_last_stage(tiny_sd3):
    examples = [_example(s, mask=torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(s)), flipped=True)
                for s in (5, 6)]
    last = [Example(e.latent, None, None, flipped=e.flipped, mask=e.mask) for e in examples]
    first, again, last_stage = _batches(tiny_sd3, examples), _batches(tiny_sd3, examples), _batches(tiny_sd3, last)
    flips = 0
    for micro in range(150):
        batch = first.flipped([examples[i] for i in _rows(first, micro)], micro)
        for row, i in enumerate(_rows(first, micro)):
            chosen = batch[row]
            is_flipped = chosen.latent is examples[i].flipped
            assert is_flipped or chosen.latent is examples[i].latent
            assert torch.equal(chosen.mask, examples[i].mask.flip(-1) if is_flipped else examples[i].mask)
            flips += is_flipped
        if micro < 12:
            (_, a), (_, b), (_, c) = first.build(micro), again.build(micro), last_stage.build(micro)
            assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c, strict=True))
    assert 0.4 < flips / 300 < 0.6, flips


def test_flip_leaves_the_noise_stream_as_it_was(tiny_sd3):
    """Examples whose flipped latent is their own latent build exactly what examples without flip build."""
    plain = [_example(7), _example(8)]
    same = [Example(e.latent, e.cond, e.pooled, flipped=e.latent.clone()) for e in plain]
    for micro in range(4):
        (ia, ta), (ib, tb) = _batches(tiny_sd3, plain).build(micro), _batches(tiny_sd3, same).build(micro)
        assert torch.equal(ta, tb) and all(torch.equal(x, y) for x, y in zip(ia, ib, strict=True))


def test_a_video_items_mask_covers_every_frame_and_multiplies_the_familys_mask():
    """One mask per clip: ``[1, h, w]`` broadcast over channels and latent frames, times the family's
    own loss mask (e.g. a clean first frame left out)."""
    examples = [_example(1, mask=torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(1))), _example(2)]
    batches = MicroBatches(examples, 2, 0, None, None, TimestepSpec(), torch.device("cpu"))
    family = torch.ones(16, 3, 8, 8)
    family[:, 0] = 0
    weight = batches.loss_weight(examples, torch.zeros(2, 16, 3, 8, 8), family)
    assert weight.shape == (2, 16, 3, 8, 8)
    for f in range(3):
        torch.testing.assert_close(weight[0, 5, f], examples[0].mask[0] * float(f > 0), rtol=0, atol=0)
        torch.testing.assert_close(weight[1, 5, f], torch.full((8, 8), float(f > 0)), rtol=0, atol=0)
    assert batches.loss_weight([_example(3), _example(4)], torch.zeros(2, 16, 8, 8), None) is None


def test_flip_is_refused_with_start_image_conditioning(encoders, tmp_path):
    """The start image (image-to-video) would need the same mirror as its latent: refused, not half-flipped."""
    from pipetrainer.training.cache.start_image import StartImage

    vae, clip = encoders
    root = _dataset(tmp_path)
    with pytest.raises(ValueError, match="flip cannot be combined with start-image conditioning"):
        build_cache(scan_dataset(root / "data", SIZE, flip="random"), vae, clip, root / "cache",
                    start_image=StartImage("first_frame"))


# ---- through the real process tree ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_run_with_flip_and_masks_is_alike_on_one_and_two_stages(cached, fixture_paths, comfy_root, tmp_path):
    """The first stage picks each item's latent (flipped or not), the last its mask and target: a stage
    that chose differently would give a 2-stage run another loss than the 1-stage run. The masked,
    flipped cache must also train differently from the plain one (the variants reach the ranks)."""
    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.training.process.rank import EXIT_OK

    _, plain, variants = cached
    runs = {}
    for name, result, stages in (("plain", plain, 1), ("variants", variants, 1), ("variants2", variants, 2)):
        spec = make_spec(fixture_paths.mmdit, result.items, tmp_path / name, comfy_root, steps=3,
                         batch_size=2, pipeline_stages=stages, gradient_checkpointing=False)
        code, events = run_training(spec)
        assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
        runs[name] = losses(events)
    assert len(runs["variants"]) == 3 and runs["variants"] == runs["variants2"]
    assert runs["variants"] != runs["plain"]
