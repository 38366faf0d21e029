"""A clip's sound for training: its audio track read with PyAV, at the encoder's rate, cut to the kept frames.

The Cache node keeps a video's frames at times ``start + k / fps`` for ``k < frames`` from the first decoded
frame (training/cache/media.py ``load_video``), so the frames cover ``[start, start + frames / fps)`` on the
file's timeline; :func:`kept_frames_span` gives that span and :func:`read_audio` cuts the track to it by the
track's own timestamps (so an audio stream that starts before or after the picture still lines up). Audio
is decoded to float32 planar at the track's own rate, its channels mapped the way ComfyUI's encoders do
(mono to stereo by copying, see the LTX-2 audio VAE's ``encode``; stereo to mono by the mean, see ComfyUI's
Whisper features), then resampled with resample.py (ComfyUI's filter, without torchaudio) and cut at the
target rate. Standalone audio files (dataset.py ``AUDIO_EXTENSIONS``) read the same way, whole or cut.

A clip without sound is a state of the result, not an exception: ``NO_TRACK`` (no audio stream PyAV can
decode) or ``SILENT`` (a track whose kept span is digital silence); the family decides whether such a
clip trains with its "no audio" input or is refused.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from .resample import ROLLOFF, ZERO_CROSSINGS, resample

SOUND, SILENT, NO_TRACK = "sound", "silent", "no_track"
SILENCE_PEAK = 1e-4  # -80 dBFS: below this everywhere in the span, the clip counts as silent
_MARGIN_S = 0.25  # decoded past the span's end, so the resampling filter sees real neighbours there


@dataclass(frozen=True)
class AudioSpan:
    """Seconds on the file's timeline: from ``start`` for ``duration`` (None: to the end of the track)."""

    start: float = 0.0
    duration: float | None = None

    @property
    def end(self) -> float:
        return math.inf if self.duration is None else self.start + self.duration


@dataclass(frozen=True)
class ClipAudio:
    """The audio of one item. ``samples``: float32 ``[channels, n]`` at ``sample_rate`` (``n == 0`` for
    ``NO_TRACK``); ``padded``: samples of the span the track does not reach, filled with zeros; ``source_rate``
    and ``source_channels``: the track's own (0 without one); ``note``: why there is no sound, for reports."""

    state: str
    samples: torch.Tensor
    sample_rate: int
    source_rate: int = 0
    source_channels: int = 0
    padded: int = 0
    note: str = ""

    @property
    def has_sound(self) -> bool:
        return self.state == SOUND


def kept_frames_span(first_frame_time: float, frames: int, fps: float, start_frame: int = 0) -> AudioSpan:
    """The time the kept frames cover: frames ``start_frame .. start_frame + frames - 1`` sampled every
    ``1/fps`` seconds from the clip's first frame, each lasting ``1/fps``."""
    if frames < 1 or not fps > 0 or start_frame < 0:
        raise ValueError(f"Kept frames need frames >= 1, fps > 0 and start_frame >= 0 "
                         f"(got {frames}, {fps}, {start_frame}).")
    return AudioSpan(first_frame_time + start_frame / fps, frames / fps)


def first_frame_time(path: str) -> float:
    """The time of the video's first frame, the origin ``load_video`` samples from (decoders hand frames
    out in presentation order, so the first one with a time is the earliest)."""
    import av

    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError(f"{path} has no video stream: kept frames need a video (give an AudioSpan instead).")
        for frame in container.decode(container.streams.video[0]):
            if frame.time is not None:
                return float(frame.time)
    raise ValueError(f"{path} has no decodable video frames: replace the file with a good copy.")


def audio_stream(container):
    """The audio stream ComfyUI's video loader takes: the last one FFmpeg has a decoder for (a phone's
    extra spatial-audio track has none), or None."""
    return next((s for s in reversed(container.streams.audio) if s.codec_context is not None), None)


