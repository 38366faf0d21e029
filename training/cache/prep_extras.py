"""Extras the Cache computes from an item's preprocessing (not from its pixels), for the families that ask.

Some families condition on how a training image was prepared: SDXL's ``y`` vector embeds the image's
original size, the crop offset and the target size (ComfyUI's ``SDXL.encode_adm``; kohya's
``original_size``, ``crop_coords``, ``target_size``). Only the cache knows those numbers (the source's
probed size, the bucket, the crop :func:`~.media.load_image` made), so it writes them into the item's
latent entry next to the latent, as the family's extra.

The Cache node sees the VAE and the text encoder, not the model, so a family adapter says which text
encoder tells it its family: an adapter may define ``cache_extras(clip) -> Mapping[str, CacheExtra]``
(empty for another family's encoder). Nothing here names a family. The extras written join the latent
key through the preprocessing (``prep["extras"]``: name -> version), so a cache written before (or by
another family's encoder) re-encodes with the reason ``preprocessing changed (extras ...)``, and caches
of every other family keep their keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ItemCrop:
    """Where one cached item's pixels came from, in pixels.

    ``source_width``/``source_height``: the source image as decoded (EXIF rotation applied);
    ``width``/``height``: the bucket it was fitted to (the target size); ``crop_left``/``crop_top``:
    where the bucket's window starts in the source scaled to cover the bucket (the coordinates SDXL's
    crop conditioning and kohya's ``crop_coords`` use).
    """

    source_width: int
    source_height: int
    width: int
    height: int
    crop_left: int
    crop_top: int


def item_crop(source_width: int, source_height: int, width: int, height: int) -> ItemCrop:
    """The cover-resize and center crop of Pillow's ``ImageOps.fit`` (what :func:`~.media.load_image`
    runs): the bucket's aspect ratio is cut from the middle of the source, then resized to the bucket.
    In the cover-scaled source that window starts at half the overhang, rounded to whole pixels."""
    scale = max(width / source_width, height / source_height)
    left = (source_width * scale - width) / 2
    top = (source_height * scale - height) / 2
    return ItemCrop(int(source_width), int(source_height), int(width), int(height),
                    int(round(left)), int(round(top)))


@dataclass(frozen=True)
class CacheExtra:
    """One extra a family asks the cache to write. ``version`` is part of the latent key: bump it when
    ``make`` changes, and every entry holding the old values is re-encoded."""

    version: int
    make: Callable[[ItemCrop], torch.Tensor]


def cache_extras(clip) -> dict[str, CacheExtra]:
    """The preprocessing extras every registered family asks for when caching with ``clip``."""
    from ..pipelines.base import adapter_for, known_families

    out: dict[str, CacheExtra] = {}
    for family in known_families():
        asks = getattr(adapter_for(family), "cache_extras", None)
        if asks is not None:
            out.update(asks(clip))
    return out


def extras_signature(extras: Mapping[str, CacheExtra]) -> dict[str, int]:
    """``name -> version``: what the preprocessing records (and the latent key covers) of ``extras``."""
    return {name: extras[name].version for name in sorted(extras)}


def make_extras(extras: Mapping[str, CacheExtra], crop: ItemCrop) -> dict[str, torch.Tensor]:
    return {name: extra.make(crop).contiguous() for name, extra in sorted(extras.items())}
