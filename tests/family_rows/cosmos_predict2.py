"""Cosmos Predict2 text-to-image and Anima: ComfyUI's own CosmosT2IPredict2 and Anima config classes at width 64
(detection pins width 2048: about 2 B parameters; Anima's LLM adapter alone is 1024 wide, 6 layers), in memory.

The layout keeps what the data flow needs: 2 blocks (a 2-stage split falls between them), AdaLN-LoRA as
detection sets it, the 3-D RoPE table with detection's extrapolation ratios, 16 latent channels (the Wan 2.1
latent format's ``process_latent_in``), and a non-square 1 x 8 x 6 latent: even sides, as preflight requires of
every family's latents and as ComfyUI 0.3.75's model asserts (current ComfyUI would pad odd ones), so the
CosmosPredict2 row runs on 0.3.75 too. Anima's rows give the T5 token ids and weights its LLM adapter reads (ComfyUI hands them to the model as
``t5xxl_ids`` / ``t5xxl_weights``) and the Qwen text mask (all ones: the cond is unpadded, as ComfyUI's).

The Video2World row is ComfyUI's CosmosI2VPredict2 config (17 input channels: the latent and ComfyUI's
``mask_inverted`` channel) on a 3-frame latent, text-to-video: ComfyUI gets what ``CosmosPredict2.extra_conds``
builds without a noise mask (a zero mask channel). Image-to-video is checked against
``CosmosPredict2ImageToVideoLatent`` in tests/test_cosmos_predict2.py."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

COSMOS_CONTEXT = 24  # T5-XXL v1.1's 1024 in the real model (Anima: the adapter's 1024, fixed by ComfyUI)


def _unet(model: str, context: int) -> dict:
    return {"image_model": model, "max_img_h": 32, "max_img_w": 32, "max_frames": 8, "in_channels": 16,
            "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "concat_padding_mask": True,
            "model_channels": 64, "num_blocks": 2, "num_heads": 2, "crossattn_emb_channels": context,
            "pos_emb_cls": "rope3d", "pos_emb_learnable": True, "pos_emb_interpolation": "crop",
            "min_fps": 1, "max_fps": 30, "use_adaln_lora": True, "adaln_lora_dim": 8,
            "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0,
            "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
            "rope_enable_fps_modulation": False}


def cosmos_predict2_small(seed: int = 29):
    """ComfyUI's CosmosT2IPredict2 config at width 64, 2 blocks, AdaLN-LoRA rank 8."""
    import comfy.supported_models

    require_model_class("CosmosPredict2")
    return from_config(comfy.supported_models.CosmosT2IPredict2, _unet("cosmos_predict2", COSMOS_CONTEXT), seed=seed)


VIDEO_LATENT = (16, 3, 8, 6)  # 3 latent frames (9 pixel frames of the Wan 2.1 VAE), even sides


def cosmos_predict2_video_small(seed: int = 31):
    """ComfyUI's CosmosI2VPredict2 (Video2World) config at width 64, 2 blocks, AdaLN-LoRA rank 8."""
    import comfy.supported_models

    require_model_class("CosmosPredict2")
    unet = {**_unet("cosmos_predict2", COSMOS_CONTEXT), "in_channels": 17}
    return from_config(comfy.supported_models.CosmosI2VPredict2, unet, seed=seed)


def cosmos_conds(model, noise: torch.Tensor, latent_image: torch.Tensor | None = None,
                 noise_mask: torch.Tensor | None = None) -> dict:
    """What ComfyUI's sampler hands ``apply_model`` besides the text: ``CosmosPredict2.extra_conds`` of the noise,
    the latent image and the noise mask brought to the latent's shape as the sampler does (``prepare_mask``)."""
    import comfy.sampler_helpers

    kwargs = {"noise": noise, "device": torch.device("cpu"),
              "latent_image": latent_image if latent_image is not None else torch.zeros_like(noise)}
    if noise_mask is not None:
        kwargs["denoise_mask"] = comfy.sampler_helpers.prepare_mask(noise_mask, noise.shape, torch.device("cpu"))
    conds = model.extra_conds(**kwargs)
    return {name: cond.cond for name, cond in conds.items() if name != "fps"}


_LOADED: list = []  # the newest loaded Video2World model: its extra_conds is the oracle of the row's kwargs


def _video_load(comfy_root, fixture_paths):
    patcher = cosmos_predict2_video_small()
    _LOADED[:] = [patcher.model]
    return patcher


def _video_kwargs(cond, pooled, options, extras):
    return cosmos_conds(_LOADED[-1], torch.zeros(1, *VIDEO_LATENT))


ANIMA_QWEN = 24  # Qwen3 0.6B's 1024 in the real model
ANIMA_WIDTH = 16  # the DiT's text width, which the adapter's output is (1024 in the real model)


def anima_small(seed: int = 41):
    """ComfyUI's Anima config at width 64 with ComfyUI's own LLMAdapter put in at width 16, one layer (its
    32128-token embedding makes most of the 0.7 M parameters), weights seeded after the swap."""
    require_model_class("Anima")
    import comfy.model_patcher
    import comfy.ops
    import comfy.supported_models
    from comfy.ldm.anima.model import LLMAdapter
    from pipetrainer.devkit.fixtures import _randomize_scaled

    config = comfy.supported_models.Anima(_unet("anima", ANIMA_WIDTH))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    dm = model.diffusion_model
    dm.llm_adapter = LLMAdapter(source_dim=ANIMA_QWEN, target_dim=ANIMA_WIDTH, model_dim=ANIMA_WIDTH, num_layers=1,
                                num_heads=2, operations=comfy.ops.disable_weight_init)
    state = dm.state_dict()
    dm.load_state_dict(_randomize_scaled({k: v.float() for k, v in state.items()}, seed))
    dm.float()
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _anima_extras(model, x0, g):
    """7 T5 ids ending in the end token 1, weights around 1, and the Qwen mask of the row's 5 unpadded tokens."""
    ids = torch.cat([torch.randint(2, 32128, (1, 6), generator=g), torch.ones(1, 1, dtype=torch.int64)], dim=1)
    weights = 1.0 + 0.2 * torch.rand(1, 7, generator=g)
    return {"t5xxl_ids": ids, "t5xxl_weights": weights, "attention_mask": torch.ones(1, 5, dtype=torch.int64)}


def _anima_kwargs(cond, pooled, options, extras):
    """What ``Anima.extra_conds`` hands the model outside inference mode: the ids and the weights ``[B, M, 1]``."""
    return {"t5xxl_ids": extras["t5xxl_ids"], "t5xxl_weights": extras["t5xxl_weights"].unsqueeze(-1)}


ROWS = [
    Row("CosmosPredict2", "ComfyUI's CosmosT2IPredict2 config class, width 64 (detection pins 2048), in memory",
        load=lambda comfy_root, fixture_paths: cosmos_predict2_small(), latent=(16, 1, 8, 6), tokens=5),
    Row("CosmosPredict2", "ComfyUI's CosmosI2VPredict2 (Video2World) config class, width 64, in memory; "
        "text-to-video on 3 latent frames", load=_video_load, latent=VIDEO_LATENT, tokens=5,
        comfy_kwargs=_video_kwargs, id="CosmosPredict2Video2World"),
    Row("Anima", "ComfyUI's Anima config class, width 64, with a 16-wide 1-layer LLMAdapter, in memory",
        load=lambda comfy_root, fixture_paths: anima_small(), latent=(16, 1, 8, 6), tokens=5,
        extras=_anima_extras, comfy_kwargs=_anima_kwargs),
]
