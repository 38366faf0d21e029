"""Loading helpers the family rows share (this module defines no rows)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROWS: list = []


@contextmanager
def collect_warnings() -> Iterator[list[str]]:
    """The messages of the warnings logged inside the block."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger().removeHandler(handler)


def load_detected(path: Path):
    """A ModelPatcher from ComfyUI's stock diffusion-model loader; fails on missing/unexpected keys."""
    import comfy.sd

    with collect_warnings() as warnings:
        patcher = comfy.sd.load_diffusion_model(str(path))
    assert not [w for w in warnings if "missing" in w or "unexpected" in w], warnings
    return patcher


def built_fixture(file_name: str, build: Callable[[Path], Path]) -> Callable[[Path, object], Path]:
    """A ``model_path`` that builds ``file_name`` in the host's diffusion_models once (atomically)."""

    def model_path(comfy_root: Path, fixture_paths) -> Path:
        from pipetrainer.devkit.fixtures import _build_atomically

        path = comfy_root / "models" / "diffusion_models" / file_name
        if not path.exists():
            _build_atomically(path, build)
        return path

    return model_path


def from_config(config_class, unet_config: dict, seed: int):
    """A float32 ModelPatcher on the CPU from one of ComfyUI's config classes (``comfy.supported_models``),
    with seeded weights of a trained network's scale (no detection, no file)."""
    import comfy.model_patcher
    from pipetrainer.devkit.fixtures import _randomize_scaled

    config = config_class(unet_config)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    state = model.diffusion_model.state_dict()
    model.diffusion_model.load_state_dict(_randomize_scaled({k: v.float() for k, v in state.items()}, seed))
    model.diffusion_model.float()
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def cache_items(row, model, folder: Path, count: int = 2) -> list:
    """Plain-file cache items (no index) with seeded latents, conds and extras of the row's shapes."""
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import CacheItem
    from safetensors.torch import save_file

    adapter = adapter_for(row.family)
    context, pooled_dim = adapter.conditioning_dims(model.diffusion_model)
    sources = {name: spec.source for name, spec in adapter.extras(model.diffusion_model).items()}
    g = torch.Generator().manual_seed(7)
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(count):
        latent, text = folder / f"{i}.latent.safetensors", folder / f"{i}.text.safetensors"
        x0 = torch.randn(*row.latent, generator=g)
        entries = {"latent": {"latent": x0}, "text": {"cond": torch.randn(row.tokens + i, context, generator=g)}}
        if pooled_dim:
            entries["text"]["pooled"] = torch.randn(pooled_dim, generator=g)
        for name, value in row.extras(model, model.process_latent_in(x0[None]), g).items():
            entries[sources[name]][name] = value[0].contiguous()
        save_file(entries["latent"], str(latent))
        save_file(entries["text"], str(text))
        items.append(CacheItem(str(latent), str(text), f"item{i}.png", f"caption {i}"))
    return items


def joined_streams(adapter, model, raw: torch.Tensor, x0: torch.Tensor, extras: dict) -> tuple[torch.Tensor, tuple]:
    """``(x0, ())`` (``x0``: the processed ``raw``), or for a family whose model takes several latents as one
    (``ExtraSpec.joins_latent``: LTX-2's and MiniMax-H3's audio) ``raw`` packed with those extras and processed as the
    trainer does it, and the streams' shapes."""
    from pipetrainer.training.data.joint_latent import join_latent, joined_names

    names = joined_names(adapter.extras(model.diffusion_model))
    if not names:
        return x0, ()
    return join_latent(model, raw, [extras[n] for n in names])


def require_model_class(name: str, added: str = "after ComfyUI 0.3.75") -> None:
    """Skip the calling test when this ComfyUI has no ``comfy.model_base.<name>`` (a family the host lacks),
    naming the missing class, as the suite does for every family newer than a host."""
    import comfy.model_base
    import pytest

    if not hasattr(comfy.model_base, name):
        pytest.skip(f"this ComfyUI has no comfy.model_base.{name} (added {added})")
