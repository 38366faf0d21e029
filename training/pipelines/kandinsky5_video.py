"""Kandinsky 5 video (``comfy.ldm.kandinsky5.model.Kandinsky5``, ``model_base.Kandinsky5``): text-to-video and
image-to-video, as the image family's stage layers.

Why it shares the image family's layers (training/pipelines/kandinsky5_image.py): ComfyUI runs the video and the
image models through the same ``Kandinsky5`` network; the image class only feeds it a one-frame latent without
the concatenated channels. The stage tuples are the image family's; the final layer keeps the frame axis
(ComfyUI's ``_forward`` squeezes only a 4-D input), so a 1-frame example (an image) trains as a 1-frame video.

What the video class feeds the network (``model_base.Kandinsky5``), built by :meth:`first_stage_inputs`:

- ``concat_cond``: 16 image channels that are always zeros and one mask channel, concatenated to the 16
  latent channels (33 per pixel: ``visual_embed_dim`` 132 with patch (1, 2, 2)). The mask is ``1 -
  concat_mask``: 0 everywhere for text-to-video, 1 on the start frames after ``Kandinsky5ImageToVideo``;
- ``time_dim_replace`` (``Kandinsky5ImageToVideo``'s start-image latent, given ``process_latent_in``):
  ``_forward`` writes it over the first latent frames of the noisy latent's 16 channels, after
  ``calculate_input`` (the identity on flow models). The timestep stays one per example.

Image-to-video (family option ``first_frame_clean``): as ComfyUI samples after ``Kandinsky5ImageToVideo`` with
one start image: the first latent frame of the clip is the clean latent (the HunyuanVideo VAE is causal, so
the clip's first latent frame is the start image's own latent), the mask channel is 1 there, and the loss
leaves that frame out (ComfyUI's workflow puts the clean start back with ``ReplaceVideoLatentFrames``). A
1-frame example (an image) has no frame left to learn: it trains as text-to-video. Off: text-to-video.

Loss. ``ModelType.FLOW`` with the config's shift 10 and multiplier 1000 (a ModelSamplingSD3 node before Train
LoRA is replayed as on the other flow families). Text: DualCLIPLoader type ``kandinsky5`` (Qwen2.5-VL 7B with
the video template + CLIP-L): the Qwen states and CLIP-L's pooled vector, as for the image family. Latents are
HunyuanVideo VAE latents (16 channels; 1 or 4k+1 pixel frames); even latent sides, as for the image family.

Refused by name: a diffusion model that is not ComfyUI's ``Kandinsky5``; one whose patch input is not the
latent, image and mask channels that ``Kandinsky5.concat_cond`` builds (ComfyUI itself could not run it with
this model class); one whose output is not the latent's channels; one without visual blocks. The Pro models'
rope rule (width 4096 at high resolution) is ComfyUI's own ``rope_encode_3d``, reused by the blocks.

Fixture tier: detection pins widths of billions of parameters, so the tests build a tiny model in memory from
ComfyUI's own ``Kandinsky5`` config class (tests/family_rows/kandinsky5_video.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .base import Batch, Geometry, register
from .kandinsky5_image import Kandinsky5ImageAdapter

FAMILY = "Kandinsky5Video"
MASK_CHANNELS = 1  # model_base.Kandinsky5.concat_cond: one mask channel after the zero image channels
FRAME_STEP = 4  # the HunyuanVideo VAE: 4 pixel frames per latent frame after the first


@dataclass(frozen=True)
class Kandinsky5VideoOptions:
    """``first_frame_clean``: image-to-video as ``Kandinsky5ImageToVideo`` samples it (see the module docstring)."""

    first_frame_clean: bool = False

    def problems(self) -> list[str]:
        return []


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.kandinsky5.model import Kandinsky5

    if not isinstance(dm, Kandinsky5):
        return (f"{type(dm).__name__} is not ComfyUI's Kandinsky5 model; the {FAMILY} adapter cannot train it. "
                "Kandinsky 5 video models (T2V / I2V, Lite and Pro) are supported.")
    patch = math.prod(dm.patch_size)
    channels = 2 * int(dm.in_visual_dim) + MASK_CHANNELS
    if dm.visual_embeddings.in_layer.in_features != channels * patch:
        return (f"This Kandinsky 5 model takes {dm.visual_embeddings.in_layer.in_features // patch} input channels "
                f"per pixel; ComfyUI's Kandinsky5 video class feeds {channels} ({dm.in_visual_dim} latent, "
                f"{dm.in_visual_dim} image and {MASK_CHANNELS} mask channel, model_base.Kandinsky5.concat_cond), so "
                "neither ComfyUI nor PipeTrainer can run this layout as a video model. Kandinsky 5 video models "
                "(T2V / I2V) are supported; a Kandinsky 5 Image model loads as the Kandinsky5Image class.")
    if dm.out_layer.out_layer.out_features != int(dm.in_visual_dim) * patch:
        return (f"This Kandinsky 5 model predicts {dm.out_layer.out_layer.out_features // patch} channels for "
                f"{dm.in_visual_dim} latent channels; the trainer's loss needs the latent's own channels back.")
    if len(dm.visual_transformer_blocks) == 0:
        return "This Kandinsky 5 model has no visual transformer blocks; nothing to train."
    return None


def video_input(noisy: torch.Tensor, clean: torch.Tensor | None) -> torch.Tensor:
    """The 33-channel network input ``[B, 2 C + 1, F, H, W]`` of ``noisy`` ``[B, C, F, H, W]``.

    Without ``clean``: text-to-video (zero image channels, zero mask, as ``Kandinsky5.concat_cond`` builds
    them without a ``concat_mask``). With it: the first latent frame is ``clean``'s (``time_dim_replace``)
    and the mask channel is 1 there (``1 - concat_mask`` of ``Kandinsky5ImageToVideo`` for one start image).
    """
    b, _, f, h, w = noisy.shape
    mask = noisy.new_zeros(b, MASK_CHANNELS, f, h, w)
    if clean is not None:
        noisy = torch.cat([clean[:, :, :1].to(noisy.dtype), noisy[:, :, 1:]], dim=2)
        mask[:, :, :1] = 1.0
    return torch.cat([noisy, torch.zeros_like(noisy), mask], dim=1)


class Kandinsky5VideoAdapter(Kandinsky5ImageAdapter):
    """The image family's layers, text rules and LoRA targets; the video class's input, geometry and loss mask."""

    name = FAMILY
    options_type = Kandinsky5VideoOptions
    keep_frames = True

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        return Geometry(patch=tuple(int(p) for p in diffusion_model.patch_size), video=True, frame_step=FRAME_STEP)

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the (padded) latent; an image latent is one frame."""
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        return math.prod(-(-int(s) // int(p)) for s, p in zip(sizes, diffusion_model.patch_size, strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None or batch.pooled is None:
            raise ValueError("Kandinsky 5 needs the text encoder's Qwen2.5-VL states and CLIP-L pooled vector, and the "
                             "cache lacks them: cache the dataset with Kandinsky 5's text encoders (DualCLIPLoader "
                             "type kandinsky5 with the Qwen2.5-VL 7B and CLIP-L files).")
        options = batch.options if isinstance(batch.options, Kandinsky5VideoOptions) else Kandinsky5VideoOptions()
        x = batch.noisy if batch.noisy.ndim == 5 else batch.noisy.unsqueeze(2)
        clean = None
        if options.first_frame_clean and x.shape[2] > 1:
            if batch.clean is None:
                raise ValueError("first_frame_clean needs the clean latent in the batch.")
            clean = batch.clean if batch.clean.ndim == 5 else batch.clean.unsqueeze(2)
        return video_input(x, clean), batch.timestep, batch.cond, batch.pooled

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        """With ``first_frame_clean``, 0 on the first latent frame (it is given, not predicted)."""
        if not (isinstance(options, Kandinsky5VideoOptions) and options.first_frame_clean):
            return None
        if len(latent_shape) != 4 or latent_shape[1] < 2:
            return None  # an image: trains as text-to-video, nothing clean
        mask = torch.ones(1, latent_shape[1], 1, 1)
        mask[:, 0] = 0.0
        return mask

    def run_metadata(self, diffusion_model: nn.Module, options: object) -> dict[str, str]:
        """LoRA file metadata: whether it was trained image-to-video."""
        if isinstance(options, Kandinsky5VideoOptions) and options.first_frame_clean:
            return {"kandinsky5.first_frame_clean": "true"}
        return {}


ADAPTER = register(Kandinsky5VideoAdapter(), model_classes=(), exact_classes=("Kandinsky5",))
