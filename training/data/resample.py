"""Band-limited resampling of audio in plain PyTorch (no torchaudio).

ComfyUI resamples audio before its encoders with ``torchaudio.functional.resample`` at its defaults
(``VAEEncodeAudio`` in comfy_extras/nodes_audio.py, ``AudioPreprocessor.resample`` of the LTX-2 audio VAE in
comfy/ldm/lightricks/vae/audio_vae.py, ``AudioEncoderModel.encode_audio`` in comfy/audio_encoders). No torchaudio
wheel exists for the torch the current host runs, so training cannot call it; this module applies the same
filter, written out from its definition: a windowed-sinc low-pass interpolator with a Hann window, six zero
crossings and a cutoff at 0.99 of the lower Nyquist frequency, evaluated on the polyphase grid of the reduced
ratio ``new/orig`` with zeros beyond either end. Training audio then goes through the filter that ComfyUI's
inference path uses, so the encoder sees the same spectrum in both.
"""

from __future__ import annotations

import math

import torch

ROLLOFF = 0.99  # cutoff as a fraction of the lower of the two Nyquist frequencies
ZERO_CROSSINGS = 6  # half-length of the sinc, in zero crossings of the low-pass filter
_MAX_KERNEL_ELEMENTS = 64_000_000  # phases x taps: a ratio of two odd rates (44100 -> 47999) would not fit


def _phase_kernels(orig: int, new: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``new`` filters (one per output phase) over the input samples of one block of ``orig`` samples plus
    ``width`` on either side, and that ``width``. Output phase ``j`` sits ``j·orig/new`` input samples into
    the block; each tap is the windowed sinc at the tap's distance from there."""
    cutoff = ROLLOFF * min(orig, new) / orig  # twice the low-pass frequency, in cycles per input sample
    width = math.ceil(ZERO_CROSSINGS / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64)
    phases = torch.arange(new, dtype=torch.float64)[:, None] * orig / new
    t = (taps[None, :] - phases) * cutoff  # distance in zero crossings of the low-pass filter
    window = torch.cos(t.clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS) * math.pi / (2 * ZERO_CROSSINGS)) ** 2
    return (torch.sinc(t) * window * cutoff).to(dtype), width


def resample(waveform: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """``waveform`` (``[..., n]``, float) from ``orig_rate`` to ``new_rate`` Hz: ``ceil(n·new/orig)`` samples.

    Sample ``m`` of the result is the band-limited value at time ``m / new_rate``, so the first sample of
    the input and of the output fall at the same instant and a cut made at either rate lines up.
    """
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"Sample rates must be positive (got {orig_rate} -> {new_rate}).")
    if orig_rate == new_rate:
        return waveform
    if not waveform.dtype.is_floating_point:
        raise TypeError(f"resample needs float samples (got {waveform.dtype}): convert them first.")
    g = math.gcd(int(orig_rate), int(new_rate))
    orig, new = int(orig_rate) // g, int(new_rate) // g
    if new * (2 * math.ceil(ZERO_CROSSINGS / (ROLLOFF * min(orig, new) / orig)) + orig) > _MAX_KERNEL_ELEMENTS:
        raise ValueError(f"Resampling {orig_rate} Hz to {new_rate} Hz needs a filter bank too large to build "
                         "(the rates share almost no factor): pick a target rate with a common factor.")
    kernels, width = _phase_kernels(orig, new, waveform.dtype)
    shape, n = waveform.shape[:-1], waveform.shape[-1]
    flat = waveform.reshape(-1, 1, n)
    padded = torch.nn.functional.pad(flat, (width, width + orig))
    out = torch.nn.functional.conv1d(padded, kernels.to(waveform.device)[:, None, :], stride=orig)  # [B, new, blocks]
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)  # block q, phase j -> output sample q·new + j
    return out[:, : math.ceil(new * n / orig)].reshape(*shape, -1)
