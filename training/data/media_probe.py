"""What a source file is, for bucketing and pairing: its size and, for a video, how long it runs.

Data-level (the dataset scan pairs control clips by length) and used by the cache (the probe is kept in
its index so revalidation skips the file); it depends on nothing of the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image, ImageOps


@dataclass(frozen=True)
class Probe:
    """What bucketing needs to know about a source, kept in the index so revalidation skips the file."""

    width: int
    height: int
    duration: float = 0.0  # seconds of video; 0 for images

    def frames_at(self, fps: float) -> int:
        """Frames available when sampling every ``1/fps`` seconds (1 for an image)."""
        return max(1, int(math.floor(self.duration * fps + 1e-6)))


def probe_image(path: str) -> Probe:
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        img.load()  # decode once: a truncated file fails here, not during encoding
        return Probe(*img.size)


def probe_video(path: str) -> Probe:
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        times = [float(f.time) for f in container.decode(stream) if f.time is not None]
        width, height = stream.codec_context.width, stream.codec_context.height
    if not times:
        raise ValueError("the video has no decodable frames")
    step = 1.0 / float(stream.average_rate) if stream.average_rate else 0.0
    duration = max(times) - min(times) + step
    return Probe(width, height, duration)


def probe_audio(path: str) -> Probe:
    """An audio file (a reference audio): no picture, its duration; an error when PyAV finds no audio track."""
    import av

    with av.open(path) as container:
        if not container.streams.audio:
            raise ValueError("the file has no audio track")
        duration = float(container.duration) / av.time_base if container.duration else 0.0
    return Probe(0, 0, duration)
