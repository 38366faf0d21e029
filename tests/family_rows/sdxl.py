"""SDXL: ComfyUI's own SDXL config class at model_channels 64 (detection pins the 2.57 B layout), in memory.

Two rows, eps and v-prediction: the v model is built by the same config class from a state dict that
carries the ``v_pred`` flag, so ComfyUI itself picks its ``model_sampling`` (as for a v-pred file).
The rows feed a non-default size/crop extra, and ComfyUI's ``SDXL.encode_adm`` builds the ``y`` vector
the unsplit forward gets from it (ComfyUI's own code, called with a stand-in ``self`` that holds the
same parameter-free ``Timestep(256)`` embedder).
"""

from __future__ import annotations

import types

import torch

from . import Row

SIZE_CROP = (1000, 744, 16, 8, 56, 40)  # height, width, crop_h, crop_w, target_height, target_width (pixels)
POOLED = 16

# ComfyUI's detection keys for an SDXL UNet, shrunk (1.9 M parameters): 2 levels of 64 channels (1 head of 64),
# one res block per level, one transformer layer on level 2 and in the middle, text width 32,
# pooled width 16 (the label embedding takes 16 + 6 * 256 values).
UNET = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": POOLED + 6 * 256, "in_channels": 4, "out_channels": 4,
    "model_channels": 64, "num_res_blocks": [1, 1], "transformer_depth": [0, 1], "transformer_depth_output": [0, 0, 1, 1],
    "channel_mult": [1, 1], "transformer_depth_middle": 1, "use_linear_in_transformer": True, "context_dim": 32,
    "use_temporal_resblock": False, "use_temporal_attention": False,
}


def sdxl_small(flags: dict | None = None, seed: int = 71, unet: dict | None = None, config_class=None):
    """A float32 CPU ModelPatcher from ``comfy.supported_models.SDXL`` (or ``config_class``); ``flags`` are
    state-dict keys ComfyUI's ``model_type`` reads (``v_pred``, ``edm_mean``...)."""
    import comfy.model_patcher
    import comfy.supported_models
    from pipetrainer.devkit.fixtures import _randomize_scaled

    config = (config_class or comfy.supported_models.SDXL)(unet or UNET)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model(dict(flags or {}))
    state = _randomize_scaled({k: v.float() for k, v in model.diffusion_model.state_dict().items()}, seed)
    g = torch.Generator().manual_seed(seed)
    for name, module in model.diffusion_model.named_modules():
        if isinstance(module, torch.nn.GroupNorm):  # near 1, as trained (the generic rule leaves them at ~0.02)
            state[f"{name}.weight"] = 1.0 + 0.1 * torch.randn(module.weight.shape, generator=g)
        elif name.endswith("proj_out"):  # LDM zero-initialises the transformer's output: a small residual branch
            state[f"{name}.weight"] = 0.1 * state[f"{name}.weight"]
    model.diffusion_model.load_state_dict(state)
    model.diffusion_model.float()
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def comfy_y(pooled: torch.Tensor, size_crop) -> torch.Tensor:
    """ComfyUI's ``SDXL.encode_adm`` for one size/crop (ComfyUI applies one per cond)."""
    import comfy.model_base
    from comfy.ldm.modules.diffusionmodules.openaimodel import Timestep

    h, w, crop_h, crop_w, target_h, target_w = (int(v) for v in size_crop)
    standin = types.SimpleNamespace(embedder=Timestep(256), noise_augmentor=None)
    return comfy.model_base.SDXL.encode_adm(standin, pooled_output=pooled, height=h, width=w, crop_h=crop_h,
                                            crop_w=crop_w, target_height=target_h, target_width=target_w)


def _extras(model, x0, g):
    return {"size_crop": torch.tensor([SIZE_CROP], dtype=torch.int64)}


def _kwargs(cond, pooled, options, extras):
    return {"y": comfy_y(pooled, extras["size_crop"][0])}


def _row(row_id: str, flags: dict, stage_split: str) -> Row:
    return Row("SDXL", "ComfyUI's SDXL config class, model_channels 64 (detection pins 2.57 B), in memory",
               load=lambda comfy_root, fixture_paths: sdxl_small(flags), latent=(4, 7, 5), tokens=5,
               comfy_kwargs=_kwargs, extras=_extras, id=row_id, stage_split=stage_split)


ROWS = [
    _row("SDXL", {}, "bitwise"),
    _row("SDXL_vpred", {"v_pred": torch.zeros(0)}, "as SDXL"),  # v-prediction changes the target, not the layers
]
