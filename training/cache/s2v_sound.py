"""The Cache node's audio encoder input: each clip's sound and reference image, as ComfyUI's S2V graph conditions on them.

Wan 2.2 S2V (training/pipelines/wan_s2v.py) is sampled with ``AudioEncoderEncode`` (ComfyUI's wav2vec2 on the
soundtrack, every hidden layer) feeding ``WanSoundImageToVideo``, which maps the features to 4 audio slots per
latent frame of a 16 fps video (``audio_embed``) and VAE-encodes its ``ref_image``. With an audio encoder
connected, every item's latent entry gets

- ``audio_embed`` ``[layers, width, 4 * latent frames]``: the clip's audio track, read with PyAV at the
  encoder's 16 kHz in mono (the encoder averages the channels first) and cut to the audio window of the
  kept frames (training/data/audio.py): from the first kept frame for ``4 * latent frames`` frames at
  16 fps, the kept frames plus the 3 slots past the last one the node reads; run through ComfyUI's own
  audio encoder model (:func:`encoder_output`: ``AudioEncoderModel.encode_audio`` without its resample,
  done at the same filter when the track is read: training/data/resample.py, no torchaudio needed) and
  then through ``WanSoundImageToVideo`` itself (:func:`audio_embed`);
- ``s2v_reference`` ``[C, 1, h, w]``: the clip's first frame at its bucket (the frame the training latent
  starts with, as the start-image path takes it: start_image.py) encoded with the graph's VAE, then the Wan
  2.1 ``process_in`` that ``WAN22_S2V.extra_conds`` applies to ``reference_latents``.

Both are stored as the model receives them (float32), so the trainer applies nothing.

A clip without sound (no audio track, or digital silence over the window) and an image get the encoding
of digital silence of the window: what ``AudioEncoderEncode`` gives for that clip's own silent track. The
Cache report names the clips without a track (:meth:`S2VSound.note`).

The latent key gets an ``s2v`` component (``keys.audio_components``: the track's content digest, the
audio preprocessing and the encoder's identity: weights fingerprint, dtype, class, rate, plus the window
and node steps), so a changed track or encoder re-encodes its item only; the window follows the latent
key's own frame count and frame rate. Refused: a frame rate other than 16 fps (``WanSoundImageToVideo``
aligns audio to 16 fps video) and flip (the mirrored latent would need a mirrored reference).
"""

from __future__ import annotations

import torch

from ..data.audio import SOUND, audio_preprocessing, read_clip_audio
from .buckets import Bucket
from .keys import audio_components

AUDIO_EMBED = "audio_embed"  # the extras the Wan S2V family reads
S2V_REFERENCE = "s2v_reference"
S2V_FPS = 16.0  # WanSoundImageToVideo's video rate for the audio slots
AUDIO_SLOTS = 4  # audio_embed slots per latent frame
S2V_SOUND_FIX = ("connect the S2V workflow's audio encoder (wav2vec2, 'Load Audio Encoder') to the audio_encoder "
                 "input of 'Cache Latents & Text', set the Dataset's fps to 16, and cache again")
# What of this encode changes the cached extras besides the weights: bump "v" when the steps change.
_IDENTITY = {"node": "WanSoundImageToVideo", "window": "4 slots per latent frame at 16 fps from the first kept frame",
             "channels": "mono mean", "without_sound": "encoded silence",
             "reference": "first frame, VAE, Wan21 process_in", "v": 1}


