"""A small loss-curve picture (raw loss and a moving average), as a PIL image or an IMAGE tensor.

The x axis is the run's own step numbers (a resumed run starts at its checkpoint's step, as the
progress text does), labelled at both ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

VALIDATION_COLOUR = (230, 110, 20)


def loss_curve(losses: Sequence[float], steps: Sequence[int] | None = None, width: int = 640,
               height: int = 320, validation: Sequence[tuple[int, float]] = ()) -> Image.Image:
    """``losses[i]`` drawn at step ``steps[i]`` (default: steps 1, 2, ...); ``validation`` (step, loss)
    pairs on the same axes, in orange (a step-0 point is the base model's loss)."""
    steps = list(range(1, len(losses) + 1)) if steps is None else list(steps)
    if len(steps) != len(losses):
        raise ValueError(f"{len(losses)} losses but {len(steps)} steps")
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    m = 40
    d.line([(m, 10), (m, height - m), (width - 10, height - m)], fill="black", width=1)
    if not losses:
        d.text((m + 10, height // 2), "no steps yet", fill="black")
        return img
    values = list(losses) + [v for _, v in validation]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    first, last = min([steps[0], *(s for s, _ in validation)]), steps[-1]

    def point(step: float, v: float) -> tuple[float, float]:
        x = m + (width - m - 10) * ((step - first) / max(1, last - first))
        y = 10 + (height - m - 10) * (1 - (v - lo) / span)
        return x, y

    if len(losses) > 1:
        d.line([point(s, v) for s, v in zip(steps, losses, strict=True)], fill=(150, 170, 230), width=1)
        k = max(1, len(losses) // 20)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        d.line([point(steps[i + k - 1], v) for i, v in enumerate(smooth)], fill=(20, 60, 200), width=2)
    if validation:
        points = [point(s, v) for s, v in validation]
        if len(points) > 1:
            d.line(points, fill=VALIDATION_COLOUR, width=2)
        for x, y in points:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=VALIDATION_COLOUR)
        d.text((width - 170, 6), f"validation {validation[-1][1]:.4f}", fill=VALIDATION_COLOUR)
    d.text((4, 6), f"{hi:.3f}", fill="black")
    d.text((4, height - m - 6), f"{lo:.3f}", fill="black")
    d.text((m, height - m + 4), str(first), fill="black")
    d.text((width - 10 - 6 * len(str(last)), height - m + 4), str(last), fill="black")
    d.text((width // 2 - 40, height - m + 18), f"step {last}  loss {losses[-1]:.4f}", fill="black")
    return img


def as_image_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]
