"""HunyuanImage 2.1 (ComfyUI 0.3.75 and current): ComfyUI's own HunyuanImage21 config class at hidden 64 (detection pins 128-wide heads, the
3584-wide Qwen2.5-VL context and a 1472 -> 2048 -> 2048 ByT5 mapper of 7 M parameters), in memory.

Two rows, because ComfyUI's forward cannot take a text mask and ByT5 states together (its additive mask
covers only the Qwen tokens while the text then holds both): ``HunyuanImage21`` has a guidance embedding and
ByT5 glyph states through a narrow ``ByT5Mapper`` of ComfyUI's own class (1472 in, 8 wide, attached as
``byt5_in`` where detection would build the full one), no mask; ``HunyuanImage21Masked`` has no ByT5 mapper and
a text mask that leaves the last 2 of 9 tokens out, as the Qwen encoder's mask marks padding. Both have a
guidance embedding: the first-stage tuple always carries the guidance (the adapter sees no model there), and
only a model that embeds it uses it (tests/test_stage_split.py asks every sent float to be used).
"""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

HUNYUAN_IMAGE_CONTEXT = 16  # Qwen2.5-VL's 3584 in the real model
BYT5 = "conditioning_byt5small"
BYT5_WIDTH = 1472  # ByT5-small's states: ComfyUI's ByT5Mapper pins this input width


def hunyuan_image_small(guidance_embed: bool, byt5: bool, seed: int = 41):
    """0.36 M parameters (0.37 M with the ByT5 mapper): 1 double + 1 single block, 1 x 1 patches over the 2-D
    latent, 2 rotary axes."""
    require_model_class("HunyuanImage21")
    import comfy.ops
    import comfy.supported_models
    from comfy.ldm.hunyuan_video.model import ByT5Mapper
    from pipetrainer.devkit.fixtures import _randomize_scaled

    unet = {"image_model": "hunyuan_video", "in_channels": 4, "out_channels": 4, "vec_in_dim": None,
            "context_in_dim": HUNYUAN_IMAGE_CONTEXT, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2,
            "depth": 1, "depth_single_blocks": 1, "axes_dim": [16, 16], "theta": 256, "patch_size": [1, 1],
            "qkv_bias": True, "guidance_embed": guidance_embed, "byt5": False, "meanflow": False,
            "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    fields = HunyuanVideoParams.__dataclass_fields__
    unet = {k: v for k, v in unet.items() if k in fields or k == "image_model"}  # 0.3.75 has no meanflow_sum
    patcher = from_config(comfy.supported_models.HunyuanImage21, unet, seed=seed)
    if byt5:
        mapper = ByT5Mapper(in_dim=BYT5_WIDTH, out_dim=8, hidden_dim=8, out_dim1=64, use_res=False,
                            dtype=torch.float32, operations=comfy.ops.disable_weight_init)
        mapper.load_state_dict(_randomize_scaled({k: v.float() for k, v in mapper.state_dict().items()}, seed + 1))
        patcher.model.diffusion_model.byt5_in = mapper
    return patcher


def _byt5(model, x0, g):
    return {BYT5: torch.randn(1, 3, BYT5_WIDTH, generator=g)}


def _byt5_kwargs(cond, pooled, options, extras):
    """What ``HunyuanImage21.extra_conds`` hands the model: ``txt_byt5`` and ``guidance``."""
    return {"txt_byt5": extras[BYT5], "guidance": torch.full((cond.shape[0],), options.guidance)}


def _mask(model, x0, g):
    mask = torch.ones(1, 9, dtype=torch.int64)
    mask[:, -2:] = 0
    return {"attention_mask": mask}


def _mask_kwargs(cond, pooled, options, extras):
    return {"attention_mask": extras["attention_mask"], "guidance": torch.full((cond.shape[0],), options.guidance)}


ROWS = [
    Row("HunyuanImage", "ComfyUI's HunyuanImage21 config class, hidden 64, guidance, narrow ByT5 mapper, in memory",
        load=lambda comfy_root, fixture_paths: hunyuan_image_small(True, True), latent=(4, 7, 5), tokens=6,
        comfy_kwargs=_byt5_kwargs, extras=_byt5, id="HunyuanImage21"),
    Row("HunyuanImage", "ComfyUI's HunyuanImage21 config class, hidden 64, text mask, in memory",
        load=lambda comfy_root, fixture_paths: hunyuan_image_small(True, False, seed=43), latent=(4, 6, 5),
        tokens=9, comfy_kwargs=_mask_kwargs, extras=_mask, id="HunyuanImage21Masked",
        stage_split="as HunyuanImage21"),
]
