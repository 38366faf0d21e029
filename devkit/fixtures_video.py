"""Tiny video-model files that ComfyUI's own detection accepts (seeded random weights, float32).

Each builder writes a safetensors file whose keys and shapes ComfyUI's ``model_detection`` turns into
the intended layout, with no config in the file's metadata (no back door): the tests load them with
the stock ``comfy.sd.load_diffusion_model``. Wan's detection reads dim, ffn, blocks, in and out
channels and the image-embedding keys from the weights; it pins ``text_dim`` to UMT5-XXL's 4096 and
the clip-vision width to 1280 (ViT-H), so those embedders dominate the parameter counts.

Sizes (parameters): Wan 2.2 TI2V-5B layout 1,138,240; Wan 2.2 I2V A14B layout 1,115,584; Wan 2.1 I2V
2,988,352 (the same on 0.3.75 and current ComfyUI).
"""

from __future__ import annotations

from pathlib import Path

WAN22_TI2V_FILE = "pipetrainer-tiny-wan22-ti2v.safetensors"
WAN22_I2V_FILE = "pipetrainer-tiny-wan22-i2v.safetensors"
WAN21_I2V_FILE = "pipetrainer-tiny-wan21-i2v.safetensors"


def _save_wan(path: Path, seed: int, **config) -> Path:
    import torch
    from comfy.ldm.wan.model import WanModel
    from safetensors.torch import save_file

    from .fixtures import _randomize_scaled

    model = WanModel(patch_size=(1, 2, 2), dim=128, ffn_dim=256, freq_dim=256, text_dim=4096, num_heads=1,
                     num_layers=2, device="meta", operations=torch.nn, **config)
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_randomize_scaled(state, seed), str(path))
    return path


def build_tiny_wan22_ti2v(path: Path, seed: int = 2222) -> Path:
    """Wan 2.2 TI2V-5B layout: 48 latent channels in and out (Wan 2.2 VAE), text-to-video blocks.

    Detection picks ComfyUI's ``WAN22_T2V`` config from ``out_dim`` 48: model class ``WAN22`` (the
    per-frame timestep of a clean start frame) and the ``Wan22`` latent format."""
    return _save_wan(path, seed, model_type="t2v", in_dim=48, out_dim=48)


def build_tiny_wan22_i2v(path: Path, seed: int = 2223) -> Path:
    """Wan 2.2 I2V A14B layout (either expert): 36 input channels (noise 16 + mask 4 + start-image latent
    16), text cross-attention only (no clip-vision embedding), so detection gives ``WAN21_T2V``."""
    return _save_wan(path, seed, model_type="t2v", in_dim=36, out_dim=16)


def build_tiny_wan21_i2v(path: Path, seed: int = 2125) -> Path:
    """Wan 2.1 I2V layout: 36 input channels and the clip-vision embedding (``img_emb``, 1280 wide) with
    image cross-attention (``k_img``/``v_img``); detection gives ``WAN21_I2V``."""
    return _save_wan(path, seed, model_type="i2v", in_dim=36, out_dim=16)


def _tiny_wan21_vae_state(seed: int) -> dict:
    from comfy.ldm.wan.vae import WanVAE

    from .fixtures import _randomize_scaled

    model = WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True], dropout=0.0)
    return _randomize_scaled({k: v.float() for k, v in model.state_dict().items()}, seed)


def tiny_wan21_vae(seed: int = 2101):
    """A Wan 2.1 VAE (``comfy.ldm.wan.vae.WanVAE``) at base width 8 with seeded weights, 0.92 M parameters,
    as a ComfyUI ``VAE``: ComfyUI's VAE detection reads the width from ``decoder.head.0.gamma``, so it is
    the real 16-channel, 8x spatial, 4k+1-frame causal video VAE, only narrow (in memory, no file)."""
    import comfy.sd

    return comfy.sd.VAE(sd=_tiny_wan21_vae_state(seed))


WAN21_VAE_FILE = "pipetrainer-tiny-wan21-vae.safetensors"


def build_tiny_wan21_vae(path: Path, seed: int = 2101) -> Path:
    """:func:`tiny_wan21_vae` as a file for the stock ``VAELoader`` (``models/vae``), 3.7 MB."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_tiny_wan21_vae_state(seed), str(path))
    return path


HUNYUAN_VIDEO_FILE = "pipetrainer-tiny-hunyuan-video.safetensors"


def build_tiny_hunyuan_video(path: Path, seed: int = 1313, in_channels: int = 16) -> Path:
    """HunyuanVideo (T2V) with the smallest dims ComfyUI's detection accepts: hidden 128 (detection gives
    128 // 128 = 1 head and rotary axes [16, 56, 56]), 1 double and 1 single block, the 768-wide pooled
    CLIP-L vector and the guidance embedding. Detection reads the text width from the weights: 768 here
    (the real llava-llama3 encoder gives 4096, which would add 0.8 M parameters): 1.83 M parameters.
    ``in_channels`` 33 makes the HunyuanVideoI2V layout (32: SkyReels I2V), which detection tells by it."""
    import dataclasses

    import torch
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    from safetensors.torch import save_file

    from .fixtures import _randomize_scaled

    config = {"in_channels": in_channels, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 768, "hidden_size": 128,
              "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1, "axes_dim": [16, 56, 56],
              "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True, "guidance_embed": True, "byt5": False,
              "meanflow": False, "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}
    fields = {f.name for f in dataclasses.fields(HunyuanVideoParams)}  # newer ComfyUI has more fields
    model = HunyuanVideo(image_model="hunyuan_video", device="meta", operations=torch.nn,
                         **{k: v for k, v in config.items() if k in fields})
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_randomize_scaled(state, seed), str(path))
    return path
