"""A cache with several aspect buckets trains through the real pipeline engine (one bucket per micro-batch)."""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
from PIL import Image
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import BucketSettings, scan_dataset


def _helpers():
    spec = importlib.util.spec_from_file_location("pipetrainer_test_helpers", Path(__file__).with_name("helpers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_multi_bucket_cache_trains(encoders, fixture_paths, comfy_root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(fixture_paths.dataset, data)
    for i, size in enumerate([(128, 64), (96, 48)]):
        Image.new("RGB", size, (40 * i, 120, 200)).save(data / f"wide_{i}.png")
        (data / f"wide_{i}.txt").write_text(f"a wide blue picture {i}", encoding="utf-8")
    vae, clip = encoders
    settings = BucketSettings(resolutions=(64,), min_ratio=0.5, max_ratio=2.0, count=3)
    cache = build_cache(scan_dataset(data, 64, buckets=settings), vae, clip, tmp_path / "cache")
    assert {i.bucket for i in cache.items} == {"64x64x1", "96x48x1"}
    h = _helpers()
    spec = h.make_spec(fixture_paths.mmdit, cache.items, tmp_path / "run", comfy_root, steps=4, batch_size=2)
    rc, events = h.run_training(spec)
    assert rc == 0, [e for e in events if e["type"] == "error"]
    losses = h.losses(events)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
