"""HunyuanVideo 1.5 (ComfyUI 0.3.75 and current): ComfyUI's own HunyuanVideo15 config class at hidden 64, in memory (detection
pins 128-wide heads, SigLIP's 1152-wide vision input and a 1472 -> 2048 -> 2048 ByT5 mapper of 7 M parameters).

The layout is 1.5's: 32 latent channels with 33 concatenated (65 in), 1 x 1 x 1 patches, three rotary axes,
condition-type embedding, vision projection (unused by text-to-video), no pooled vector. Two rows, because
ComfyUI's forward cannot take a text mask and ByT5 states together (its mask covers only the Qwen tokens):
``HunyuanVideo15`` has ByT5 glyph states through a narrow ``ByT5Mapper`` of ComfyUI's own class and one double
+ one single block, no mask; ``HunyuanVideo15Masked`` has no ByT5 mapper, two double blocks and no single
block, and a text mask that leaves the last 2 of 9 tokens out. Both have a guidance embedding (the
first-stage tuple always carries the guidance; tests/test_stage_split.py asks every sent float to be used).
A third row, ``HunyuanVideo15Detected``, is a file ComfyUI's own detection reads as ``HunyuanVideo15`` (as a real
release: no guidance embedding, no single block, a text mask); it carries the family through the process-tree
check (cache files, data, 1 and 2 stages). ComfyUI gets ``c_concat`` from its own ``HunyuanVideo15.concat_cond``
without a start image (text-to-video).
"""

from __future__ import annotations

import torch

from . import Row
from .common import built_fixture, from_config, load_detected, require_model_class
from .hunyuan_image import BYT5, BYT5_WIDTH

CONTEXT = 16  # Qwen2.5-VL's 3584 in the real model
LATENT = (32, 3, 5, 7)  # 32 channels (the 1.5 VAE), 3 latent frames, odd sides
_LOADED: dict[str, object] = {}  # row id -> a loaded model whose concat_cond is the oracle


def hunyuan_video15_small(byt5: bool, double: int, single: int, seed: int):
    """0.2-0.3 M parameters: hidden 64 (2 heads of 32, rotary axes 8 + 12 + 12), 1 x 1 x 1 patches."""
    require_model_class("HunyuanVideo15")
    import comfy.ops
    import comfy.supported_models
    from comfy.ldm.hunyuan_video.model import ByT5Mapper, HunyuanVideoParams
    from pipetrainer.devkit.fixtures import _randomize_scaled

    unet = {"image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "vec_in_dim": None,
            "context_in_dim": CONTEXT, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": double,
            "depth_single_blocks": single, "axes_dim": [8, 12, 12], "theta": 256, "patch_size": [1, 1, 1],
            "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False,
            "use_cond_type_embedding": True, "vision_in_dim": 8, "meanflow_sum": True}
    fields = HunyuanVideoParams.__dataclass_fields__
    unet = {k: v for k, v in unet.items() if k in fields or k == "image_model"}  # 0.3.75 has no meanflow_sum
    patcher = from_config(comfy.supported_models.HunyuanVideo15, unet, seed=seed)
    if byt5:
        mapper = ByT5Mapper(in_dim=BYT5_WIDTH, out_dim=8, hidden_dim=8, out_dim1=64, use_res=False,
                            dtype=torch.float32, operations=comfy.ops.disable_weight_init)
        mapper.load_state_dict(_randomize_scaled({k: v.float() for k, v in mapper.state_dict().items()}, seed + 1))
        patcher.model.diffusion_model.byt5_in = mapper
    return patcher


DETECTED_FILE = "pipetrainer-tiny-hunyuan-video15.safetensors"


