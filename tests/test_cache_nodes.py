"""The Dataset and Cache nodes on the real ComfyUI server: buckets from the node inputs, a report shown
in the UI that says what was cached, reused and skipped, and input errors caught before running."""

from __future__ import annotations

import re
import shutil
import urllib.error
import uuid

import pytest
from PIL import Image
from pipetrainer.devkit.host import history_error


def _prompt(folder: str, **dataset) -> dict:
    return {
        "2": {"class_type": "CLIPLoader",
              "inputs": {"clip_name": "pipetrainer-tiny-clip-l.safetensors", "type": "stable_diffusion"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": "pipetrainer-tiny-taesd16.safetensors"}},
        "4": {"class_type": "PipeTrainerDataset",
              "inputs": {"folder": folder, "resolution": 64, "repeats": 1, "missing_caption": "error", **dataset}},
        "5": {"class_type": "PipeTrainerCache", "inputs": {"dataset": ["4", 0], "vae": ["3", 0], "clip": ["2", 0]}},
        # The Cache node is not an output node: caching alone runs through a stock output node.
        "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 1]}},
    }


@pytest.mark.slow
def test_cache_node_buckets_reports_and_skips(server, comfy_root, fixture_paths):
    folder = f"cache_node_{uuid.uuid4().hex[:8]}"
    data = comfy_root / "input" / folder
    shutil.copytree(fixture_paths.dataset, data)
    tag = int(folder[-8:], 16)  # the cache folder is shared by every run: make this image and caption new
    Image.new("RGB", (128, 64), (tag % 256, (tag >> 8) % 256, (tag >> 16) % 256)).save(data / "wide.png")
    (data / "wide.txt").write_text(f"a wide picture {folder}", encoding="utf-8")
    (data / "broken.jpg").write_bytes(b"not a jpeg at all")
    (data / "broken.txt").write_text("broken", encoding="utf-8")
    try:
        entry = server.wait(server.queue(_prompt(folder, aspect_buckets=3, min_ratio=0.5, max_ratio=2.0)), 600)
        assert history_error(entry) is None, server.log_tail()
        report = "\n".join(entry["outputs"]["5"]["text"])
        counts = [int(n) for n in re.findall(r"(\d+) (?:latents|texts)", report.splitlines()[0])]
        cached, reused = counts[0:2], counts[2:4]  # the demo images may be cached by earlier runs
        assert cached[0] >= 1 and cached[1] >= 1 and [c + r for c, r in zip(cached, reused, strict=True)] == [5, 5]
        assert "buckets: 64x64x1 (4), 96x48x1 (1)" in report
        assert "skipped broken.jpg: cannot read it (not an image Pillow can read" in report
        # found by the Dataset node's header check, which says so on the node too
        shown = "\n".join(entry["outputs"]["4"]["text"])
        assert "skipped 1 that cannot be read: broken.jpg: not an image Pillow can read" in shown, shown
        again = server.wait(server.queue(_prompt(folder, aspect_buckets=3, min_ratio=0.5, max_ratio=2.0,
                                                 extra_resolutions="")), 600)
        assert "\n".join(again["outputs"]["5"]["text"]).startswith("cached 0 latents, 0 texts; reused 5 latents")
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_dataset_node_rejects_bad_extra_resolutions(server):
    with pytest.raises(urllib.error.HTTPError) as info:
        server.queue(_prompt("pipetrainer_demo", extra_resolutions="256, big"))
    assert b"whole numbers" in info.value.read()
