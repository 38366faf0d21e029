"""Scanning a folder of images and videos with same-name ``.txt`` captions (pure Python).

The missing-caption policy is explicit: ``error`` names every file without a caption, ``skip`` drops
them, ``empty`` trains them with an empty caption; both of the latter are counted in the report.
The bucket settings (aspect ratios, resolutions, video frames and fps) travel with the dataset so the
cache can place every item; see ``cache/buckets.py`` for the arithmetic.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
CAPTION_POLICIES = ("error", "skip", "empty")


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class ImageEntry:
    """One source file (image or video) and its caption."""

    path: str
    caption: str

    @property
    def is_video(self) -> bool:
        return self.path.lower().endswith(VIDEO_EXTENSIONS)


@dataclass(frozen=True)
class BucketSettings:
    """Aspect-ratio buckets (log-spaced between ``min_ratio`` and ``max_ratio``, width/height), the
    training resolutions (each item is cached once per resolution), the pixel multiple every bucket
    side is rounded to, and video frame buckets (1 and 4k+1 frames up to ``max_frames`` at ``fps``)."""

    resolutions: tuple[int, ...]
    min_ratio: float = 1.0
    max_ratio: float = 1.0
    count: int = 1
    multiple: int = 16
    max_frames: int = 33
    fps: float = 16.0

    def problems(self) -> list[str]:
        out = []
        if not self.resolutions:
            out.append("Give at least one training resolution.")
        for res in self.resolutions:
            if res < self.multiple:
                out.append(f"Resolution {res} is smaller than the bucket multiple {self.multiple}: raise it.")
        if not 0 < self.min_ratio <= 1.0 <= self.max_ratio:
            out.append(f"Aspect ratios need 0 < min_ratio <= 1 <= max_ratio (got {self.min_ratio}, {self.max_ratio}).")
        if self.count < 1:
            out.append(f"Bucket count must be at least 1 (got {self.count}).")
        if self.multiple < 1:
            out.append(f"Bucket multiple must be at least 1 (got {self.multiple}).")
        if self.max_frames < 1:
            out.append(f"max_frames must be at least 1 (got {self.max_frames}).")
        if not self.fps > 0:
            out.append(f"fps must be positive (got {self.fps}).")
        return out


@dataclass(frozen=True)
class DatasetSpec:
    """What the Dataset node hands to the Cache node."""

    folder: str
    entries: tuple[ImageEntry, ...]
    resolution: int
    repeats: int = 1
    skipped: tuple[str, ...] = ()
    empty_captions: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    buckets: BucketSettings | None = None

    @property
    def bucket_settings(self) -> BucketSettings:
        """The explicit settings, or one square bucket at ``resolution`` (the plain case)."""
        return self.buckets or BucketSettings(resolutions=(self.resolution,))

    def report(self) -> str:
        b = self.bucket_settings
        videos = sum(e.is_video for e in self.entries)
        res = ", ".join(f"{r}px" for r in b.resolutions)
        lines = [f"{len(self.entries) - videos} images and {videos} videos in {self.folder} "
                 f"(x{self.repeats} repeats), {res}"]
        if b.count > 1:
            lines.append(f"{b.count} aspect buckets from {b.min_ratio:g} to {b.max_ratio:g} (width/height)")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} without caption: {', '.join(self.skipped)}")
        if self.empty_captions:
            lines.append(f"{len(self.empty_captions)} trained with an empty caption: {', '.join(self.empty_captions)}")
        return "\n".join(lines + list(self.notes))


def folder_fingerprint(folder: str | Path) -> str:
    """Names, sizes and mtimes of the folder's files: changes when a file or caption is edited, added or
    removed, so ComfyUI re-runs the Dataset node (and the cache after it) instead of reusing its output."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with os.scandir(folder) as listing:
            for e in sorted(listing, key=lambda e: e.name):
                if e.is_file():
                    st = e.stat()
                    h.update(f"{e.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    except OSError as exc:
        h.update(f"unreadable: {exc}".encode())
    return h.hexdigest()


def scan_dataset(folder: str | Path, resolution: int, repeats: int = 1, missing_caption: str = "error",
                 buckets: BucketSettings | None = None) -> DatasetSpec:
    """List the images and videos of ``folder`` with their captions, applying the missing-caption policy."""
    folder = Path(folder)
    if missing_caption not in CAPTION_POLICIES:
        raise DatasetError(f"missing_caption must be one of {', '.join(CAPTION_POLICIES)} (got {missing_caption!r}).")
    if buckets is not None and buckets.problems():
        raise DatasetError("Bucket settings: " + " ".join(buckets.problems()))
    if not folder.is_dir():
        raise DatasetError(f"Dataset folder {folder} does not exist: create it or fix the path.")
    media = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
    with os.scandir(folder) as listing:  # one directory read; no stat per file (large datasets)
        files = {e.name for e in listing if e.is_file()}
    images = sorted(n for n in files if n.lower().endswith(media))
    if not images:
        raise DatasetError(
            f"Dataset folder {folder} has no images or videos ({', '.join(media)}): add them with .txt captions."
        )
    entries, missing, skipped, empty = [], [], [], []
    for name in images:
        cap_name = os.path.splitext(name)[0] + ".txt"
        caption = None
        if cap_name in files:
            with open(os.path.join(folder, cap_name), encoding="utf-8") as f:
                caption = f.read().strip()
        path = os.path.join(folder, name)
        if caption:
            entries.append(ImageEntry(path, caption))
        elif missing_caption == "error":
            missing.append(name)
        elif missing_caption == "skip":
            skipped.append(name)
        else:
            empty.append(name)
            entries.append(ImageEntry(path, ""))
    if missing:
        raise DatasetError(
            f"{len(missing)} file(s) in {folder} have no caption (or an empty one): {', '.join(missing)}. "
            "Add a same-name .txt file for each, or set missing_caption to 'skip' or 'empty'."
        )
    if not entries:
        raise DatasetError(f"Every file in {folder} was skipped for lack of a caption: add .txt captions.")
    return DatasetSpec(str(folder), tuple(entries), resolution, repeats, tuple(skipped), tuple(empty),
                       buckets=buckets)
