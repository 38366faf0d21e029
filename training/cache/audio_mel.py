"""The log-mel spectrogram ComfyUI's LTX-2 audio VAE encodes, in plain PyTorch (no torchaudio).

ComfyUI's ``AudioVAE.encode`` (comfy/ldm/lightricks/vae/audio_vae.py) turns the waveform into a log-mel with
``torchaudio.transforms.MelSpectrogram`` inside ``AudioPreprocessor.waveform_to_mel`` and hands that to
``CausalAudioAutoencoder.encode``, which needs no torchaudio. No torchaudio wheel exists for the torch the
current host runs, so the Cache node computes the same spectrogram here, written from its definition: a
centred STFT (periodic Hann window of ``n_fft``, reflect padding), magnitudes (power 1), triangular filters
on the Slaney mel scale with Slaney area normalisation from 0 Hz to Nyquist, then ``log(max(mel, 1e-5))``;
laid out ``[batch, channels, frames, mels]`` as the autoencoder takes it. With the waveform already at the
VAE's rate (training/data/audio.py), the encoder's own resample is a no-op and the autoencoder can be
called on this output directly.
"""

from __future__ import annotations

import math

import torch

LOG_FLOOR = 1e-5
_F_SP = 200.0 / 3  # Slaney: linear below 1 kHz, 3 mels per 200 Hz
_MIN_LOG_HZ = 1000.0
_LOG_STEP = math.log(6.4) / 27.0  # Slaney: logarithmic above 1 kHz, 27 mels per factor 6.4


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    linear = hz / _F_SP
    log = _MIN_LOG_HZ / _F_SP + torch.log(hz.clamp(min=_MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return torch.where(hz >= _MIN_LOG_HZ, log, linear)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    min_log_mel = _MIN_LOG_HZ / _F_SP
    log = _MIN_LOG_HZ * torch.exp(_LOG_STEP * (mel - min_log_mel))
    return torch.where(mel >= min_log_mel, log, mel * _F_SP)


def mel_filters(rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """``[n_fft // 2 + 1, n_mels]``: Slaney-scale triangles between 0 Hz and ``rate / 2``, each scaled to
    unit area (``2 / bandwidth``), in float64."""
    freqs = torch.linspace(0, rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    top = _hz_to_mel(torch.tensor(rate / 2.0, dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(0.0, float(top), n_mels + 2, dtype=torch.float64))
    widths = edges[1:] - edges[:-1]
    offsets = edges[None, :] - freqs[:, None]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    triangles = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return triangles * (2.0 / (edges[2:] - edges[:-2]))[None, :]


def log_mel(waveform: torch.Tensor, rate: int, n_fft: int, hop: int, n_mels: int) -> torch.Tensor:
    """``waveform`` ``[batch, channels, n]`` at ``rate`` as ``[batch, channels, n // hop + 1, n_mels]`` log-mels."""
    if waveform.ndim != 3:
        raise ValueError(f"log_mel takes [batch, channels, samples] (got shape {tuple(waveform.shape)}).")
    batch, channels, n = waveform.shape
    if n <= n_fft // 2:
        raise ValueError(f"{n} samples are too short for a centred STFT of {n_fft}: give at least "
                         f"{n_fft // 2 + 1} samples ({(n_fft // 2 + 1) / rate:.3f} s at {rate} Hz).")
    flat = waveform.reshape(batch * channels, n)
    window = torch.hann_window(n_fft, periodic=True, dtype=flat.dtype, device=flat.device)
    spec = torch.stft(flat, n_fft, hop_length=hop, win_length=n_fft, window=window, center=True,
                      pad_mode="reflect", normalized=False, onesided=True, return_complex=True).abs()
    mel = torch.matmul(spec.transpose(-1, -2), mel_filters(rate, n_fft, n_mels).to(spec.dtype).to(spec.device))
    return torch.log(mel.clamp(min=LOG_FLOOR)).reshape(batch, channels, -1, n_mels)