def window_frames(frames: int) -> int:
    """Video frames at 16 fps the audio of a ``frames``-frame clip covers: 4 per latent frame."""
    return ((frames - 1) // 4 + 1) * AUDIO_SLOTS


def encoder_of(audio_encoder: object) -> object:
    """ComfyUI's ``AudioEncoderModel`` with a wav2vec2 model (what S2V is sampled with), or a clear error."""
    model = getattr(audio_encoder, "model", None)
    if model is None or not hasattr(audio_encoder, "patcher"):
        raise ValueError(f"{type(audio_encoder).__name__} is not an audio encoder: connect the one 'Load Audio "
                         "Encoder' loads (wav2vec2) to the audio_encoder input of 'Cache Latents & Text'.")
    if type(model).__name__ != "Wav2Vec2Model":
        raise ValueError(f"The connected audio encoder is {type(model).__name__}; Wan 2.2 S2V is conditioned on "
                         "wav2vec2 features: load the S2V workflow's wav2vec2 file with 'Load Audio Encoder'.")
    return audio_encoder


def encoder_output(audio_encoder, samples: torch.Tensor) -> dict:
    """What ``AudioEncoderEncode`` outputs for the mono waveform ``samples`` (``[1, n]``) already at the encoder's
    rate: ``AudioEncoderModel.encode_audio``'s steps after its resample (an identity at equal rates)."""
    import comfy.model_management

    comfy.model_management.load_model_gpu(audio_encoder.patcher)
    audio = samples[None]
    out, all_layers = audio_encoder.model(audio.to(audio_encoder.load_device))
    return {"encoded_audio": out, "encoded_audio_all_layers": all_layers, "audio_samples": audio.shape[2]}


def audio_embed(output: dict, frames: int, width: int = 16, height: int = 16) -> torch.Tensor:
    """``[layers, width, 4 * latent frames]``: the ``audio_embed`` ``WanSoundImageToVideo`` (length ``frames``, no
    reference, control or motion) puts into the positive conditioning for the encoder ``output``."""
    from comfy_extras.nodes_wan import WanSoundImageToVideo

    carrier = [[torch.zeros(1, 1, 1), {}]]  # a conditioning the node adds its values to
    out = WanSoundImageToVideo.execute(carrier, [], None, width, height, frames, 1, audio_encoder_output=output)
    positive = (out.result if hasattr(out, "result") else out)[0]
    return positive[0][1][AUDIO_EMBED][0].to(torch.float32).cpu().contiguous()


def reference_latent(first_latent: torch.Tensor) -> torch.Tensor:
    """``[C, 1, h, w]``: the raw VAE latent of the first frame after ``WAN22_S2V.extra_conds``' ``process_latent_in``
    (the Wan 2.1 latent format, S2V's)."""
    import comfy.latent_formats

    raw = first_latent if first_latent.ndim == 4 else first_latent.unsqueeze(1)  # an image VAE's [C, h, w]
    return comfy.latent_formats.Wan21().process_in(raw[None].to(torch.float32))[0].cpu().contiguous()


class S2VSound:
    """Per item: the ``s2v`` part of the latent key (:meth:`key_part`) and the extras (:meth:`encode`); inert
    without an audio encoder."""

    def __init__(self, audio_encoder=None):
        self.encoder = encoder_of(audio_encoder) if audio_encoder is not None else None
        self.without_track: dict[str, None] = {}  # clips keyed so far that have no audio track, in order
        self._identity: dict | None = None

    @property
    def active(self) -> bool:
        return self.encoder is not None

    @property
    def rate(self) -> int:
        return int(self.encoder.model_sample_rate)

    def problems(self, fps: float | None, flip: str = "none") -> list[str]:
        """Settings the cache cannot honour, phrased as the fix."""
        if not self.active:
            return []
        out = []
        if fps is not None and abs(float(fps) - S2V_FPS) > 1e-6:
            out.append(f"Wan 2.2 S2V aligns the soundtrack to 16 fps video (WanSoundImageToVideo), and the Dataset "
                       f"node reads clips at {float(fps):g} fps: set the Dataset's fps to 16.")
        if flip != "none":
            out.append("flip cannot be combined with S2V sound (the reference image would need the same mirror): "
                       "set the Dataset's flip to 'none'.")
        return out

    def note(self) -> str | None:
        """The Cache report's line on the clips without a sound track (None when there are none)."""
        from .clip_sound import without_track_note

        return without_track_note(self.without_track, "train Wan S2V on the audio encoder's encoding of silence over "
                                                       "their frames")

    def identity(self) -> dict:
        """The encoder's identity: unpatched weights, dtype, class and rate, with this encode's steps."""
        if self._identity is None:
            from .encoders import _unpatched_weights, weights_fingerprint

            enc = self.encoder
            weights = weights_fingerprint(enc.model, _unpatched_weights(enc.patcher))
            self._identity = {"weights": weights, "dtype": str(enc.dtype), "class": type(enc.model).__name__,
                              "rate": self.rate, **_IDENTITY}
        return self._identity

    def key_part(self, entry) -> dict:
        """``{"s2v": components}`` for the latent key of ``entry`` (a Dataset item), ``{}`` without an encoder."""
        if not self.active:
            return {}
        from .clip_sound import track_of

        track = track_of(entry, self.without_track)
        return {"s2v": audio_components(track, audio_preprocessing(self.rate, 1), self.identity())}

    def waveform(self, entry, bucket: Bucket, fps: float) -> torch.Tensor:
        """``[1, n]`` at the encoder's rate: the item's audio window, or silence as long."""
        frames = window_frames(bucket.frames)
        if entry.is_video:
            clip = read_clip_audio(entry.path, self.rate, 1, frames, fps)
            if clip.state == SOUND:
                return clip.samples
        return torch.zeros(1, round(frames / fps * self.rate))

    def encode(self, entry, bucket: Bucket, fps: float, pixels: torch.Tensor, encode_latent) -> dict[str, torch.Tensor]:
        """The item's extras ({} without an encoder) from its bucket-sized ``pixels`` (``[F, H, W, C]``)."""
        if not self.active:
            return {}
        output = encoder_output(self.encoder, self.waveform(entry, bucket, fps))
        return {AUDIO_EMBED: audio_embed(output, bucket.frames, bucket.width, bucket.height),
                S2V_REFERENCE: reference_latent(encode_latent(pixels[:1, ..., :3]))}
