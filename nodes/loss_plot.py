"""A small loss-curve picture (raw loss and a moving average), as a PIL image or an IMAGE tensor."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw


def loss_curve(losses: list[float], width: int = 640, height: int = 320) -> Image.Image:
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    m = 40
    d.line([(m, 10), (m, height - m), (width - 10, height - m)], fill="black", width=1)
    if not losses:
        d.text((m + 10, height // 2), "no steps yet", fill="black")
        return img
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or 1.0
    n = len(losses)

    def point(i: int, v: float) -> tuple[float, float]:
        x = m + (width - m - 10) * (i / max(1, n - 1))
        y = 10 + (height - m - 10) * (1 - (v - lo) / span)
        return x, y

    if n > 1:
        d.line([point(i, v) for i, v in enumerate(losses)], fill=(150, 170, 230), width=1)
        k = max(1, n // 20)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        d.line([point(i + k - 1, v) for i, v in enumerate(smooth)], fill=(20, 60, 200), width=2)
    d.text((4, 6), f"{hi:.3f}", fill="black")
    d.text((4, height - m - 6), f"{lo:.3f}", fill="black")
    d.text((width // 2 - 40, height - m + 8), f"step {n}  loss {losses[-1]:.4f}", fill="black")
    return img


def as_image_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]
