"""Aspect-ratio, resolution and frame buckets (pure arithmetic, no I/O).

Items of one bucket share a tensor shape, so a micro-batch can stack them. Ratios are spaced evenly
in log space (a 2:1 and a 1:2 bucket are equally far from square). Rounding every side to a multiple
can merge buckets or change their ratio; :func:`plan_buckets` reports that instead of hiding it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..data.dataset import BucketSettings, DatasetError

RATIO_NOTE_TOLERANCE = 0.1  # report buckets whose rounded ratio is off by more than ~10 %


@dataclass(frozen=True)
class Bucket:
    width: int
    height: int
    frames: int = 1

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"

    @property
    def log_ratio(self) -> float:
        return math.log(self.width / self.height)


@dataclass(frozen=True)
class BucketPlan:
    """The distinct spatial buckets per resolution, and what rounding did to the requested ones."""

    by_resolution: dict[int, tuple[Bucket, ...]]
    notes: tuple[str, ...]


def _ratios(settings: BucketSettings) -> list[float]:
    lo, hi = math.log(settings.min_ratio), math.log(settings.max_ratio)
    if settings.count == 1:
        return [1.0] if lo <= 0.0 <= hi else [math.exp((lo + hi) / 2)]
    return [math.exp(lo + (hi - lo) * i / (settings.count - 1)) for i in range(settings.count)]


def _round(value: float, multiple: int) -> int:
    return max(multiple, int(round(value / multiple)) * multiple)


def plan_buckets(settings: BucketSettings) -> BucketPlan:
    """Buckets of about ``resolution**2`` pixels for every requested ratio, rounded to the multiple."""
    problems = settings.problems()
    if problems:
        raise DatasetError("Bucket settings: " + " ".join(problems))
    by_res: dict[int, tuple[Bucket, ...]] = {}
    notes: list[str] = []
    for res in settings.resolutions:
        found: dict[tuple[int, int], float] = {}
        for r in _ratios(settings):
            dims = (_round(res * math.sqrt(r), settings.multiple), _round(res / math.sqrt(r), settings.multiple))
            if dims in found:
                notes.append(f"{res}px: ratio {r:.3f} rounds to {dims[0]}x{dims[1]}, the same bucket as ratio "
                             f"{found[dims]:.3f}; the buckets were merged (fewer buckets than requested).")
                continue
            found[dims] = r
            got = dims[0] / dims[1]
            if abs(math.log(got / r)) > RATIO_NOTE_TOLERANCE:
                notes.append(f"{res}px: ratio {r:.3f} rounds to {dims[0]}x{dims[1]} (ratio {got:.3f}) at multiples "
                             f"of {settings.multiple}; raise the resolution for closer buckets.")
        by_res[res] = tuple(Bucket(w, h) for w, h in sorted(found))
    return BucketPlan(by_res, tuple(notes))


def nearest_bucket(width: int, height: int, buckets: tuple[Bucket, ...]) -> Bucket:
    """The bucket whose aspect ratio is closest (in log space) to the source's."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(b.log_ratio - target), b.width))


def frame_bucket(available: int, max_frames: int, step: int = 4, usable=None) -> int:
    """Largest frame count of the form 1 or ``step``·k+1 that fits both the clip and ``max_frames``
    (``step``: the VAE's temporal compression, 4 for Wan/HunyuanVideo, 8 for LTX-Video, 1 for image VAEs), or
    ``usable(n)`` of that bound for a VAE with another rule (encoders.py ``vae_usable_frames``: MiniMax-H3's 17k+5)."""
    n = max(1, min(available, max_frames))
    if usable is not None:
        return usable(n)
    return (n - 1) // step * step + 1


def crop_fraction(width: int, height: int, bucket: Bucket) -> float:
    """Share of the source's area that a cover-resize and center crop into ``bucket`` discards."""
    src, dst = width / height, bucket.width / bucket.height
    return 1.0 - min(src, dst) / max(src, dst)
