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

Several control streams (``clip.mp4``, ``clip.2.mp4``...: dataset_controls.py) are built as chained
``WanVaceToVideo`` nodes build them: each node appends its ``vace_frames`` / ``vace_mask`` / ``vace_strength``
to the conditioning's lists and ``extra_conds`` stacks them along N, so the cache stores ``[N, 96, f, h, w]``
in chain order.

A reference image (``clip_ref.png``) goes to every node of the chain as ``reference_image`` (the streams must
keep one frame count to be stacked). The node encodes it as one latent frame in front of each stream (its
reactive half ``process_out(0)``, i.e. 0 after ``extra_conds``, and mask 0 there) and makes the latent one
frame longer, which ``TrimVideoLatent`` cuts after sampling. The training latent gets that frame in front
too: the node's own VAE latent of the reference (mask 0 is VACE's "keep this content", so the model's
trajectory there is the reference's, which is what noising it gives), and a loss mask that is 0 on it, since
ComfyUI trims the frame: the model never has to deliver it as data (:func:`with_reference_frame`).

A still mask (an image) is the mask of every frame of its clip. An image item (a 1-frame clip) takes a
control image: ``WanVaceToVideo`` with length 1 gives its 1-frame conditioning (an image-only folder of plain
``name.png`` controls, which the Dataset node cannot tell from edit references, is read as VACE controls by
:meth:`VaceControl.dataset`).

The Dataset node pairs each clip with its controls from the control folder
(training/data/dataset_controls.py); the Cache node's ``vace_control`` option (:class:`VaceControl`) calls
:func:`control_extras` per item and puts the content digests of every control, mask and reference with this
encode's identity into the latent key (as a ``vace`` component beside the flip and mask variants), so a
changed control or reference re-encodes only its item. Without it the WanVace family
refuses the cache (training/pipelines/wan_vace.py).
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import torch

from ..data.dataset import VIDEO_EXTENSIONS
from ..data.dataset_controls import ControlSet, control_set
from ..data.media_probe import probe_video
from .buckets import Bucket
from .masks import LOSS_MASK
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


Stream = tuple[torch.Tensor, "torch.Tensor | None"]  # a control clip [F, H, W, C] and its mask [F, H, W] or None


def vace_conditioning(vae, streams: list[Stream], reference: torch.Tensor | None = None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(vace_frames, vace_mask)``, one ``[1, 32, f, h, w]`` / ``[1, 64, f, h, w]`` per stream: what chained
    ``WanVaceToVideo`` nodes (strength 1) put into the conditioning for the bucket-sized control clips
    (``[F, H, W, C]``, 0..1) and optional masks (``[F, H, W]``, 1 = reactive; none = all reactive, as the node),
    each node given the bucket-sized ``reference`` image (``[1, H, W, C]``; ``f`` then counts its frame)."""
    from comfy_extras.nodes_wan import WanVaceToVideo

    carrier = [[torch.zeros(1, 1, 1), {}]]  # a conditioning the nodes add their values to
    for pixels, mask in streams:
        problems = control_problems(pixels, mask)
        if problems:
            raise ValueError(" ".join(problems))
        frames, height, width = (int(s) for s in pixels.shape[:3])
        out = WanVaceToVideo.execute(carrier, [], vae, width, height, frames, 1, 1.0, control_video=pixels,
                                     control_masks=mask, reference_image=reference)
        carrier = (out.result if hasattr(out, "result") else out)[0]
    values = carrier[0][1]
    return ([v.to(torch.float32) for v in values["vace_frames"]], [m.to(torch.float32) for m in values["vace_mask"]])


def processed_context(frames: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """``[1, 96, f, h, w]``: one stream of ``WAN21_Vace.extra_conds``' ``vace_context`` (each 16-channel latent
    through the Wan 2.1 ``process_latent_in``, then the folded mask), float32 on the CPU."""
    import comfy.latent_formats

    fmt = comfy.latent_formats.Wan21()
    latents = [fmt.process_in(frames[:, i:i + LATENT_CHANNELS]) for i in range(0, frames.shape[1], LATENT_CHANNELS)]
    return torch.cat([*latents, folded], dim=1).cpu().contiguous()


def vace_context(vae, pixels: torch.Tensor, mask: torch.Tensor | None = None,
                 reference: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, 96, f, h, w]``: the cached ``vace_context`` of one control stream (see :func:`stream_contexts`)."""
    return stream_contexts(vae, [(pixels, mask)], reference)


def stream_contexts(vae, streams: list[Stream], reference: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, 96, f, h, w]``: ``vace_context`` of ``streams`` as the cache stores it (the trainer stacks items
    to ``[B, N, ...]``, the layout of ``extra_conds``), float32 on the CPU."""
    frames, folded = vace_conditioning(vae, streams, reference)
    return torch.cat([processed_context(f, m) for f, m in zip(frames, folded, strict=True)], dim=0)


def with_reference_frame(latent: torch.Tensor, reference: torch.Tensor, loss_mask: torch.Tensor | None = None
                         ) -> dict[str, torch.Tensor]:
    """The item's raw training latent ``[C, F, h, w]`` with the ``reference`` frame (``[1, C, 1, h, w]``, the
    node's own raw VAE latent of the reference image: ``vace_frames``' first 16 channels at frame 0) in front,
    as the sampler's latent has it, and its loss mask ``[F + 1, h, w]``: 0 on the reference frame (trimmed
    after sampling), else the item's spatial ``loss_mask`` (``[1, h, w]``) or 1."""
    frames = latent if latent.ndim == 4 else latent.unsqueeze(1)  # an image item: its one frame
    grown = torch.cat([reference[0].to(frames.dtype), frames], dim=1).contiguous()
    spatial = torch.ones(1, *grown.shape[-2:]) if loss_mask is None else loss_mask.float().reshape(1, *grown.shape[-2:])
    weight = spatial.expand(grown.shape[1], -1, -1).clone()
    weight[0] = 0.0
    return {"latent": grown, "loss_mask": weight}


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


