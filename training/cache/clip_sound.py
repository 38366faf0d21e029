"""The Cache node's audio VAE input: each clip's sound, encoded into its latent entry for families that train on it.

With an audio VAE connected (LTX-2's, from ``LTXVAudioVAELoader``; MiniMax-H3's, from ``VAELoader``), every item's
latent entry gets ``audio_latent``: the clip's audio track read at the VAE's rate and channels and cut to the frames
the cache keeps (training/data/audio.py), encoded as ComfyUI encodes with that VAE (:mod:`.audio_codecs`). The
latent key gets an ``audio`` component, ``keys.audio_key`` of the track's content digest, the audio
preprocessing and the audio VAE's identity, so a changed track (or audio VAE) re-encodes its item only; the
cut span follows the latent key's own frame count and frame rate. An image, or a clip without sound (no
track, or silence over the kept frames), gets the encoding of digital silence of its kept span
(:mod:`.audio_latent` says why silence and not the empty latent).
"""

from __future__ import annotations

import os

import torch

from ..data.audio import NO_TRACK, SOUND, audio_preprocessing, read_audio, read_clip_audio, track_digest
from .audio_codecs import codec_for
from .buckets import Bucket
from .keys import audio_key

AUDIO_LATENT = "audio_latent"  # the extra the LTX-2 and MiniMax-H3 families join to the video latent
GUIDE_AUDIO = "guide_audio"  # MiniMax-H3's audio guide at frame 0 (MiniMaxH3AddGuide), with audio_guide clip_sound
NO_GUIDE = "none"
AUDIO_GUIDES = (NO_GUIDE, "clip_sound")  # the Cache node's audio_guide choices
SILENCE_TRACK = "silence"  # the track identity of an item without sound
# What of this encode changes the cached latent besides the weights: bump "v" when the steps change.
_IDENTITY = {"without_sound": "encoded silence", "v": 1}


def track_of(entry, without_track: dict[str, None]) -> str:
    """The content identity of a Dataset item's audio track, for its cache key: :data:`SILENCE_TRACK` for an image or a
    clip without one (such a clip is remembered in ``without_track``, for the Cache report)."""
    track = (track_digest(entry.path) if entry.is_video else "") or SILENCE_TRACK
    if entry.is_video and track == SILENCE_TRACK:
        without_track[entry.path] = None
    return track


def without_track_note(paths, treatment: str) -> str | None:
    """The Cache report's line naming the clips (``paths``) that have no sound track and what they train on
    (``treatment``); None when there are none."""
    names = [os.path.basename(p) for p in paths]
    if not names:
        return None
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{len(names)} clip(s) have no sound track and {treatment}: {', '.join(names[:3])}{more}"