def build_tiny_hunyuan_video15(path, seed: int = 1515):
    """A HunyuanVideo 1.5 file as ComfyUI's detection reads one (model class HunyuanVideo15): hidden 128 (1 head,
    rotary axes [16, 56, 56]), two double blocks (one per stage of a 2-stage split) and no single block (as the 1.5
    releases), 65 input channels,
    SigLIP's 1152-wide vision projection (detection matches the config class on it), condition-type embedding,
    no guidance embedding, no ByT5 mapper; the text width (16) is read from the weights: 3.30 M parameters."""
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    from pipetrainer.devkit.fixtures import _randomize_scaled
    from safetensors.torch import save_file

    config = {"in_channels": 65, "out_channels": 32, "vec_in_dim": None, "context_in_dim": CONTEXT, "hidden_size": 128,
              "mlp_ratio": 4.0, "num_heads": 1, "depth": 2, "depth_single_blocks": 0, "axes_dim": [16, 56, 56],
              "theta": 256, "patch_size": [1, 1, 1], "qkv_bias": True, "guidance_embed": False, "byt5": False,
              "meanflow": False, "use_cond_type_embedding": True, "vision_in_dim": 1152, "meanflow_sum": True}
    fields = HunyuanVideoParams.__dataclass_fields__  # 0.3.75 has no meanflow_sum
    model = HunyuanVideo(image_model="hunyuan_video", device="meta", operations=torch.nn,
                         **{k: v for k, v in config.items() if k in fields})
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_randomize_scaled(state, seed), str(path))
    return path


def _detected_path(comfy_root, fixture_paths):
    require_model_class("HunyuanVideo15")
    return built_fixture(DETECTED_FILE, build_tiny_hunyuan_video15)(comfy_root, fixture_paths)


def _load_detected(comfy_root, fixture_paths):
    patcher = load_detected(_detected_path(comfy_root, fixture_paths))
    _LOADED.setdefault("HunyuanVideo15Detected", patcher.model)
    return patcher


def _detected_kwargs(cond, pooled, options, extras):
    """``c_concat`` and the text mask, as ``HunyuanVideo15.extra_conds`` hands them (no guidance embedding)."""
    return {"c_concat": _t2v_concat("HunyuanVideo15Detected"), "attention_mask": extras["attention_mask"]}


def _loader(key: str, byt5: bool, double: int, single: int, seed: int):
    def load(comfy_root, fixture_paths):
        patcher = hunyuan_video15_small(byt5, double, single, seed)
        _LOADED.setdefault(key, patcher.model)
        return patcher

    return load


def _t2v_concat(key: str) -> torch.Tensor:
    """ComfyUI's ``HunyuanVideo15.concat_cond`` without a start image (what text-to-video samples with)."""
    return _LOADED[key].concat_cond(noise=torch.zeros(1, *LATENT), device=torch.device("cpu"))


def _byt5(model, x0, g):
    return {BYT5: torch.randn(1, 3, BYT5_WIDTH, generator=g)}


def _byt5_kwargs(cond, pooled, options, extras):
    """What ``HunyuanVideo15.extra_conds`` hands the model: ``c_concat``, ``txt_byt5`` and ``guidance``."""
    return {"c_concat": _t2v_concat("HunyuanVideo15"), "txt_byt5": extras[BYT5],
            "guidance": torch.full((cond.shape[0],), options.guidance)}


def _mask(model, x0, g):
    mask = torch.ones(1, 9, dtype=torch.int64)
    mask[:, -2:] = 0
    return {"attention_mask": mask}


def _mask_kwargs(cond, pooled, options, extras):
    return {"c_concat": _t2v_concat("HunyuanVideo15Masked"), "attention_mask": extras["attention_mask"],
            "guidance": torch.full((cond.shape[0],), options.guidance)}


ROWS = [
    Row("HunyuanVideo15", "ComfyUI's HunyuanVideo15 config class, hidden 64, guidance, narrow ByT5 mapper, in memory",
        load=_loader("HunyuanVideo15", True, 1, 1, 51), latent=LATENT, tokens=6, comfy_kwargs=_byt5_kwargs,
        extras=_byt5, id="HunyuanVideo15"),
    Row("HunyuanVideo15", "ComfyUI's HunyuanVideo15 config class, hidden 64, 2 double blocks, text mask, in memory",
        load=_loader("HunyuanVideo15Masked", False, 2, 0, 53), latent=LATENT, tokens=9, comfy_kwargs=_mask_kwargs,
        extras=_mask, id="HunyuanVideo15Masked"),
    Row("HunyuanVideo15", "detected file, 3.30 M (build_tiny_hunyuan_video15); text mask, no guidance embedding",
        load=_load_detected, latent=LATENT, tokens=9, model_path=_detected_path, comfy_kwargs=_detected_kwargs,
        extras=_mask, id="HunyuanVideo15Detected"),
]
