"""Scanning a folder of images with same-name ``.txt`` captions (pure Python + Pillow).

The missing-caption policy is explicit: ``error`` names every file without a caption, ``skip`` drops
them, ``empty`` trains them with an empty caption; both of the latter are counted in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_POLICIES = ("error", "skip", "empty")


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class ImageEntry:
    path: str
    caption: str


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

    def report(self) -> str:
        lines = [f"{len(self.entries)} images in {self.folder} (x{self.repeats} repeats), {self.resolution}px"]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} without caption: {', '.join(self.skipped)}")
        if self.empty_captions:
            lines.append(f"{len(self.empty_captions)} trained with an empty caption: {', '.join(self.empty_captions)}")
        return "\n".join(lines + list(self.notes))


def scan_dataset(folder: str | Path, resolution: int, repeats: int = 1, missing_caption: str = "error") -> DatasetSpec:
    """List the images of ``folder`` with their captions, applying the missing-caption policy."""
    folder = Path(folder)
    if missing_caption not in CAPTION_POLICIES:
        raise DatasetError(f"missing_caption must be one of {', '.join(CAPTION_POLICIES)} (got {missing_caption!r}).")
    if not folder.is_dir():
        raise DatasetError(f"Dataset folder {folder} does not exist: create it or fix the path.")
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not images:
        raise DatasetError(
            f"Dataset folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)}): add images with .txt captions."
        )
    entries, missing, skipped, empty = [], [], [], []
    for img in images:
        cap_file = img.with_suffix(".txt")
        caption = cap_file.read_text(encoding="utf-8").strip() if cap_file.exists() else None
        if caption:
            entries.append(ImageEntry(str(img), caption))
        elif missing_caption == "error":
            missing.append(img.name)
        elif missing_caption == "skip":
            skipped.append(img.name)
        else:
            empty.append(img.name)
            entries.append(ImageEntry(str(img), ""))
    if missing:
        raise DatasetError(
            f"{len(missing)} image(s) in {folder} have no caption (or an empty one): {', '.join(missing)}. "
            "Add a same-name .txt file for each, or set missing_caption to 'skip' or 'empty'."
        )
    if not entries:
        raise DatasetError(f"Every image in {folder} was skipped for lack of a caption: add .txt captions.")
    return DatasetSpec(str(folder), tuple(entries), resolution, repeats, tuple(skipped), tuple(empty))
