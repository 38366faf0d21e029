"""Wan 2.1 / 2.2 text-to-video: the detected tiny fixture."""

from __future__ import annotations

from . import Row
from .common import built_fixture, load_detected


def _path(comfy_root, fixture_paths):
    from pipetrainer.devkit.fixtures import WAN_T2V_FILE, build_tiny_wan_t2v

    return built_fixture(WAN_T2V_FILE, build_tiny_wan_t2v)(comfy_root, fixture_paths)


ROWS = [
    Row("Wan", "detected file, 1.1 M (build_tiny_wan_t2v)",
        load=lambda comfy_root, fixture_paths: load_detected(_path(comfy_root, fixture_paths)),
        latent=(16, 3, 6, 10), tokens=9, model_path=_path),
]
