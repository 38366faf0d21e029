"""A clip's audio as the latent ComfyUI's LTX-2 audio VAE gives it, without torchaudio.

ComfyUI's ``AudioVAE.encode`` (comfy/ldm/lightricks/vae/audio_vae.py) resamples the waveform to the VAE's rate
and takes its log-mel with torchaudio, then runs ``CausalAudioAutoencoder.encode``, takes the posterior's mode
and normalizes it with the autoencoder's per-channel statistics. The current host has no torchaudio that runs
(no wheel exists for its torch), so this module does the same steps with the project's plain-torch resampler
(training/data/resample.py, torchaudio's default filter) and log-mel (:mod:`.audio_mel`), and ComfyUI's own
autoencoder, posterior and normalizer for the rest: the latent equals ``AudioVAE.encode``'s wherever the
resample and mel do (tests/test_ltx2_audio.py compares the model part on the same mel).

A clip without sound (no track, or a silent one) is encoded as digital silence of the kept span: that is
what the clip sounds like, and it is what LTX-2 should learn to generate for it. The zero latent of
``LTXVEmptyLatentAudio`` is no such target: it is the start of text-to-video sampling, which ComfyUI noises
entirely and never asks the model to reproduce.
"""

from __future__ import annotations

import torch


def audio_vae_of(vae: object) -> object:
    """ComfyUI's ``AudioVAE`` inside the VAE object its loaders give (``LTXVAudioVAELoader``), or a clear error."""
    model = getattr(vae, "first_stage_model", vae)
    if not (hasattr(model, "autoencoder") and hasattr(model, "normalizer")):
        raise ValueError(f"{type(model).__name__} is not an LTX-2 audio VAE: connect the one 'LTXV Audio VAE Loader' "
                         "loads from the LTX-2 checkpoint to the Cache node's audio_vae input.")
    return model


def audio_settings(audio_vae: object) -> dict[str, int]:
    """The rate, mel and channel settings of the audio VAE's preprocessing (its autoencoder's config)."""
    config = audio_vae.autoencoder.get_config()
    return {"rate": int(config["sampling_rate"]), "n_fft": int(config["n_fft"]), "hop": int(config["mel_hop_length"]),
            "mels": int(config["mel_bins"]), "channels": int(audio_vae.autoencoder.encoder.in_channels)}


def mel_of(audio_vae: object, waveform: torch.Tensor, rate: int) -> torch.Tensor:
    """The log-mel ``AudioVAE.encode`` computes of ``waveform`` ``[B, ch, n]`` at ``rate`` (mono is repeated to
    the encoder's channels, as it does)."""
    from ..data.resample import resample
    from .audio_mel import log_mel

    s = audio_settings(audio_vae)
    if waveform.shape[1] != s["channels"]:
        if waveform.shape[1] != 1:
            raise ValueError(f"The audio VAE takes {s['channels']} channels or mono (got {waveform.shape[1]}).")
        waveform = waveform.expand(-1, s["channels"], *waveform.shape[2:])
    if rate != s["rate"]:
        waveform = resample(waveform, rate, s["rate"])
    return log_mel(waveform.float(), s["rate"], s["n_fft"], s["hop"], s["mels"])


def latent_of_mel(audio_vae: object, mel: torch.Tensor) -> torch.Tensor:
    """``AudioVAE.encode`` from the mel on: the autoencoder, the posterior's mode, the normalizer (ComfyUI's own)."""
    from comfy.ldm.mmaudio.vae.distributions import DiagonalGaussianDistribution

    ae = audio_vae.autoencoder
    param = next(ae.parameters())
    with torch.no_grad():
        moments = ae.encode(mel.to(device=param.device, dtype=param.dtype))
        return audio_vae.normalizer.normalize(DiagonalGaussianDistribution(moments).mode()).float().cpu()


def encode_audio(audio_vae: object, waveform: torch.Tensor, rate: int) -> torch.Tensor:
    """``[8, T, 16]``-like latent of one clip's waveform ``[ch, n]`` at ``rate`` (the batch axis dropped)."""
    return latent_of_mel(audio_vae, mel_of(audio_vae, waveform[None], rate))[0]


def silence(audio_vae: object, seconds: float) -> tuple[torch.Tensor, int]:
    """``(waveform [ch, n], rate)`` of digital silence lasting ``seconds``: what a clip without sound encodes."""
    s = audio_settings(audio_vae)
    return torch.zeros(s["channels"], max(1, round(seconds * s["rate"]))), s["rate"]
