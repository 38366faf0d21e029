"""Wan 2.2 TI2V-5B, Wan 2.2 I2V A14B and Wan 2.1 I2V layouts: detected tiny files (devkit/fixtures_video.py).

The image-to-video rows feed the start-image latent (and, for 2.1, clip-vision features) as extras;
ComfyUI gets the same conditioning as its samplers do: ``c_concat`` from ComfyUI's own
``WAN21.concat_cond`` given the raw latent and the ``concat_mask`` that ``WanImageToVideo`` builds for
one start image, and ``clip_fea`` as ``WAN21.extra_conds`` passes it.
"""

from __future__ import annotations

import torch

from . import Row
from .common import built_fixture, load_detected


def _path_of(file_attr: str, builder: str):
    def model_path(comfy_root, fixture_paths):
        from pipetrainer.devkit import fixtures_video

        return built_fixture(getattr(fixtures_video, file_attr), getattr(fixtures_video, builder))(
            comfy_root, fixture_paths)

    return model_path


_TI2V = _path_of("WAN22_TI2V_FILE", "build_tiny_wan22_ti2v")
_I2V22 = _path_of("WAN22_I2V_FILE", "build_tiny_wan22_i2v")
_I2V21 = _path_of("WAN21_I2V_FILE", "build_tiny_wan21_i2v")
_LOADED: dict[str, object] = {}  # row id -> a loaded model whose concat_cond is the oracle


def _loader(model_path, key: str):
    def load(comfy_root, fixture_paths):
        patcher = load_detected(model_path(comfy_root, fixture_paths))
        _LOADED.setdefault(key, patcher.model)
        return patcher

    return load


def i2v_concat_mask(latent: torch.Tensor) -> torch.Tensor:
    """``WanImageToVideo``'s ``concat_mask`` for one start image: 0 on the first latent frame, 1 after."""
    mask = torch.ones(latent.shape[0], 1, *latent.shape[2:])
    mask[:, :, :1] = 0.0
    return mask


def _i2v_extras(clip: bool):
    def extras(model, x0, g):
        out = {"concat_latent": model.process_latent_in(torch.randn(x0.shape, generator=g))}
        if clip:
            out["clip_fea"] = torch.randn(1, 257, 1280, generator=g)  # ViT-H: 257 tokens
        return out

    return extras


def _i2v_kwargs(key: str):
    def kwargs(cond, pooled, options, extras):
        model = _LOADED[key]
        processed = extras["concat_latent"]
        raw = model.latent_format.process_out(processed)  # concat_cond applies process_latent_in itself
        c_concat = model.concat_cond(noise=torch.zeros_like(processed), concat_latent_image=raw,
                                     concat_mask=i2v_concat_mask(processed), device=torch.device("cpu"))
        out = {"c_concat": c_concat}
        if "clip_fea" in extras:
            out["clip_fea"] = extras["clip_fea"]
        return out

    return kwargs


# The process-tree check (slow, ~2 min each on 2 shared cores) runs for the 2.1 I2V row only: it carries
# every extra (concat latent, clip-vision) through cache files, data and stages; the TI2V and 2.2 I2V rows
# are detected files too (model_path left out only to keep the slow tier at one run per layout kind), and
# tests/test_wan_video.py trains the TI2V layout through the process tree with its family options.
ROWS = [
    Row("Wan", "detected file, 1.14 M (build_tiny_wan22_ti2v); 48 channels, model class WAN22",
        load=_loader(_TI2V, "Wan22-TI2V"), latent=(48, 3, 6, 10), tokens=9, id="Wan22-TI2V"),
    Row("Wan", "detected file, 1.12 M (build_tiny_wan22_i2v); in_dim 36, no clip-vision",
        load=_loader(_I2V22, "Wan22-I2V"), latent=(16, 3, 6, 10), tokens=9, id="Wan22-I2V",
        extras=_i2v_extras(clip=False), comfy_kwargs=_i2v_kwargs("Wan22-I2V")),
    Row("Wan", "detected file, 2.99 M (build_tiny_wan21_i2v); in_dim 36 + clip-vision img_emb",
        load=_loader(_I2V21, "Wan21-I2V"), latent=(16, 3, 6, 10), tokens=9, model_path=_I2V21, id="Wan21-I2V",
        extras=_i2v_extras(clip=True), comfy_kwargs=_i2v_kwargs("Wan21-I2V")),
]
