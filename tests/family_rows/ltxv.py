"""LTX-Video: the detected tiny fixture (devkit/fixtures_ltxv.py), with a text mask as ComfyUI's T5 gives it."""

from __future__ import annotations

import torch

from . import Row
from .common import built_fixture, load_detected


def ltxv_path(comfy_root, fixture_paths):
    from pipetrainer.devkit.fixtures_ltxv import LTXV_FILE, build_tiny_ltxv

    return built_fixture(LTXV_FILE, build_tiny_ltxv)(comfy_root, fixture_paths)


def ltxv_kwargs(cond, pooled, options, extras):
    """What ``LTXV.extra_conds`` hands the model: the text mask (None without one) and the frame rate."""
    return {"attention_mask": extras.get("attention_mask"), "frame_rate": options.frame_rate}


def _extras(model, x0, g):
    """A text mask that leaves the last 3 of the 9 tokens out (padding), as the T5 encoder's mask does."""
    mask = torch.ones(1, 9, dtype=torch.int64)
    mask[:, -3:] = 0
    return {"attention_mask": mask}


ROWS = [
    Row("LTXV", "detected file, 0.46 M (build_tiny_ltxv); 128 channels, 32 heads of width 2, 2 blocks",
        load=lambda comfy_root, fixture_paths: load_detected(ltxv_path(comfy_root, fixture_paths)),
        latent=(128, 3, 5, 7), tokens=9, model_path=ltxv_path, comfy_kwargs=ltxv_kwargs, extras=_extras),
]
