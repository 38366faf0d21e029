"""Bucket arithmetic, dataset scanning with videos and bucket settings, one-bucket micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from pipetrainer.training.cache.buckets import (
    Bucket,
    crop_fraction,
    frame_bucket,
    nearest_bucket,
    plan_buckets,
)
from pipetrainer.training.data.dataset import BucketSettings, DatasetError, scan_dataset
from pipetrainer.training.data.micro_batches import Example, MicroBatches
from pipetrainer.training.spec.options import TimestepSpec


def test_buckets_are_log_spaced_and_rounded_to_the_multiple():
    plan = plan_buckets(BucketSettings(resolutions=(512,), min_ratio=0.25, max_ratio=4.0, count=5, multiple=64))
    buckets = plan.by_resolution[512]
    assert [b.name for b in buckets] == ["256x1024x1", "384x704x1", "512x512x1", "704x384x1", "1024x256x1"]
    ratios = [b.width / b.height for b in buckets]
    steps = [math.log(b / a) for a, b in zip(ratios, ratios[1:], strict=False)]
    assert max(steps) - min(steps) < 0.2  # evenly spaced in log space, up to rounding to 64 px
    assert all(b.width % 64 == 0 and b.height % 64 == 0 for b in buckets)


def test_rounding_that_merges_or_distorts_buckets_is_reported():
    plan = plan_buckets(BucketSettings(resolutions=(32,), min_ratio=0.8, max_ratio=1.25, count=5, multiple=16))
    assert [b.name for b in plan.by_resolution[32]] == ["32x32x1"]
    assert sum("merged" in n for n in plan.notes) == 4
    plan = plan_buckets(BucketSettings(resolutions=(32,), min_ratio=0.5, max_ratio=2.0, count=3, multiple=16))
    assert any("48x16" in n and "raise the resolution" in n for n in plan.notes)


def test_nearest_bucket_frames_and_crop():
    buckets = (Bucket(48, 96), Bucket(64, 64), Bucket(96, 48))
    assert nearest_bucket(1920, 1080, buckets) == Bucket(96, 48)
    assert nearest_bucket(1000, 1100, buckets) == Bucket(64, 64)
    assert [frame_bucket(n, 33) for n in (1, 4, 5, 8, 9, 40)] == [1, 1, 5, 5, 9, 33]
    assert frame_bucket(100, 12) == 9
    assert crop_fraction(100, 100, Bucket(64, 64)) == 0.0
    assert crop_fraction(200, 100, Bucket(64, 64)) == pytest.approx(0.5)


def test_invalid_bucket_settings_name_the_fix(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "a.txt").write_text("a", encoding="utf-8")
    bad = BucketSettings(resolutions=(8,), min_ratio=2.0, max_ratio=1.5, count=0)
    with pytest.raises(DatasetError) as info:
        scan_dataset(tmp_path, 8, buckets=bad)
    for fragment in ("smaller than the bucket multiple", "min_ratio", "count must be at least 1"):
        assert fragment in str(info.value)


def test_scan_lists_videos_and_reports_buckets(tmp_path):
    import shutil

    from pipetrainer.tests.test_dataset_check import _image, _video

    _image(tmp_path / "a.png", "PNG", caption="caption a.png")
    _video(tmp_path / "b.mp4")
    shutil.copyfile(tmp_path / "b.mp4", tmp_path / "c.webm")  # PyAV reads the container, whatever the name
    (tmp_path / "c.txt").write_text("caption c.webm", encoding="utf-8")
    spec = scan_dataset(tmp_path, 64, buckets=BucketSettings((64, 128), 0.5, 2.0, 3))
    assert [e.is_video for e in spec.entries] == [False, True, True]
    report = spec.report()
    assert "1 images and 2 videos" in report and "64px, 128px" in report and "3 aspect buckets" in report
    assert scan_dataset(tmp_path, 64).bucket_settings == BucketSettings(resolutions=(64,))


def _examples(shapes: list[tuple[int, int]]) -> list[Example]:
    return [Example(torch.zeros(4, h, w), torch.zeros(3, 8), None) for h, w in shapes]


def test_micro_batches_draw_from_one_bucket_deterministically():
    examples = _examples([(4, 4)] * 5 + [(2, 6)] * 3 + [(6, 2)] * 2)
    batches = MicroBatches(examples, batch_size=2, seed=3, model=None, adapter=None,
                           timesteps=TimestepSpec(), device=torch.device("cpu"))
    drawn = [batches._indices(m) for m in range(30)]
    for idx in drawn:
        assert len({examples[i].shape_key for i in idx}) == 1
    per_epoch = 3 + 2 + 1
    first_epoch = [i for idx in drawn[:per_epoch] for i in idx]
    assert sorted(set(first_epoch)) == list(range(10))  # every item in every epoch
    assert len(first_epoch) == 12  # the two odd buckets topped up with one of their own items each
    again = MicroBatches(examples, 2, 3, None, None, TimestepSpec(), torch.device("cpu"))
    assert [again._indices(m) for m in (29, 7, 0)] == [drawn[29], drawn[7], drawn[0]]  # resume-exact
    replicas = [MicroBatches(examples, 2, 3, None, None, TimestepSpec(), torch.device("cpu"), replica=r, replicas=2)
                for r in range(2)]
    assert [replicas[m % 2]._indices(m // 2) for m in range(12)] == drawn[:12]


def test_single_bucket_keeps_the_plain_epoch_order():
    examples = _examples([(4, 4)] * 5)
    batches = MicroBatches(examples, 2, 1, None, None, TimestepSpec(), torch.device("cpu"))
    flat = [i for m in range(5) for i in batches._indices(m)]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))


def test_folder_fingerprint_follows_file_changes(tmp_path):
    from pipetrainer.training.data.dataset import folder_fingerprint

    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "a.txt").write_text("one", encoding="utf-8")
    first = folder_fingerprint(tmp_path)
    assert folder_fingerprint(tmp_path) == first
    (tmp_path / "a.txt").write_text("a longer caption", encoding="utf-8")
    assert folder_fingerprint(tmp_path) != first
