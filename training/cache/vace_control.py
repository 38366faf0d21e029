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

A still mask (an image) is the mask of every frame of its clip. The Dataset node pairs each clip with its
control (and mask) from the control folder (training/data/dataset_controls.py); the Cache node's
``vace_control`` option (:class:`VaceControl`) calls :func:`control_extras` per item and puts the control and
mask content digests with this encode's identity into the latent key (as a ``vace`` component beside the
flip and mask variants), so a changed control clip re-encodes only its item. Without it the WanVace family
refuses the cache (training/pipelines/wan_vace.py).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..data.dataset import VIDEO_EXTENSIONS
from ..data.media_probe import probe_video
from .buckets import Bucket
from .media import fit_pixels, load_image, load_video

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
    """``[F, H, W]`` in [0, 1] (white = reactive): the control clip's mask, read like the clip, in grayscale; a
    still mask (an image) is repeated over the clip's frames (``WanVaceToVideo`` would pad a short mask with 1s)."""
    if _is_video(path):
        return load_control(path, bucket, fps).mean(dim=-1)
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        still = torch.from_numpy(np.ascontiguousarray(fit_pixels(ImageOps.exif_transpose(img), bucket, mode="L")))
    return still[None].repeat(bucket.frames, 1, 1)


def control_extras(vae, control: str, bucket: Bucket, fps: float, mask: str | None = None) -> dict[str, torch.Tensor]:
    """The cache extras of one item: ``{vace_context: [1, 96, f, h, w]}`` from its control clip and mask files."""
    pixels = load_control(control, bucket, fps)
    folded = load_control_mask(mask, bucket, fps) if mask else None
    return {VACE_CONTEXT: vace_context(vae, pixels, folded)}


VACE_CONTROL_MODES = ("off", "on")
# What of this encode changes the cached vace_context besides the VAE (already in the latent key) and the
# files: bump "v" when the reading or the extra_conds step above changes.
_IDENTITY = {"node": "WanVaceToVideo", "strength": 1.0, "format": "Wan21", "mask": "gray-mean, still repeated",
             "v": 1}


class VaceControl:
    """The Cache node's ``vace_control`` option: per item, the control and mask digests for the latent key
    (:meth:`key_part`) and the encoded ``vace_context`` (:meth:`encode`), with the graph's VAE."""

    def __init__(self, mode: str = "off", vae=None):
        self.mode = mode
        self.vae = vae

    @property
    def active(self) -> bool:
        return self.mode == "on"

    def problems(self, entries, flip: str = "none") -> list[str]:
        """Settings the cache cannot honour for ``entries`` (the Dataset's items), phrased as the fix."""
        if self.mode not in VACE_CONTROL_MODES:
            return [f"vace_control must be one of {', '.join(VACE_CONTROL_MODES)} (got {self.mode!r})."]
        paired = [e for e in entries if getattr(e, "controls", ())]
        if not self.active:
            if paired:
                return [f"The dataset pairs {len(paired)} clip(s) with VACE control clips (its control folder) but "
                        "the Cache node's vace_control is off, so they would not be used: set vace_control on (Wan "
                        "2.1 VACE training), or clear the Dataset's control_folder."]
            return []
        without = [os.path.basename(e.path) for e in entries if not getattr(e, "controls", ())]
        out = []
        if without:
            out.append(f"vace_control is on and {len(without)} item(s) have no VACE control clip: "
                       f"{', '.join(without[:20])}{' and more' if len(without) > 20 else ''}. Give the Dataset node "
                       "a control_folder with a control video per clip (name.mp4, optional name_mask.mp4 or .png) "
                       "and at least one video in the dataset, or set vace_control off.")
        if flip != "none":
            out.append("flip cannot be combined with VACE control (the control clip would need the same mirror): "
                       "set the Dataset's flip to 'none'.")
        return out

    def key_part(self, entry, digest_of) -> dict:
        """``{"vace": identity + control and mask digests}`` for the item's latent key ({} when off);
        ``digest_of(path)`` is the store's content digest. A control that cannot be read is a ValueError
        naming it (the item is skipped with that reason)."""
        if not self.active:
            return {}
        if not entry.controls:
            raise ValueError("has no VACE control clip (the Dataset node's control folder pairs none with it)")
        part = dict(_IDENTITY)
        for role, path in zip(("control", "mask"), entry.controls, strict=False):
            try:
                part[role] = digest_of(path)
            except Exception as exc:  # noqa: BLE001 - reported by the caller as this item's skip reason
                raise ValueError(f"cannot read its VACE {role} {os.path.basename(path)} "
                                 f"({type(exc).__name__}: {exc})") from exc
        return {"vace": part}

    def encode(self, entry, bucket: Bucket, fps: float) -> dict[str, torch.Tensor]:
        """The item's ``vace_context`` extra ({} when off), from its control clip and mask at its bucket."""
        if not self.active:
            return {}
        control, *mask = entry.controls
        return control_extras(self.vae, control, bucket, fps, mask[0] if mask else None)
