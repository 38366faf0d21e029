"""Reading sources into bucket-sized pixels: images with Pillow, videos with PyAV.

Videos are resampled to a fixed frame rate by time, not by frame index, so a 30 fps and a 24 fps clip
of the same motion give the same frames; a clip is cut to its frame bucket (1 or step·k+1 frames, the VAE's rule).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps

from .buckets import Bucket


def fit_pixels(img: Image.Image, bucket: Bucket, mode: str = "RGB") -> np.ndarray:
    """``img`` in ``mode`` resized to cover the bucket and center-cropped, floats in [0, 1]: the one fit
    every item, reference and loss mask (masks.py) goes through, so a mask lines up with its image."""
    img = ImageOps.fit(img.convert(mode), (bucket.width, bucket.height), method=Image.Resampling.LANCZOS)
    return np.asarray(img, dtype=np.float32) / 255.0


def _fit(img: Image.Image, bucket: Bucket) -> np.ndarray:
    return fit_pixels(img, bucket)


def load_image(path: str, bucket: Bucket) -> torch.Tensor:
    """RGB resized to cover the bucket and center-cropped: ``[1, H, W, 3]`` floats in [0, 1]."""
    with Image.open(path) as img:
        return torch.from_numpy(_fit(ImageOps.exif_transpose(img), bucket))[None]


def load_video(path: str, bucket: Bucket, fps: float) -> torch.Tensor:
    """``bucket.frames`` frames sampled every ``1/fps`` seconds from the start: ``[F, H, W, 3]``."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        decoded = [(float(f.time), f.to_image()) for f in container.decode(stream) if f.time is not None]
    if not decoded:
        raise ValueError("the video has no decodable frames")
    decoded.sort(key=lambda tf: tf[0])
    start = decoded[0][0]
    out, j = [], 0
    for k in range(bucket.frames):
        t = start + k / fps + 1e-6
        while j + 1 < len(decoded) and decoded[j + 1][0] <= t:
            j += 1
        out.append(_fit(decoded[j][1], bucket))
    return torch.from_numpy(np.stack(out))
