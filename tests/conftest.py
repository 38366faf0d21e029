"""Shared fixtures: the pack imported as ``pipetrainer``, the real ComfyUI host, tiny models, a server.

Everything is real: ComfyUI from the pinned host, DeepSpeed on CPU ranks over gloo, PEFT, safetensors.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

PACK_DIR = Path(__file__).resolve().parent.parent


def _import_pack():
    spec = importlib.util.spec_from_file_location("_pipetrainer_entry", PACK_DIR / "training" / "process" / "entry.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry.import_pack()


_import_pack()

from pipetrainer.devkit.fixtures import FixturePaths, ensure_fixtures  # noqa: E402
from pipetrainer.devkit.host import ComfyServer, ensure_host  # noqa: E402
from pipetrainer.training.model.comfy_env import enable_comfy_training_mode, use_comfyui  # noqa: E402


@pytest.fixture(scope="session")
def comfy_root() -> Path:
    """The ComfyUI host, importable here, in training mode like the training process.

    Tests build stage layers and back-propagate in this process: on current ComfyUI that needs
    ``comfy.model_management.in_training`` (see :func:`enable_comfy_training_mode`). ComfyUI's own
    forwards in these tests then take the same (plain PyTorch) RoPE path as the stage layers.
    """
    root = ensure_host()
    use_comfyui(root, "cpu")
    enable_comfy_training_mode()
    return root


@pytest.fixture(scope="session")
def fixture_paths(comfy_root) -> FixturePaths:
    return ensure_fixtures(comfy_root)


@pytest.fixture(scope="session")
def flux_path(comfy_root) -> Path:
    ensure_fixtures(comfy_root, flux=True)
    return comfy_root / "models" / "diffusion_models" / "pipetrainer-min-flux.safetensors"


@pytest.fixture(scope="session")
def balanced_flux_path(comfy_root) -> Path:
    """Flux-min with two equal pipeline halves (devkit.fixtures.build_balanced_flux)."""
    from pipetrainer.devkit.fixtures import FLUX_BALANCED_FILE

    ensure_fixtures(comfy_root, balanced_flux=True)
    return comfy_root / "models" / "diffusion_models" / FLUX_BALANCED_FILE


@pytest.fixture(scope="session")
def balanced_flux_one_stage(balanced_flux_path, demo_cache, comfy_root, tmp_path_factory):
    """Three steps of the balanced Flux-min, one pipeline stage, in the real process tree: ``(spec, events)``.
    Shared by the Flux training test and the 2-stage memory test (its oracle)."""
    from pipetrainer.tests.helpers import train_min_flux

    return train_min_flux(balanced_flux_path, demo_cache.items, tmp_path_factory.mktemp("flux1") / "run",
                          comfy_root, 1)


@pytest.fixture(scope="session")
def server(comfy_root, fixture_paths, tmp_path_factory):
    """One real ComfyUI server with this pack, shared by the server tests."""
    log = tmp_path_factory.mktemp("server") / "comfyui.log"
    srv = ComfyServer(comfy_root, log).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def encoders(comfy_root, fixture_paths):
    """The tiny VAE and CLIP-L loaded by ComfyUI's own loaders, in this process."""
    import comfy.sd
    import comfy.utils

    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixture_paths.vae)))
    clip = comfy.sd.load_clip([str(fixture_paths.clip)], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    return vae, clip


@pytest.fixture(scope="session")
def demo_cache(encoders, fixture_paths, tmp_path_factory):
    """The demo dataset cached at 64 px (a CacheResult)."""
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    vae, clip = encoders
    dataset = scan_dataset(fixture_paths.dataset, 64)
    return build_cache(dataset, vae, clip, tmp_path_factory.mktemp("cache"))


def pytest_report_header(config):
    """Which ComfyUI host and which Python this run tests (scripts/test.sh runs the suite on two hosts)."""
    import re
    import sys
    from importlib.metadata import PackageNotFoundError, version

    from pipetrainer.devkit.host import comfyui_root

    root = comfyui_root()
    try:
        found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (root / "comfyui_version.py").read_text())
        comfyui = found.group(1) if found else "unknown version"
    except OSError:
        comfyui = "not built yet"
    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "absent"
    return f"ComfyUI host: {comfyui} at {root} (python {sys.executable}, transformers {transformers})"


def pytest_configure(config):
    os.environ.setdefault("PIPETRAINER_THREADS", "1")
    # Runs start cold unless a test asks for pre-started trees (tests/test_warm.py builds its own pool):
    # a warm tree left by one test would otherwise import torch in the background of the next.
    os.environ.setdefault("PIPETRAINER_WARM", "0")
