"""HunyuanVideo text-to-video: the detected tiny fixture (devkit/fixtures_video.py)."""

from __future__ import annotations

import torch

from . import Row
from .common import built_fixture, load_detected


def _path(comfy_root, fixture_paths):
    from pipetrainer.devkit.fixtures_video import HUNYUAN_VIDEO_FILE, build_tiny_hunyuan_video

    return built_fixture(HUNYUAN_VIDEO_FILE, build_tiny_hunyuan_video)(comfy_root, fixture_paths)


def _kwargs(cond, pooled, options, extras):
    """What ``HunyuanVideo.extra_conds`` hands the model: pooled ``y``, ``guidance`` (and a text mask)."""
    out = {"y": pooled, "guidance": torch.full((cond.shape[0],), options.guidance)}
    if "attention_mask" in extras:
        out["attention_mask"] = extras["attention_mask"]
    return out


def _extras(model, x0, g):
    """A text mask that leaves the last 2 of the 9 tokens out (padding), as the llama encoder's mask does."""
    mask = torch.ones(1, 9, dtype=torch.int64)
    mask[:, -2:] = 0
    return {"attention_mask": mask}


ROWS = [
    Row("HunyuanVideo", "detected file, 1.83 M (build_tiny_hunyuan_video)",
        load=lambda comfy_root, fixture_paths: load_detected(_path(comfy_root, fixture_paths)),
        latent=(16, 3, 6, 10), tokens=9, model_path=_path, comfy_kwargs=_kwargs, extras=_extras),
]
