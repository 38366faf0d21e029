"""SD3 (MMDiT): the detected tiny fixture."""

from __future__ import annotations

from . import Row
from .common import load_detected


def _kwargs(cond, pooled, options, extras):
    return {"y": pooled}


ROWS = [
    Row("SD3", "detected file, 9.6 M (fixture_paths.mmdit)",
        load=lambda comfy_root, fixture_paths: load_detected(fixture_paths.mmdit),
        latent=(16, 10, 6), tokens=7, comfy_kwargs=_kwargs,
        model_path=lambda comfy_root, fixture_paths: fixture_paths.mmdit),
]
