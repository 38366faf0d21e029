"""VACE control conditioning of one clip, built by ComfyUI's own ``WanVaceToVideo`` and stored as the model sees it.

A Wan 2.1 VACE model reads, besides the noise, ``vace_context`` (training/pipelines/wan_vace.py): for a
control video and its mask, ``WanVaceToVideo`` encodes the *inactive* (control outside the mask, gray
inside) and *reactive* (control inside the mask, gray outside) clips with the Wan VAE and folds the
pixel mask 8x8 onto the latent grid (64 channels, nearest-exact in time); ``WAN21_Vace.extra_conds``
then applies ``process_latent_in`` to each 16-channel latent and appends the mask. :func:`vace_context`
runs that node itself on a control clip already resized and cropped to the training clip's bucket (its
resize to the same size is the identity) with the training clip's frame count, so the cache gets what
the sampling graph gives the model; the extra_conds step is repeated here with ComfyUI's ``Wan21``
latent format (VACE is a Wan 2.1 model; ``WanVaceToVideo`` hard-codes that format too). The result is
stored processed, so the trainer applies nothing to it.

:func:`control_extras` reads an item's control clip (and optional mask clip) as the item's own clip is
read: the same bucket (resize to cover, center crop), frame rate and frame count (media.py), so control
frame k lines up with training frame k. A control clip shorter than its item's frame bucket is refused
(the loader would repeat its last frame, and ``WanVaceToVideo`` pads gray instead).

``WanVaceToVideo``'s reference image (a latent frame in front of the video, trimmed after sampling) is
not built here: training would need the same extra frame in front of the training latent.

Not wired yet (issue #25): the Dataset node's pairing of control (and mask) clips with training clips,
the Cache node's call of :func:`control_extras` per item and the control clips' digests in the latent key.
Until then the WanVace family refuses a cache without ``vace_context`` (training/pipelines/wan_vace.py).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..data.dataset import VIDEO_EXTENSIONS
from .buckets import Bucket
from .media import fit_pixels, load_image, load_video, probe_video

VACE_CONTEXT = "vace_context"  # the extra name the Wan VACE family reads
LATENT_CHANNELS = 16  # Wan 2.1 VAE latents; vace_frames holds two of them (inactive, reactive)
SPATIAL_STRIDE = 8  # WanVaceToVideo's vae_stride: the mask is folded per 8x8 pixel cell


def control_problems(pixels: torch.Tensor, mask: torch.Tensor | None) -> list[str]:
    """Why ``WanVaceToVideo`` could not build conditioning for this control clip (``[F, H, W, C]``) and
    mask (``[F, H, W]``), phrased as the fix."""
    frames, height, width = (int(s) for s in pixels.shape[:3])
    out = []
    if height % SPATIAL_STRIDE or width % SPATIAL_STRIDE:
        out.append(f"A VACE control clip of {width}x{height} pixels cannot be folded onto the latent grid: use a "
                   f"bucket whose sides are multiples of {SPATIAL_STRIDE} (the Dataset node's resolution).")
    if mask is not None and tuple(mask.shape) != (frames, height, width):
        out.append(f"A VACE control mask of shape {list(mask.shape)} does not fit its control clip "
                   f"({frames} frames of {width}x{height}): give one mask frame per clip frame, at the clip's size.")
    return out


def vace_conditioning(vae, pixels: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vace_frames [1, 32, f, h, w], vace_mask [1, 64, f, h, w])``: what ``WanVaceToVideo`` (strength 1, no
    reference image) puts into the conditioning for the bucket-sized control clip ``pixels`` (``[F, H, W, C]``,
    0..1) and optional ``mask`` (``[F, H, W]``, 1 = reactive; none = all reactive, as the node)."""
    from comfy_extras.nodes_wan import WanVaceToVideo

    problems = control_problems(pixels, mask)
    if problems:
        raise ValueError(" ".join(problems))
    frames, height, width = (int(s) for s in pixels.shape[:3])
    carrier = [[torch.zeros(1, 1, 1), {}]]  # a conditioning the node adds its values to
    out = WanVaceToVideo.execute(carrier, [], vae, width, height, frames, 1, 1.0, control_video=pixels,
                                 control_masks=mask)
    positive = (out.result if hasattr(out, "result") else out)[0]
    values = positive[0][1]
    return values["vace_frames"][0].to(torch.float32), values["vace_mask"][0].to(torch.float32)


def vace_context(vae, pixels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, 96, f, h, w]``: one control stream of ``WAN21_Vace.extra_conds``' ``vace_context`` (frames through
    the Wan 2.1 ``process_latent_in``, then the folded mask), float32 on the CPU, for the cache."""
    import comfy.latent_formats

    frames, folded = vace_conditioning(vae, pixels, mask)
    fmt = comfy.latent_formats.Wan21()
    latents = [fmt.process_in(frames[:, i:i + LATENT_CHANNELS]) for i in range(0, frames.shape[1], LATENT_CHANNELS)]
    return torch.cat([*latents, folded], dim=1).cpu().contiguous()


def _is_video(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)  # as the Dataset node tells videos from images


def _refuse_image_for_clip(path: str, bucket: Bucket) -> None:
    if bucket.frames != 1:
        raise ValueError(f"The control file {os.path.basename(path)} is an image, and its training clip has "
                         f"{bucket.frames} frames: give a control video (or mask video) of the clip's length.")


def load_control(path: str, bucket: Bucket, fps: float) -> torch.Tensor:
    """``[F, H, W, 3]``: an item's control clip read like the item (an image is a 1-frame clip, as an image item);
    refuses a clip with fewer frames than the bucket, naming the file and the fix."""
    if not _is_video(path):
        _refuse_image_for_clip(path, bucket)
        return load_image(path, bucket)
    available = probe_video(path).frames_at(fps)
    if available < bucket.frames:
        raise ValueError(f"The control clip {os.path.basename(path)} has {available} frames at {fps:g} fps and its "
                         f"training clip {bucket.frames}: give a control clip at least as long as the training clip.")
    return load_video(path, bucket, fps)


def load_control_mask(path: str, bucket: Bucket, fps: float) -> torch.Tensor:
    """``[F, H, W]`` in [0, 1] (white = reactive): the control clip's mask, read like the clip, in grayscale."""
    if _is_video(path):
        return load_control(path, bucket, fps).mean(dim=-1)
    from PIL import Image, ImageOps

    _refuse_image_for_clip(path, bucket)
    with Image.open(path) as img:
        return torch.from_numpy(np.ascontiguousarray(fit_pixels(ImageOps.exif_transpose(img), bucket, mode="L")))[None]


def control_extras(vae, control: str, bucket: Bucket, fps: float, mask: str | None = None) -> dict[str, torch.Tensor]:
    """The cache extras of one item: ``{vace_context: [1, 96, f, h, w]}`` from its control clip and mask files."""
    pixels = load_control(control, bucket, fps)
    folded = load_control_mask(mask, bucket, fps) if mask else None
    return {VACE_CONTEXT: vace_context(vae, pixels, folded)}
