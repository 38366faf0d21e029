"""The audio VAEs the Cache node's ``audio_vae`` input takes, each behind one small contract, and how each is found.

A family that trains on a clip's sound (LTX-2, MiniMax-H3) samples with its own audio VAE, loaded by ComfyUI's
loaders. Each kind says its rate and channels (what training/data/audio.py reads the track at), how it encodes one
clip's kept span, what a clip without sound encodes, and what of the dataset it cannot take. :func:`codec_for` asks
each registered kind whether a loaded VAE is its own; a new kind is one class and one entry in ``_KINDS``.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AudioCodec(Protocol):
    """One audio VAE kind, around the ComfyUI model its loader gave."""

    rate: int
    channels: int
    model: object

    def encode(self, waveform: torch.Tensor, rate: int, frames: int, fps: float) -> torch.Tensor:
        """The cached latent of one clip's kept span ``waveform`` ``[ch, n]`` at ``rate`` (``frames`` at ``fps``)."""
        ...

    def silence(self, seconds: float) -> tuple[torch.Tensor, int]:
        """``(waveform [ch, n], rate)`` of digital silence lasting ``seconds``: what a clip without sound encodes."""
        ...

    def problems(self, fps: float) -> list[str]:
        """What of the dataset this VAE's model cannot train on (a frame rate it never samples at)."""
        ...

    def identity(self) -> dict:
        """What of the encode changes the cached latent besides the weights (for the cache key)."""
        ...


class LTX2AudioCodec:
    """LTX-2's ``AudioVAE`` (``LTXVAudioVAELoader``): log-mel, autoencoder, normalizer (audio_latent.py)."""

    def __init__(self, model: object):
        from .audio_latent import audio_settings

        self.model = model
        s = audio_settings(model)
        self.rate, self.channels = s["rate"], s["channels"]

    @staticmethod
    def accepts(model: object) -> bool:
        return hasattr(model, "autoencoder") and hasattr(model, "normalizer")

    def encode(self, waveform: torch.Tensor, rate: int, frames: int, fps: float) -> torch.Tensor:
        from .audio_latent import encode_audio

        return encode_audio(self.model, waveform, rate)

    def silence(self, seconds: float) -> tuple[torch.Tensor, int]:
        from .audio_latent import silence

        return silence(self.model, seconds)

    def problems(self, fps: float) -> list[str]:
        return []

    def identity(self) -> dict:
        return {"encode": "plain-torch resample and log-mel; ComfyUI's autoencoder mode and normalizer"}


class MiniMaxH3AudioCodec:
    """MiniMax-H3's stereo audio VAE (``MiniMaxH3AudioVAE``, loaded by ``VAELoader``): 32 kHz stereo, 800 samples a
    latent frame (40 Hz). ComfyUI encodes a waveform with the model's own ``encode`` (``VAE.encode``: mono is
    replicated to stereo, as training/data/audio.py reads it). The latent is cut to the audio length ComfyUI's H3
    nodes give a clip of as many frames (``EmptyMiniMaxH3LatentAV``: ``round(frames / 24 x 40)``), which the
    encoder's right padding can exceed by one. H3 samples 24 fps video only, so other dataset frame rates are refused."""

    def __init__(self, model: object):
        self.model = model
        self.rate = int(model.sample_rate)
        self.channels = 2

    @staticmethod
    def accepts(model: object) -> bool:
        try:
            from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
        except ImportError:
            return False
        return isinstance(model, MiniMaxH3AudioVAE)

    def latent_frames(self, frames: int) -> int:
        """Audio latent frames of a clip of ``frames`` video frames: the DiT's ``FRAME_RESCALE`` (5/3 audio latent
        frames a video frame), as ``EmptyMiniMaxH3LatentAV`` sizes the audio (``round(frames / 24 x 40)``)."""
        from comfy.ldm.minimax.model import FRAME_RESCALE

        return round(frames * FRAME_RESCALE)

    def video_fps(self) -> float:
        """The video rate H3 samples: the audio VAE's latent rate over ``FRAME_RESCALE`` (40 / (5/3) = 24)."""
        from comfy.ldm.minimax.model import FRAME_RESCALE

        return self.model.latents_per_second / FRAME_RESCALE

    def encode(self, waveform: torch.Tensor, rate: int, frames: int, fps: float) -> torch.Tensor:
        return self._encode(self._stereo_at_rate(waveform, rate))[..., :self.latent_frames(frames)]

    def encode_whole(self, waveform: torch.Tensor, rate: int) -> torch.Tensor:
        """``[32, 2, Ta]`` of all of ``waveform`` ``[ch, n]``, as the H3 nodes encode a reference or guide audio
        (``_encode_ref_audio``: resampled to the VAE's rate, then ``VAE.encode``, whose input crop keeps the centred
        whole latent frames, ``n // 800 * 800`` samples from ``n % 800 // 2``; no cut to any clip)."""
        waveform = self._stereo_at_rate(waveform, rate)
        hop = int(self.model.samples_per_latent)
        whole = waveform.shape[-1] // hop * hop
        if whole == 0:
            raise ValueError(f"it is shorter than one audio latent frame ({hop} samples at {self.rate} Hz).")
        start = waveform.shape[-1] % hop // 2
        return self._encode(waveform[:, start:start + whole])

    def _stereo_at_rate(self, waveform: torch.Tensor, rate: int) -> torch.Tensor:
        from ..data.resample import resample

        if rate != self.rate:
            waveform = resample(waveform[None], rate, self.rate)[0]
        return waveform.expand(2, -1) if waveform.shape[0] == 1 else waveform

    def _encode(self, waveform: torch.Tensor) -> torch.Tensor:
        param = next(self.model.parameters())
        with torch.no_grad():
            latent = self.model.encode(waveform[None].to(device=param.device, dtype=param.dtype))
        return latent[0].float().cpu()

    def silence(self, seconds: float) -> tuple[torch.Tensor, int]:
        return torch.zeros(self.channels, max(1, round(seconds * self.rate))), self.rate

    def problems(self, fps: float) -> list[str]:
        video = self.video_fps()
        if abs(fps - video) > 1e-6:
            return [f"MiniMax-H3 makes {video:g} fps video with its sound ({video:g} frames to "
                    f"{self.model.latents_per_second} audio latent frames): set the Dataset node's fps to {video:g} "
                    f"(it is {fps:g})."]
        return []

    def identity(self) -> dict:
        return {"encode": "plain-torch resample; ComfyUI's MiniMaxH3AudioVAE.encode, cut to round(frames / 24 x 40)"}


_KINDS = (LTX2AudioCodec, MiniMaxH3AudioCodec)


def codec_for(vae: object) -> AudioCodec:
    """The codec of the VAE object a ComfyUI loader gave (its ``first_stage_model``), or an error naming the loaders."""
    model = getattr(vae, "first_stage_model", vae)
    for kind in _KINDS:
        if kind.accepts(model):
            return kind(model)
    raise ValueError(f"{type(model).__name__} is not an audio VAE PipeTrainer can cache with: connect LTX-2's audio VAE "
                     "('LTXV Audio VAE Loader') or MiniMax-H3's audio VAE ('Load VAE') to the Cache node's audio_vae input.")