class ClipSound:
    """Per item: the ``audio`` part of the latent key (:meth:`key_part`) and the encoded ``audio_latent``
    (:meth:`encode`); inert without an audio VAE.

    ``guide`` ``clip_sound`` (the Cache node's ``audio_guide``) also encodes the same kept span as MiniMax-H3's
    ``MiniMaxH3AddGuide`` anchors an audio guide at frame 0: the whole span through ``encode_whole`` (``VAE.encode``'s
    crop to whole latent frames), cut to the clip's audio length, in ``guide_audio``: sound-driven video."""

    def __init__(self, audio_vae=None, guide: str = NO_GUIDE):
        if guide not in AUDIO_GUIDES:
            raise ValueError(f"audio_guide must be one of {', '.join(AUDIO_GUIDES)} (got {guide!r}).")
        if guide != NO_GUIDE and audio_vae is None:
            raise ValueError("audio_guide clip_sound encodes each clip's sound as an audio guide with the model's audio "
                             "VAE: connect it to the Cache node's audio_vae input, or set audio_guide to none.")
        self.guide = guide
        self.codec = codec_for(audio_vae) if audio_vae is not None else None
        if guide != NO_GUIDE and not hasattr(self.codec, "encode_whole"):
            raise ValueError("audio_guide is MiniMax-H3's (MiniMaxH3AddGuide) and this audio VAE is not: connect "
                             "MiniMax-H3's audio VAE ('Load VAE'), or set audio_guide to none.")
        self.vae = self.codec.model if self.codec is not None else None
        self._dtype = str(getattr(audio_vae, "vae_dtype", ""))
        self.without_track: dict[str, None] = {}  # clips keyed so far that have no audio track, in order

    def note(self) -> str | None:
        """The Cache report's line on the clips without a sound track (None when there are none)."""
        return without_track_note(self.without_track, "train on encoded silence of their kept span")

    @property
    def active(self) -> bool:
        return self.vae is not None

    def identity(self) -> dict:
        from .encoders import weights_fingerprint

        return {"weights": weights_fingerprint(self.vae), "dtype": self._dtype, **self.codec.identity(), **_IDENTITY}

    def problems(self, fps: float) -> list[str]:
        """What of the dataset the audio VAE's model cannot train on (none without an audio VAE)."""
        return self.codec.problems(fps) if self.active else []

    def key_part(self, entry) -> dict:
        """``{"audio": key}`` for the latent key of ``entry`` (a Dataset item), ``{}`` without an audio VAE."""
        if not self.active:
            return {}
        track = track_of(entry, self.without_track)
        guide = {"guide": {"mode": self.guide, "frame_idx": 0, "v": 1}} if self.guide != NO_GUIDE else {}
        return {"audio": audio_key(track, audio_preprocessing(self.codec.rate, self.codec.channels), self.identity()),
                **guide}

    def waveform(self, entry, bucket: Bucket, fps: float) -> tuple[torch.Tensor, int]:
        """``(samples [ch, n], rate)`` the item's audio latent encodes: its kept span, or silence as long."""
        if entry.is_video:
            clip = read_clip_audio(entry.path, self.codec.rate, self.codec.channels, bucket.frames, fps)
            if clip.state == SOUND:
                return clip.samples, clip.sample_rate
        return self.codec.silence(bucket.frames / fps)

    def encode(self, entry, bucket: Bucket, fps: float) -> dict[str, torch.Tensor]:
        if not self.active:
            return {}
        samples, rate = self.waveform(entry, bucket, fps)
        out = {AUDIO_LATENT: self.codec.encode(samples, rate, bucket.frames, fps).contiguous()}
        if self.guide != NO_GUIDE:
            out[GUIDE_AUDIO] = self._guide(samples, rate, bucket.frames)
        return out

    def _guide(self, samples: torch.Tensor, rate: int, frames: int) -> torch.Tensor:
        """``MiniMaxH3AddGuide``'s ``audio_latent`` for the clip's sound at frame 0: all of it encoded, cut to the
        clip's audio latent frames (``max_rt`` at frame 0)."""
        return self.codec.encode_whole(samples, rate)[..., :self.codec.latent_frames(frames)].contiguous()

    def encode_reference(self, path: str) -> torch.Tensor:
        """A reference audio file's latent ``[C, ch, Ta]``: the whole track at the audio VAE's rate and channels,
        encoded as MiniMax-H3's nodes encode ``ref_audio`` (not cut to any clip), or an error naming the file."""
        encode_whole = getattr(self.codec, "encode_whole", None)
        if encode_whole is None:
            raise ValueError(f"reference audio {os.path.basename(path)}: this audio VAE encodes clips only; reference "
                             "audio is MiniMax-H3's (connect its audio VAE to the Cache node's audio_vae).")
        sound = read_audio(path, self.codec.rate, self.codec.channels)
        if sound.state == NO_TRACK:
            raise ValueError(f"reference audio {os.path.basename(path)}: {sound.note}")
        try:
            return encode_whole(sound.samples, sound.sample_rate).contiguous()
        except ValueError as exc:
            raise ValueError(f"reference audio {os.path.basename(path)}: {exc}") from exc
