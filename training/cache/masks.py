"""Cached per-item variants: the horizontally flipped latent and the loss mask.

Both are stored as named tensors in the item's latent entry, next to ``latent``:

- ``latent_flipped``: the VAE encode of the item's *mirrored pixels* (the bucket-fitted image or every
  frame of the clip, mirrored left-right), not a mirrored latent: a VAE is not mirror-symmetric, so only
  the encode of the mirrored picture is what the model would see for a mirrored training image.
  Mirroring the fitted pixels (rather than the source before the crop) keeps the mirrored item exactly
  the mirror of the item, so its mask is exactly the mirror of the item's mask grid.
- ``loss_mask``: ``[1, h, w]`` in [0, 1] on the latent's grid (white = train, black = ignore). The mask
  (a file of the mask folder, or the image's alpha channel) is fitted to the item's bucket exactly like
  the image (same cover-resize, filter and center crop), then area-averaged down to the latent's size,
  so a latent cell half covered by the mask weighs 0.5. A video has one mask per clip (the mask image
  named like the video), applied to every latent frame: a per-frame mask would need a mask video and
  a second decoding path for little gain.

Alpha (``mask=alpha``): an image with an alpha channel (RGBA, LA, a palette with transparency) uses it
as its mask; an image without alpha, and any video, is an error for that item (the cache skips it and
reports why): training such an item unmasked would silently ignore the option the user chose.

Both variants join the latent key only when the option is on (plan.py, keys.py), so caches written
without them keep their keys; a mask file's content digest is part of its item's key, so a changed
mask re-encodes exactly that item.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .buckets import Bucket
from .media import fit_pixels
from .plan import caches_flip, caches_mask

FLIPPED_LATENT = "latent_flipped"
LOSS_MASK = "loss_mask"
VARIANT_TENSORS = (FLIPPED_LATENT, LOSS_MASK)  # latent-entry tensors that are variants, not family extras
FLIP_PROBABILITY = 0.5
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_ASPECT_TOLERANCE = 0.01


def has_alpha(img: Image.Image) -> bool:
    """Whether ``img`` carries transparency (an alpha band, or a palette/grey transparency entry)."""
    return img.mode in _ALPHA_MODES or "transparency" in img.info


def mask_size_problem(image_size: tuple[int, int], mask_size: tuple[int, int]) -> str:
    """Why a mask of ``mask_size`` cannot be fitted like its image (""): only the aspect ratio must
    match, since both are resized to the bucket; a mask of another shape would be cropped elsewhere."""
    (iw, ih), (mw, mh) = image_size, mask_size
    if abs((iw / ih) / (mw / mh) - 1) > _ASPECT_TOLERANCE:
        return (f"its mask is {mw}x{mh} but the image is {iw}x{ih}: give the mask the image's aspect ratio "
                "(the same size is best)")
    return ""


def mask_pixels(source: str, mask_file: str, mode: str, bucket: Bucket) -> torch.Tensor:
    """``[H, W]`` in [0, 1] at the bucket's pixel size, fitted like the image (see module docstring)."""
    path = source if mode == "alpha" else mask_file
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if mode == "alpha":
            if not has_alpha(img):
                raise ValueError("it has no alpha channel, and mask=alpha takes the mask from it: save it as a "
                                 "PNG/WebP with transparency, or use mask=folder")
            band = fit_pixels(img, bucket, "RGBA")[..., 3]
        else:
            band = fit_pixels(img, bucket, "L")
    return torch.from_numpy(band).clamp(0.0, 1.0)  # Lanczos rings past the edges of a hard mask


def latent_mask(pixels: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """A pixel mask ``[H, W]`` area-averaged to the latent's spatial grid: ``[1, h, w]`` (fp32)."""
    h, w = latent.shape[-2:]
    return F.interpolate(pixels[None, None].float(), size=(int(h), int(w)), mode="area")[0].contiguous()


def encode_variants(pixels: torch.Tensor, latent: torch.Tensor, flip: str, mask: str, source: str, mask_file: str,
                    bucket: Bucket, encode: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The variant tensors of one item: ``pixels`` ``[F, H, W, 3]`` as encoded into ``latent``."""
    out = {}
    if caches_flip(flip):
        out[FLIPPED_LATENT] = encode(pixels.flip(2))
    if caches_mask(mask):
        if mask == "alpha" and pixels.shape[0] > 1:
            raise ValueError("a video has no alpha channel: use mask=folder (one mask image per clip)")
        out[LOSS_MASK] = latent_mask(mask_pixels(source, mask_file, mask, bucket), latent)
    return out


def flip_example_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask of the flipped item: the mirror of the mask grid (exact: see the module docstring)."""
    return None if mask is None else mask.flip(-1)
