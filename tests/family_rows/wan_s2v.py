"""Wan 2.2 S2V: ComfyUI's own WAN22_S2V config class at width 64, in memory (detection pins UMT5-XXL's 4096-wide
text input and wav2vec2-large's 1024-wide audio input), 5 blocks with audio injected after blocks 0 and 3
(``audio_inject_layers``; the release's list, every 4th block and then every 3rd, fits its 40 blocks), so
plain blocks sit between them and after them and a 2-stage split can cut while the audio tokens are still
carried. ``casual_audio_encoder.weights`` (the layer weighting, a plain parameter the fixture seeding
sets near 0, where its normalising sum would be ill-conditioned) get values near 1, as a trained model has.

The conditioning is ComfyUI's: ``WAN22_S2V.extra_conds`` of a seeded ``audio_embed`` (25 layers, as
wav2vec2-large gives), a seeded raw reference latent and the ``control_video`` ``WanSoundImageToVideo``
passes without a control video (``process_out`` of zeros); ``apply_model`` gets those conds, the trainer
the cache's extras (the audio features and the processed reference latent). How a clip becomes those
extras is checked against ``AudioEncoderEncode`` + ``WanSoundImageToVideo`` in tests/test_wan_s2v.py,
with :func:`tiny_audio_encoder`.
"""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

CONTEXT = 16  # UMT5-XXL's 4096 in the real model
AUDIO_DIM = 32  # wav2vec2-large's 1024 in the real model
AUDIO_LAYERS = 25  # hidden states of wav2vec2-large (24 layers + the final norm): CausalAudioEncoder's default
LATENT = (16, 3, 6, 8)  # 3 latent frames (9 pixel frames), even sides


def wan_s2v_small(seed: int = 71):
    """Width 64 (2 heads of 32), feed-forward 128, 5 blocks (audio after 0 and 3), audio width 32."""
    require_model_class("WAN22_S2V")
    import comfy.supported_models

    unet = {"image_model": "wan2.1", "model_type": "s2v", "patch_size": (1, 2, 2), "in_dim": 16, "dim": 64,
            "ffn_dim": 128, "freq_dim": 256, "text_dim": CONTEXT, "out_dim": 16, "num_heads": 2, "num_layers": 5,
            "eps": 1e-6, "audio_dim": AUDIO_DIM, "audio_inject_layers": [0, 3]}
    patcher = from_config(comfy.supported_models.WAN22_S2V, unet, seed=seed)
    weights = patcher.model.diffusion_model.casual_audio_encoder.weights
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weights.copy_(1.0 + 0.3 * torch.randn(weights.shape, generator=g))
    return patcher


def tiny_audio_encoder(seed: int = 5):
    """ComfyUI's ``AudioEncoderModel`` (wav2vec2, wav2vec2-large's layout: 24 layers, stable layer norm, conv
    norm and bias, normalized input) at width 32 with 2 heads, loaded through its own ``load_sd`` with
    seeded weights (detection, ``load_audio_encoder_from_sd``, knows only the 768 and 1024 widths)."""
    require_model_class("WAN22_S2V")
    try:
        from comfy.audio_encoders.audio_encoders import AudioEncoderModel
    except ModuleNotFoundError as exc:  # ComfyUI's audio encoders import torchaudio, which this host's venv lacks
        import pytest

        pytest.skip(f"this host cannot import comfy.audio_encoders ({exc})")
    from pipetrainer.devkit.fixtures import _randomize_scaled

    config = {"model_type": "wav2vec2", "embed_dim": AUDIO_DIM, "num_heads": 2, "num_layers": AUDIO_LAYERS - 1,
              "conv_norm": True, "conv_bias": True, "do_normalize": True, "do_stable_layer_norm": True}
    encoder = AudioEncoderModel(config)
    state = {k: v.float() for k, v in encoder.get_sd().items()}
    missing, unexpected = encoder.load_sd(_randomize_scaled(state, seed))
    assert not missing and not unexpected, (missing, unexpected)
    return encoder


def s2v_conds(model, latent_shape: tuple[int, ...], audio_embed: torch.Tensor, raw_reference: torch.Tensor) -> dict:
    """``WAN22_S2V.extra_conds`` of what ``WanSoundImageToVideo`` puts into the conditioning (no control video)."""
    import comfy.latent_formats

    control = comfy.latent_formats.Wan21().process_out(torch.zeros(latent_shape))
    conds = model.extra_conds(noise=torch.zeros(latent_shape), device=torch.device("cpu"), audio_embed=audio_embed,
                              reference_latents=[raw_reference], control_video=control)
    return {k: conds[k].cond for k in ("audio_embed", "reference_latent", "control_video")}


def _extras(model, x0, g):
    frames, height, width = x0.shape[-3:]
    audio = torch.randn(x0.shape[0], AUDIO_LAYERS, AUDIO_DIM, 4 * frames, generator=g)
    raw = torch.randn(x0.shape[0], 16, 1, height, width, generator=g)
    conds = s2v_conds(model, tuple(x0.shape), audio, raw)
    assert conds["audio_embed"] is audio  # CONDRegular hands it over as given
    return {"audio_embed": audio, "s2v_reference": conds["reference_latent"]}


def _kwargs(cond, pooled, options, extras):
    """The conds of :func:`_extras`' example: the audio and processed reference as ``extra_conds`` made them, and
    its ``control_video`` (``process_latent_in`` of ``process_out`` of zeros) for the example's latent shape."""
    import comfy.latent_formats

    audio, ref = extras["audio_embed"], extras["s2v_reference"]
    fmt = comfy.latent_formats.Wan21()
    shape = (ref.shape[0], 16, audio.shape[-1] // 4, *ref.shape[-2:])
    return {"audio_embed": audio, "reference_latent": ref, "control_video": fmt.process_in(fmt.process_out(
        torch.zeros(shape)))}


ROWS = [
    Row("WanS2V", "ComfyUI's WAN22_S2V config class, width 64 (detection pins text 4096 and audio 1024), in "
        "memory; 5 blocks, audio injected after 0 and 4, seeded audio features and reference latent",
        load=lambda comfy_root, fixture_paths: wan_s2v_small(), latent=LATENT, tokens=5, extras=_extras,
        comfy_kwargs=_kwargs),
]
