"""An item's reference videos and audio as one cache run reads them (MiniMax-H3's ``MiniMaxH3ReferenceToVideo``:
``ref_videos`` with their ``ref_video_audios``, and ``ref_audios``).

They come from the Dataset node's control folder (training/data/dataset.py): ``name_video.mp4``,
``name_video_1.mp4``... are reference videos, audio files reference audio, after the item's pictures in
``ImageEntry.references``. Only a reference-in-prompt style whose node takes them reads them
(``PromptStyle.max_videos`` / ``max_audio``); the node's policy stays the family's: the style's ``size_video`` sizes
and cuts a video for the item's clip and its ``conditioning`` puts the items into the prompt (:class:`VideoInPrompt`,
:class:`AudioInPrompt`: a video with its frames, an audio as a label only).

In the item's latent entry:

- ``ref_video_k``: the video latent of reference video ``k``'s frames as the style sized them, decoded as Load Video
  decodes them (the Cache node hands ComfyUI's own ``VideoFromFile`` in as ``read_video``: this package imports no
  ComfyUI server code; :class:`PyAVVideoReader` is PyAV's RGB decode for use outside ComfyUI) and, for a file at
  another frame rate than the dataset's, taken every ``1 / fps`` seconds (:func:`video_frames`);
- ``ref_video_audio_k``: its own sound track, when it has one (the node's same-numbered ``ref_video_audio``);
- ``ref_audio_j``: reference audio ``j``.

Each sound is the whole track, encoded with the Cache node's audio VAE as the node encodes it
(clip_sound.py ``encode_reference``). The files' digests join the latent key as every reference's do, and how they
are read joins it too (:meth:`ReferenceMedia.key_part`); the audio VAE's identity is already in every key with an
audio VAE, and the bucket's frame count, which cuts the videos, in its preprocessing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..data.audio import track_problem
from ..data.dataset import is_audio, is_video
from ..pipelines.base import reference_audio_extra, reference_video_audio_extra, reference_video_extra
from .buckets import Bucket
from .reference_prompt import AudioInPrompt, PromptStyle, VideoInPrompt, media_fix

_READING = {"audio": "whole file, the audio VAE's rate and channels", "v": 1}


class VideoReader(Protocol):
    """Decodes a video file: ``(frames [F, H, W, 3] in [0, 1], frame rate)``; its ``identity`` joins the cache key."""

    identity: str

    def __call__(self, path: str) -> tuple[torch.Tensor, float]: ...


class PyAVVideoReader:
    """Every frame decoded to 8-bit RGB with PyAV, and the average frame rate (outside ComfyUI's Load Video)."""

    identity = "pyav rgb24 v1"

    def __call__(self, path: str) -> tuple[torch.Tensor, float]:
        import av
        import numpy as np

        with av.open(path) as container:
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
            rate = float(stream.average_rate or 0) or 1.0
        if not frames:
            return torch.zeros(0, 0, 0, 3), rate
        return torch.from_numpy(np.stack(frames)).float() / 255.0, rate


def video_frames(path: str, fps: float, read_video: VideoReader) -> torch.Tensor:
    """A reference video's frames ``[F, H, W, 3]`` as ``read_video`` decodes them, every one for a file at ``fps``;
    for another rate, the frame shown every ``1 / fps`` seconds from the first."""
    images, rate = read_video(path)
    if images.shape[0] == 0:
        raise ValueError("the video has no decodable frames")
    if abs(rate - fps) < 1e-3:
        return images
    count = int((images.shape[0] - 1) * fps / rate + 1e-6) + 1
    return images[[min(images.shape[0] - 1, int(k * rate / fps + 1e-6)) for k in range(count)]]


def is_media(path: str) -> bool:
    """Whether a reference is a video or an audio file (not a picture)."""
    return is_audio(path) or is_video(path)


def media_problem(entries: Sequence[object], style: PromptStyle | None, sound_active: bool) -> str | None:
    """Why the items' reference videos or audio cannot be cached as asked (None: there are none, or they can)."""
    for kind, found, limit in (("audio", is_audio, "max_audio"), ("videos", is_video, "max_videos")):
        items = [os.path.basename(e.path) for e in entries if any(found(r) for r in e.references)]
        if not items:
            continue
        named = ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")
        if style is None or not getattr(style, limit):
            return f"{named} have reference {kind} in the control folder: {media_fix(kind)}"
        if not sound_active:
            return (f"{named} have reference {kind}, whose sound is encoded with the model's audio VAE: connect it "
                    "to the Cache node's audio_vae input.")
    return None


class ReferenceMedia:
    """The reference videos and audio of one cache run, read for ``style`` at the dataset's ``fps``."""

    def __init__(self, style: PromptStyle | None, fps: float, read_video: VideoReader | None = None):
        self.style = style
        self.fps = fps
        self.read_video = read_video or PyAVVideoReader()

    def key_part(self, paths: Sequence[str]) -> dict[str, object]:
        """What joins an item's latent key for its reference videos and audio (how they are read)."""
        out = {}
        if any(map(is_audio, paths)):
            out["reference_audio"] = _READING
        if any(map(is_video, paths)):
            out["reference_videos"] = {**_READING, "fps": self.fps, "decoded": self.read_video.identity}
        return out

    def frames(self, path: str, bucket: Bucket) -> torch.Tensor:
        """A reference video's frames as the style's node sizes and cuts them for ``bucket``'s clip."""
        try:
            return self.style.size_video(video_frames(path, self.fps, self.read_video), bucket.frames)
        except Exception as exc:  # noqa: BLE001 - named in the skip reason instead of the item's own file
            raise ValueError(f"reference video {os.path.basename(path)}: {type(exc).__name__}: {exc}") from exc

    def prompt_item(self, path: str, bucket: Bucket) -> AudioInPrompt | VideoInPrompt:
        if is_audio(path):
            return AudioInPrompt()
        return VideoInPrompt(self.frames(path, bucket), with_sound=track_problem(path) is None)

    def encode(self, paths: Sequence[str], bucket: Bucket, encode_latent: Callable[[torch.Tensor], torch.Tensor],
               encode_audio: Callable[[str], torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The latents of the reference videos (and their tracks) and of the reference audio, each error naming its
        file."""
        out = {}
        for k, path in enumerate(p for p in paths if is_video(p)):
            out[reference_video_extra(k)] = encode_latent(self.frames(path, bucket))
            if track_problem(path) is None:
                out[reference_video_audio_extra(k)] = encode_audio(path)
        for j, path in enumerate(p for p in paths if is_audio(p)):
            out[reference_audio_extra(j)] = encode_audio(path)
        return out