def load_reference(path: str, bucket: Bucket) -> torch.Tensor:
    """``[1, H, W, 3]``: a reference image read like an image item at the clip's bucket (resize to cover, center
    crop), so ``WanVaceToVideo``'s own resize to that size is the identity."""
    if _is_video(path):
        raise ValueError(f"The VACE reference {os.path.basename(path)} is a video: WanVaceToVideo takes one "
                         "reference image; save it as name_ref.png.")
    return load_image(path, Bucket(bucket.width, bucket.height))


def control_extras(vae, controls: ControlSet, bucket: Bucket, fps: float, latent: torch.Tensor | None = None,
                   loss_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The cache tensors of one item: ``{vace_context: [N, 96, f, h, w]}`` from its control clips and masks
    (stream by stream, as chained nodes); with a reference image also its training ``latent`` with the
    reference frame in front and the ``loss_mask`` that leaves that frame out (:func:`with_reference_frame`;
    ``loss_mask`` is the item's own spatial one, if any)."""
    streams = [(load_control(c, bucket, fps), load_control_mask(m, bucket, fps) if m else None)
               for c, m in controls.streams]
    reference = load_reference(controls.reference, bucket) if controls.reference else None
    frames, folded = vace_conditioning(vae, streams, reference)
    out = {VACE_CONTEXT: torch.cat([processed_context(f, m) for f, m in zip(frames, folded, strict=True)], dim=0)}
    if reference is not None:
        if latent is None:
            raise ValueError("a VACE reference image needs the item's latent to put its frame in front of")
        out.update(with_reference_frame(latent, frames[0][:, :LATENT_CHANNELS, :1], loss_mask))
    return out


VACE_CONTROL_MODES = ("off", "on")
# What of this encode changes the cached vace_context besides the VAE (already in the latent key) and the
# files: bump "v" when the reading or the extra_conds step above changes.
_IDENTITY = {"node": "WanVaceToVideo", "strength": 1.0, "format": "Wan21", "mask": "gray-mean, still repeated",
             "v": 1}
_REFERENCE_IDENTITY = "latent frame in front, loss 0 there"  # with_reference_frame; change it when that does


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
        numbered = [os.path.basename(e.path) for e in entries if len(getattr(e, "references", ())) > 1]
        out = []
        if numbered:
            out.append(f"vace_control is on and {len(numbered)} item(s) have numbered edit references (name_1.png...): "
                       f"{', '.join(numbered[:20])}. A VACE image's controls are name.png, name.2.png... (streams), "
                       "name_mask.png and name_ref.png: rename them, or set vace_control off for an edit model.")
            without = [w for w in without if w not in numbered]
        if without:
            out.append(f"vace_control is on and {len(without)} item(s) have no VACE control clip: "
                       f"{', '.join(without[:20])}{' and more' if len(without) > 20 else ''}. Give the Dataset node "
                       "a control_folder with a control video (or image, for an image) per item (name.mp4, optional "
                       "name_mask.mp4 or .png, name_ref.png), or set vace_control off.")
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
        controls = control_set(entry.path, entry.controls)
        roles = [(f"{role}{'' if k == 1 else f'.{k}'}", path) for k, stream in enumerate(controls.streams, 1)
                 for role, path in zip(("control", "mask"), stream, strict=True) if path]
        if controls.reference:
            roles.append(("reference", controls.reference))
            part["reference_frame"] = _REFERENCE_IDENTITY
        for role, path in roles:
            try:
                part[role] = digest_of(path)
            except Exception as exc:  # noqa: BLE001 - reported by the caller as this item's skip reason
                raise ValueError(f"cannot read its VACE {role} {os.path.basename(path)} "
                                 f"({type(exc).__name__}: {exc})") from exc
        return {"vace": part}

    def encode(self, entry, bucket: Bucket, fps: float, tensors: dict | None = None) -> dict[str, torch.Tensor]:
        """The item's ``vace_context`` extra ({} when off), from its controls at its bucket; with a reference
        image also its ``latent`` and ``loss_mask`` in place of those in ``tensors`` (the item's so far)."""
        if not self.active:
            return {}
        tensors = tensors or {}
        return control_extras(self.vae, control_set(entry.path, entry.controls), bucket, fps, tensors.get("latent"),
                              tensors.get(LOSS_MASK))

    def dataset(self, dataset):
        """``dataset`` as this option reads it: when on, an image item that the Dataset node paired with one edit
        reference (``name.png``: a control folder of plain control images reads as edit references) takes it as
        its VACE control image, so an image-only VACE dataset trains as 1-frame clips."""
        if not self.active or not any(e.references and not e.controls and not e.is_video for e in dataset.entries):
            return dataset
        entries = tuple(replace(e, controls=e.references, references=())
                        if len(e.references) == 1 and not e.controls and not e.is_video else e
                        for e in dataset.entries)
        return replace(dataset, entries=entries)
