"""SD 1.x / 2.x: ComfyUI's own SD15 and SD20 config classes at model_channels 64 (detection pins 320 channels and
768 / 1024-wide text: 0.86 B), in memory, built like the SDXL rows (tests/family_rows/sdxl.py ``sdxl_small``).

Three rows: SD 1.5 (eps), SD 2.x eps and SD 2.x v (768-v). ComfyUI decides SD 2.x's prediction itself:
``SD20.model_type`` reads the spread of ``output_blocks.11.1.transformer_blocks.0.norm1.bias`` in the state
dict it is given (a full-size file's key; the tiny UNet has 4 output blocks), so the v row hands
``get_model`` that key with a v-model's spread, as a 768-v file would, and the eps row one with an eps
model's. The layout is SD's, shrunk: the first level has the transformers (the last output block too, so
``context`` crosses every stage boundary), the deepest has none, the middle block has one.
"""

from __future__ import annotations

import torch

from . import Row
from .sdxl import sdxl_small

V_PRED_KEY = "output_blocks.11.1.transformer_blocks.0.norm1.bias"  # what comfy.supported_models.SD20.model_type reads

# ComfyUI's detection keys for an SD UNet, shrunk (1.42 M parameters): 2 levels of 64 channels, one
# res block per level, a transformer on level 1 (down and up) and in the middle, none on level 2.
UNET = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "adm_in_channels": None, "in_channels": 4, "out_channels": 4, "model_channels": 64, "num_res_blocks": [1, 1],
    "transformer_depth": [1, 0], "transformer_depth_output": [1, 1, 0, 0], "channel_mult": [1, 1],
    "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 32,
    "use_temporal_resblock": False, "use_temporal_attention": False,
}
SD2_UNET = {**UNET, "use_linear_in_transformer": True, "context_dim": 48}  # SD20's linear projections; another width


def _spread(std: float) -> dict:
    return {V_PRED_KEY: torch.linspace(-1.0, 1.0, 320) * std * 3**0.5}  # population std = std


def sd1_small(seed: int = 7, unet: dict | None = None):
    """SD 1.5 (``comfy.supported_models.SD15``): a float32 CPU ModelPatcher."""
    import comfy.supported_models

    return sdxl_small({}, seed, unet=unet or UNET, config_class=comfy.supported_models.SD15)


def sd2_small(v_pred: bool, seed: int = 79, unet: dict | None = None, config_class=None):
    """SD 2.x (``comfy.supported_models.SD20``, or ``config_class``): eps or v as ComfyUI's SD20 decides it."""
    import comfy.supported_models

    return sdxl_small(_spread(0.2 if v_pred else 0.01), seed, unet=unet or SD2_UNET,
                      config_class=config_class or comfy.supported_models.SD20)


def _row(row_id: str, load, stage_split: str) -> Row:
    return Row("SD1/SD2", "ComfyUI's SD15 / SD20 config class, model_channels 64 (detection pins 0.86 B), in memory",
               load=lambda comfy_root, fixture_paths: load(), latent=(4, 7, 5), tokens=5, id=row_id,
               stage_split=stage_split)


ROWS = [  # SD 2.x differs from SD 1.5 in widths and heads, not in what crosses a stage boundary
    _row("SD15", sd1_small, "bitwise"),
    _row("SD2", lambda: sd2_small(v_pred=False), "as SD15"),
    _row("SD2_vpred", lambda: sd2_small(v_pred=True), "as SD15"),
]
