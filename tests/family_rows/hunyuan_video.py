"""HunyuanVideo: the detected tiny fixtures (devkit/fixtures_video.py), text-to-video and image-to-video.

``HunyuanVideoI2V`` is the same network with 33 input channels, which ComfyUI's detection reads as
``model_base.HunyuanVideoI2V``; ComfyUI's own ``concat_cond`` (start-image latent and ``mask_inverted``, from
``HunyuanImageToVideo`` v1's ``concat_latent_image`` and ``concat_mask``) is the oracle of its concatenated input.
"""

from __future__ import annotations

import torch

from . import Row
from .common import built_fixture, load_detected

I2V_FILE = "pipetrainer-tiny-hunyuan-video-i2v.safetensors"
I2V_LATENT = (16, 3, 6, 10)
_LOADED: dict[str, object] = {}  # the loaded I2V model whose concat_cond is the oracle


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


def _i2v_path(comfy_root, fixture_paths):
    from functools import partial

    from pipetrainer.devkit.fixtures_video import build_tiny_hunyuan_video

    return built_fixture(I2V_FILE, partial(build_tiny_hunyuan_video, seed=1314, in_channels=33))(
        comfy_root, fixture_paths)


def _i2v_load(comfy_root, fixture_paths):
    patcher = load_detected(_i2v_path(comfy_root, fixture_paths))
    _LOADED["HunyuanVideoI2V"] = patcher.model
    return patcher


def _i2v_extras(model, x0, g):
    """The cache's start-image extras: the start latent (a first latent frame of its own, zeros after, processed like
    the training latent) and the text entries' image-token count; the text mask as T2V's row has it."""
    from pipetrainer.training.cache.start_image import CONCAT_LATENT_ALONE
    from pipetrainer.training.cache.start_image_prompt import START_IMAGE_PROMPT

    start = torch.zeros_like(x0)
    start[:, :, :1] = model.process_latent_in(torch.randn(x0[:, :, :1].shape, generator=g))
    return {CONCAT_LATENT_ALONE: start, START_IMAGE_PROMPT: torch.tensor([[3]]), **_extras(model, x0, g)}


def _i2v_kwargs(cond, pooled, options, extras):
    """``c_concat`` from ComfyUI's ``concat_cond`` given what HunyuanImageToVideo v1 attaches (the raw start latent,
    ``concat_mask`` 0 on its frame), and ``extra_conds``' pooled ``y``, ``guidance`` and text mask."""
    from pipetrainer.training.cache.start_image import CONCAT_LATENT_ALONE

    model = _LOADED["HunyuanVideoI2V"]
    start = extras[CONCAT_LATENT_ALONE]
    raw = model.process_latent_out(start[:, :, :1])  # what the VAE gave HunyuanImageToVideo (one latent frame)
    mask = torch.ones(1, 1, *start.shape[2:])
    mask[:, :, :1] = 0
    concat = model.concat_cond(noise=torch.zeros_like(start), concat_latent_image=raw, concat_mask=mask,
                               device=torch.device("cpu"))
    return {"c_concat": concat, **_kwargs(cond, pooled, options, extras)}


ROWS = [
    Row("HunyuanVideo", "detected file, 1.83 M (build_tiny_hunyuan_video)",
        load=lambda comfy_root, fixture_paths: load_detected(_path(comfy_root, fixture_paths)),
        latent=(16, 3, 6, 10), tokens=9, model_path=_path, comfy_kwargs=_kwargs, extras=_extras),
    Row("HunyuanVideo", "detected HunyuanVideoI2V file (33 input channels), 1.84 M; start image, text mask",
        load=_i2v_load, latent=I2V_LATENT, tokens=9, comfy_kwargs=_i2v_kwargs, extras=_i2v_extras,
        id="HunyuanVideoI2V"),  # no model_path: T2V's row runs the process tree; this one's 1 vs 2 stages is in-process
]
