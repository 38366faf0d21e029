"""Start-image conditioning of image-to-video models, cached per item as ComfyUI's ``WanImageToVideo`` builds it.

Wan 2.1 / 2.2 image-to-video models take, besides the noise, the VAE latent of a start image followed
by gray frames (``concat_latent``) and Wan 2.1 I2V also the CLIP-vision features of that image
(``clip_fea``). At inference the stock graph makes them with ``CLIP Vision Encode`` (crop ``none``, as
ComfyUI's Wan image-to-video template sets it; the penultimate hidden states reach the model through
``WAN21.extra_conds``) and ``WanImageToVideo`` (start image resized to the video's size, every other
frame gray 0.5, ``length`` = the video's frame count). The Cache node's ``start_image = first_frame``
builds exactly that for every item from the item's own first frame, already resized and
center-cropped to its bucket (the frame the training latent starts with), with the item's frame count;
an image item (1 frame) gets the latent of itself, as ``WanImageToVideo`` with ``length`` 1 does.

The mode, the gray value, the CLIP crop mode and the CLIP-vision model's identity (weights fingerprint,
dtype, input size and normalization) join the latent key (keys.py) only when a start image is cached,
so the keys of caches made without it are unchanged.

HunyuanVideo 1.5 image-to-video (``start_image = first_frame_alone``) conditions as ComfyUI's
``HunyuanVideo15ImageToVideo`` does: the start image (the item's first frame, at its bucket size) encoded
alone, its latent frames at the start of a zero latent of the item's shape (``concat_latent_alone``; the
family adds ``concat_mask``'s channel, 1 on those frames), and, with a CLIP vision model (SigLIP), the
``last_hidden_state`` of ``CLIP Vision Encode`` (crop center, as ComfyUI's HunyuanVideo 1.5 I2V template
sets it) that ``HunyuanVideo15.extra_conds`` hands the model as ``clip_fea`` (``clip_vision_last``). Its
extras have their own names, so preflight tells a Wan cache from a HunyuanVideo 1.5 one.

MiniMax-H3's first/last-frame mode (``start_image = first_last_frames``) conditions as ComfyUI's
``MiniMaxH3ImageToVideo`` with both ``first_frame`` and ``last_frame`` connected: each of the two frames encoded
alone (``keyframe_first``, ``keyframe_last``; the model re-injects them as clean condition rows every step), and
both frames in the prompt of every caption (start_image_prompt.py). The frames are the item's first and last kept
frames at its bucket (``keyframe_images``). Its image-to-video mode (``start_image = first_keyframe``: the node with
``first_frame`` only) is the same with the first frame alone, and ``last_keyframe`` (``last_frame`` only) with the
last frame alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .encoders import _unpatched_weights, weights_fingerprint

START_IMAGE_MODES = ("none", "first_frame", "first_frame_alone", "first_last_frames", "first_keyframe", "last_keyframe")
NO_START_IMAGE = "none"
FIRST_FRAME_ALONE = "first_frame_alone"  # HunyuanVideo 1.5 and 1.0 I2V (HunyuanVideo15ImageToVideo, ...)
FIRST_LAST_FRAMES = "first_last_frames"  # MiniMax-H3 first/last-frame (MiniMaxH3ImageToVideo with both frames)
FIRST_KEYFRAME = "first_keyframe"  # MiniMax-H3 image-to-video (MiniMaxH3ImageToVideo with first_frame only)
LAST_KEYFRAME = "last_keyframe"  # MiniMax-H3 toward a last frame (MiniMaxH3ImageToVideo with last_frame only)
CONCAT_LATENT = "concat_latent"  # the extra names the Wan family reads (training/pipelines/wan.py)
CLIP_FEA = "clip_fea"
CONCAT_LATENT_ALONE = "concat_latent_alone"  # the HunyuanVideo 1.5 family's (training/pipelines/hunyuan_video15.py)
CLIP_VISION_LAST = "clip_vision_last"
KEYFRAME_FIRST = "keyframe_first"  # the extra names the MiniMax-H3 family reads (training/pipelines/minimax_h3.py)
KEYFRAME_LAST = "keyframe_last"
KEYFRAME_MODES = {FIRST_LAST_FRAMES: (KEYFRAME_FIRST, KEYFRAME_LAST), FIRST_KEYFRAME: (KEYFRAME_FIRST,),  # each encoded
                  LAST_KEYFRAME: (KEYFRAME_LAST,)}  # alone
START_IMAGE_EXTRAS = (CONCAT_LATENT, CLIP_FEA, CONCAT_LATENT_ALONE, CLIP_VISION_LAST, KEYFRAME_FIRST, KEYFRAME_LAST)
GRAY = 0.5  # WanImageToVideo's value for the frames after the start image
CLIP_CROP = "none"  # CLIP Vision Encode's crop in ComfyUI's Wan image-to-video template: squash, no crop
ALONE_CLIP_CROP = "center"  # CLIP Vision Encode's crop in ComfyUI's HunyuanVideo 1.5 image-to-video template


def keyframe_images(pixels: torch.Tensor) -> list[torch.Tensor]:
    """``[first, last]`` (``[1, H, W, 3]`` each) of the item ``pixels`` (``[F, H, W, C]``, at its bucket): what
    ``MiniMaxH3ImageToVideo`` hands the VAE and the text encoder when sampling at the item's size. The node resizes
    each frame with ComfyUI's lanczos ``common_upscale`` (through 8-bit PIL images), which gives back these frames
    unchanged: they are already that size and 8-bit values (training/cache/media.py)."""
    return [pixels[:1, ..., :3], pixels[-1:, ..., :3]]


def start_clip_pixels(first: torch.Tensor, frames: int) -> torch.Tensor:
    """``[frames, H, W, 3]``: ``first`` (``[1, H, W, C]``) followed by gray frames, as WanImageToVideo fills
    its image before encoding it."""
    out = torch.full((frames, *first.shape[1:3], 3), GRAY, dtype=first.dtype, device=first.device)
    out[:1] = first[..., :3]
    return out


def clip_vision_identity(clip_vision) -> str:
    """What of a ComfyUI ``ClipVisionModel`` changes its features: the (unpatched) weights and their dtype,
    the model class, the input size and the normalization ``encode_image`` applies."""
    model = clip_vision.model
    dtype = next((p.dtype for p in model.parameters()), None)
    weights = weights_fingerprint(model, _unpatched_weights(getattr(clip_vision, "patcher", None)))
    prep = f"{clip_vision.image_size}|{list(clip_vision.image_mean)}|{list(clip_vision.image_std)}"
    return f"{weights}:{dtype}:{type(model).__name__}:{prep}"


def clip_vision_features(clip_vision, first: torch.Tensor) -> torch.Tensor:
    """``[tokens, width]``: what ``CLIP Vision Encode`` (crop none) gives ``WAN21.extra_conds`` as ``clip_fea``
    (the penultimate hidden states) for the image ``first`` (``[1, H, W, C]``)."""
    output = clip_vision.encode_image(first[..., :3], crop=CLIP_CROP == "center")
    return output["penultimate_hidden_states"][0].to(torch.float32).cpu().contiguous()


def clip_vision_last_state(clip_vision, first: torch.Tensor) -> torch.Tensor:
    """``[tokens, width]``: what ``CLIP Vision Encode`` (crop center) gives ``HunyuanVideo15.extra_conds``, which
    hands its ``last_hidden_state`` to the model as ``clip_fea``, for the image ``first`` (``[1, H, W, C]``)."""
    output = clip_vision.encode_image(first[..., :3], crop=ALONE_CLIP_CROP == "center")
    return output["last_hidden_state"][0].to(torch.float32).cpu().contiguous()


def start_latent_alone(first_latent: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """``[C, F, H, W]`` (``latent``'s shape): the start image's own latent frames (``first_latent``), zeros after,
    as ``HunyuanVideo15ImageToVideo`` fills ``concat_latent_image``."""
    out = torch.zeros_like(latent)
    out[:, :first_latent.shape[1]] = first_latent
    return out


class StartImage:
    """The Cache node's start-image option and its CLIP-vision model (optional)."""

    def __init__(self, mode: str = NO_START_IMAGE, clip_vision=None):
        self.mode = mode
        self.clip_vision = clip_vision
        self._identity: dict | None = None

    @property
    def active(self) -> bool:
        return self.mode != NO_START_IMAGE

    def problems(self) -> list[str]:
        """Settings the cache cannot honour, phrased as the fix."""
        if self.mode not in START_IMAGE_MODES:
            return [f"start_image must be one of {', '.join(START_IMAGE_MODES)} (got {self.mode!r})."]
        if self.clip_vision is not None and not self.active:
            return ["A CLIP vision model is connected to 'Cache Latents & Text' but start_image is none, so it would "
                    "not be used: set start_image to first_frame (Wan image-to-video training) or first_frame_alone "
                    "(HunyuanVideo 1.5 and HunyuanVideo I2V), or disconnect it."]
        if self.clip_vision is not None and self.mode in KEYFRAME_MODES:
            return [f"start_image {self.mode} (MiniMax-H3) takes no CLIP vision model: its text encoder reads the "
                    "frames itself. Disconnect clip_vision from 'Cache Latents & Text'."]
        return []

    def identity(self) -> dict | None:
        """The named parts of the start-image conditioning for the latent key; None without one (old keys)."""
        if not self.active:
            return None
        if self._identity is None and self.mode in KEYFRAME_MODES:
            self._identity = {"mode": self.mode, "keyframes": list(KEYFRAME_MODES[self.mode]), "encoded": "alone"}
        if self._identity is None and self.mode == FIRST_FRAME_ALONE:
            clip = None
            if self.clip_vision is not None:
                clip = {"model": clip_vision_identity(self.clip_vision), "crop": ALONE_CLIP_CROP,
                        "state": "last_hidden_state"}
            self._identity = {"mode": self.mode, "clip_vision": clip}
        if self._identity is None:
            clip = None
            if self.clip_vision is not None:
                clip = {"model": clip_vision_identity(self.clip_vision), "crop": CLIP_CROP}
            self._identity = {"mode": self.mode, "gray": GRAY, "clip_vision": clip}
        return self._identity

    def encode(self, pixels: torch.Tensor, latent: torch.Tensor,
               encode_latent: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The extras of one item whose bucket-sized ``pixels`` (``[F, H, W, C]``) encoded to ``latent``."""
        if not self.active:
            return {}
        first = pixels[:1, ..., :3]
        frames = int(pixels.shape[0])
        if self.mode in KEYFRAME_MODES:  # each frame encoded alone, as MiniMaxH3ImageToVideo encodes it
            frames = dict(zip((KEYFRAME_FIRST, KEYFRAME_LAST), keyframe_images(pixels), strict=True))
            return {name: encode_latent(frames[name]) for name in KEYFRAME_MODES[self.mode]}
        if self.mode == FIRST_FRAME_ALONE:
            # An image (1 frame) is its own start image: its latent is the start image's, encoded alone.
            alone = latent.clone() if frames == 1 else start_latent_alone(encode_latent(first), latent)
            out = {CONCAT_LATENT_ALONE: alone}
            if self.clip_vision is not None:
                out[CLIP_VISION_LAST] = clip_vision_last_state(self.clip_vision, first)
            return out
        # One frame: WanImageToVideo encodes the start image alone, which is the item's own latent.
        concat = latent.clone() if frames == 1 else encode_latent(start_clip_pixels(first, frames))
        out = {CONCAT_LATENT: concat}
        if self.clip_vision is not None:
            out[CLIP_FEA] = clip_vision_features(self.clip_vision, first)
        return out
