"""The Cache node's audio VAE input: each clip's sound, encoded into its latent entry for families that train on it.

With an audio VAE connected (LTX-2's, from ``LTXVAudioVAELoader``), every item's latent entry gets
``audio_latent``: the clip's audio track read at the VAE's rate and channels and cut to the frames the cache
keeps (training/data/audio.py), encoded as ComfyUI's ``AudioVAE.encode`` does (:mod:`.audio_latent`). The
latent key gets an ``audio`` component, ``keys.audio_key`` of the track's content digest, the audio
preprocessing and the audio VAE's identity, so a changed track (or audio VAE) re-encodes its item only; the
cut span follows the latent key's own frame count and frame rate. An image, or a clip without sound (no
track, or silence over the kept frames), gets the encoding of digital silence of its kept span
(:mod:`.audio_latent` says why silence and not the empty latent).
"""

from __future__ import annotations

import os

import torch

from ..data.audio import SOUND, audio_preprocessing, read_clip_audio, track_digest
from .audio_latent import audio_settings, audio_vae_of, encode_audio, silence
from .buckets import Bucket
from .keys import audio_key

AUDIO_LATENT = "audio_latent"  # the extra the LTX-2 family joins to the video latent
SILENCE_TRACK = "silence"  # the track identity of an item without sound
# What of this encode changes the cached latent besides the weights: bump "v" when the steps change.
_IDENTITY = {"encode": "plain-torch resample and log-mel; ComfyUI's autoencoder mode and normalizer",
             "without_sound": "encoded silence", "v": 1}


class ClipSound:
    """Per item: the ``audio`` part of the latent key (:meth:`key_part`) and the encoded ``audio_latent``
    (:meth:`encode`); inert without an audio VAE."""

    def __init__(self, audio_vae=None):
        self.vae = audio_vae_of(audio_vae) if audio_vae is not None else None
        self._dtype = str(getattr(audio_vae, "vae_dtype", ""))
        self.without_track: dict[str, None] = {}  # clips keyed so far that have no audio track, in order

    def note(self) -> str | None:
        """The Cache report's line on the clips without a sound track (None when there are none)."""
        names = [os.path.basename(p) for p in self.without_track]
        if not names:
            return None
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return (f"{len(names)} clip(s) have no sound track and train on encoded silence of their kept span: "
                f"{', '.join(names[:3])}{more}")

    @property
    def active(self) -> bool:
        return self.vae is not None

    def identity(self) -> dict:
        from .encoders import weights_fingerprint

        return {"weights": weights_fingerprint(self.vae), "dtype": self._dtype, **_IDENTITY}

    def key_part(self, entry) -> dict:
        """``{"audio": key}`` for the latent key of ``entry`` (a Dataset item), ``{}`` without an audio VAE."""
        if not self.active:
            return {}
        s = audio_settings(self.vae)
        track = (track_digest(entry.path) if entry.is_video else "") or SILENCE_TRACK
        if entry.is_video and track == SILENCE_TRACK:
            self.without_track[entry.path] = None
        return {"audio": audio_key(track, audio_preprocessing(s["rate"], s["channels"]), self.identity())}

    def waveform(self, entry, bucket: Bucket, fps: float) -> tuple[torch.Tensor, int]:
        """``(samples [ch, n], rate)`` the item's audio latent encodes: its kept span, or silence as long."""
        s = audio_settings(self.vae)
        if entry.is_video:
            clip = read_clip_audio(entry.path, s["rate"], s["channels"], bucket.frames, fps)
            if clip.state == SOUND:
                return clip.samples, clip.sample_rate
        return silence(self.vae, bucket.frames / fps)

    def encode(self, entry, bucket: Bucket, fps: float) -> dict[str, torch.Tensor]:
        if not self.active:
            return {}
        samples, rate = self.waveform(entry, bucket, fps)
        return {AUDIO_LATENT: encode_audio(self.vae, samples, rate).contiguous()}