def track_problem(path: str) -> str | None:
    """Why ``path`` has no audio track to train on, or None (opens the container only: no decoding)."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.audio:
                return "the file has no audio track"
            if audio_stream(container) is None:
                return "its audio track has a codec FFmpeg cannot decode"
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None


def _decode(path: str, span: AudioSpan) -> tuple[np.ndarray, float, int] | str:
    """The track's samples from its start to a little past ``span`` as float32 ``[channels, n]``, the time of
    the first one and the track's rate; or why there are none. Decoding always starts at the track's first
    sample: the resampled grid then sits at the same instants whatever the span, so two spans of one track
    cut the same samples where they overlap (a clip's kept frames start at its first frame anyway)."""
    import av

    with av.open(path) as container:
        stream = audio_stream(container)
        if stream is None:
            return "no audio track" if not container.streams.audio else "an audio track FFmpeg cannot decode"
        to_float = av.audio.resampler.AudioResampler(format="fltp")  # same layout and rate: a format change only
        chunks, t0, rate = [], None, 0
        for packet in container.demux(stream):
            try:
                decoded = packet.decode()
            except av.error.InvalidDataError:
                continue
            for frame in decoded:
                if frame.time is None or frame.samples == 0:
                    continue
                rate = frame.sample_rate
                if frame.time > span.end + _MARGIN_S:
                    return _joined(chunks), t0, rate
                for out in to_float.resample(frame):
                    t0 = float(frame.time) if t0 is None else t0
                    chunks.append(out.to_ndarray())
        return (_joined(chunks), t0, rate) if chunks else "an audio track without decodable sound"


def _joined(chunks: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(chunks, axis=1), dtype=np.float32)


def _channels(samples: torch.Tensor, channels: int, path: str) -> torch.Tensor:
    have = samples.shape[0]
    if have == channels:
        return samples
    if channels == 1:
        return samples.mean(dim=0, keepdim=True)
    if have == 1:
        return samples.expand(channels, -1).clone()
    raise ValueError(f"{path} has {have} audio channels and the encoder takes {channels}: mix the track down "
                     f"to {channels} (e.g. ffmpeg -ac {channels}) or to mono.")


def _cut(samples: torch.Tensor, t0: float, rate: int, span: AudioSpan) -> tuple[torch.Tensor, int]:
    """``samples`` (first one at ``t0``) cut to ``span`` at ``rate``, zero-filled where the track does not
    reach, and the count of filled samples. The cut starts at the grid sample nearest ``span.start`` (half a
    sample at most from it: exact when the track and the span start on the grid, as a clip's usually do)."""
    first = round((span.start - t0) * rate)
    count = samples.shape[1] - first if span.duration is None else round(span.duration * rate)
    count = max(count, 0)
    kept = samples[:, max(first, 0): max(first + count, 0)]
    front = min(max(-first, 0), count)
    back = count - front - kept.shape[1]
    if front or back:
        kept = torch.nn.functional.pad(kept, (front, back))
    return kept, front + back


def read_audio(path: str, rate: int, channels: int, span: AudioSpan | None = None) -> ClipAudio:
    """The audio track of ``path`` as float32 ``[channels, n]`` at ``rate`` Hz, cut to ``span`` (default:
    the whole track from its first sample). A file without a decodable track gives ``NO_TRACK``, a span
    of digital silence ``SILENT``; a span the track does not fully reach is zero-filled and counted."""
    if channels not in (1, 2):
        raise ValueError(f"Audio is read as mono or stereo (channels 1 or 2, got {channels}).")
    decoded = _decode(path, span or AudioSpan())
    if isinstance(decoded, str):
        return ClipAudio(NO_TRACK, torch.zeros(channels, 0), rate, note=decoded)
    array, t0, source_rate = decoded
    samples = _channels(torch.from_numpy(array), channels, path)
    samples = resample(samples, source_rate, rate)
    padded = 0
    if span is not None:
        samples, padded = _cut(samples, t0, rate, span)
    silent = samples.numel() == 0 or float(samples.abs().max()) < SILENCE_PEAK
    return ClipAudio(SILENT if silent else SOUND, samples.contiguous(), rate, source_rate, array.shape[0], padded,
                     note="the audio track is silent over the kept frames" if silent else "")


def read_clip_audio(path: str, rate: int, channels: int, frames: int, fps: float, start_frame: int = 0) -> ClipAudio:
    """:func:`read_audio` cut to the frames the Cache node keeps of the video at ``path``."""
    return read_audio(path, rate, channels, kept_frames_span(first_frame_time(path), frames, fps, start_frame))


def audio_preprocessing(rate: int, channels: int, span: AudioSpan | None = None) -> dict:
    """What :func:`read_audio` does to a track, as the audio cache key's preprocessing part
    (training/cache/keys.py ``audio_key``): the target rate and channels, the cut (to the microsecond) and
    the resampling filter, so a change to any of them re-encodes."""
    span = span or AudioSpan()
    return {"rate": int(rate), "channels": int(channels), "start": round(span.start, 6),
            "duration": None if span.duration is None else round(span.duration, 6),
            "resampler": f"sinc-hann-{ZERO_CROSSINGS}-{ROLLOFF}"}


def track_digest(path: str) -> str:
    """The content identity of the audio track alone: its codec parameters and the bytes of its packets
    (a re-muxed or re-encoded picture leaves it alone; a new track, a trim or another codec changes it).
    ``""`` when the file has no decodable audio track."""
    import av

    h = hashlib.blake2b(digest_size=20)
    with av.open(path) as container:
        stream = audio_stream(container)
        if stream is None:
            return ""
        ctx = stream.codec_context
        h.update(f"{ctx.name}|{ctx.sample_rate}|{ctx.channels}|{stream.time_base}\n".encode())
        for packet in container.demux(stream):
            if packet.size:
                h.update(f"{packet.pts}|{packet.size}\n".encode())
                h.update(bytes(packet))
    return h.hexdigest()
