"""Wan 2.1 / 2.2 (``comfy.ldm.wan.model.WanModel``) as pipeline stage layers: text-to-video, TI2V-5B and image-to-video.

Stage tuples (``B`` batch, ``L`` video tokens, ``T`` text tokens):

- embed: ``(x [B, C_in, F, H, W], timestep [B] or [B, F], context [B, T, text_dim][, clip_fea [B, N, 1280]])``
  -> ``(x, e, e0, context, sizes)``
- each attention block but the last: the same tuple in and out; the last drops ``e0`` and ``context``
- head: ``(x, e, sizes)`` -> the prediction, shaped like the noise latent

``e`` ``[B, 1 or F, dim]`` is the time embedding the head modulates with, ``e0`` ``[B, 1 or F, 6, dim]``
its projection that every block modulates with (ComfyUI's ``forward_orig``, whose ``repeat_e`` spreads
a per-frame timestep over the frame's tokens); ``e`` passes through the blocks unchanged to the head.
``sizes`` is int64 ``(frames, height, width, clip-vision tokens or -1)`` of the unpadded latent: the
rotary embedding has no gradient, so it may not cross a stage boundary as a float tensor; each block
recomputes it with ComfyUI's own ``WanModel.rope_encode`` from those sizes, exactly as ``_forward`` does
once (the rotary embedder has no parameters). The head un-patchifies with ComfyUI's own ``unpatchify``
and crops the patch padding like ``_forward``. ComfyUI's Wan blocks add residuals out of place today;
they run under the same out-of-place guard as every family's blocks.

Layouts (all ComfyUI model classes ``WAN21`` / ``WAN22``):

- text-to-video (2.1, 2.2 A14B T2V experts): ``in_dim == out_dim``;
- TI2V-5B (2.2, class ``WAN22``, 48 channels, Wan 2.2 VAE): text-to-video by default; with the family
  option ``first_frame_clean`` it trains image-to-video as ComfyUI infers it (``Wan22ImageToVideoLatent``
  plus the sampler's noise mask): the first latent frame is the clean latent, its tokens get timestep 0
  (``WAN22.process_timestep``: the mean of the noise mask per frame times the timestep) and the loss
  leaves it out. A 1-frame example (an image) has no frame left to learn, so it trains as text-to-image;
- image-to-video (2.1 I2V, 2.2 I2V A14B experts): ``in_dim = out_dim + 4 + 16``; the network input is
  the noise, a 4-channel mask (1 on the first latent frame) and the start-image latent, concatenated on
  channels as ``WAN21.concat_cond`` builds them from ``WanImageToVideo``'s outputs for one start image
  (extra ``concat_latent``: the raw VAE latent of the clip's first frame followed by gray frames, given
  ``process_latent_in`` like the training latent; the Cache node's ``start_image = first_frame`` builds it,
  see training/cache/start_image.py). Wan 2.1 I2V also takes clip-vision features
  (optional extra ``clip_fea``: the penultimate hidden states of CLIP-vision ViT-H of the first frame),
  embedded by ``img_emb`` in front of the text tokens, with image cross-attention (``k_img``/``v_img``).

Wan 2.2 A14B experts (family option ``expert``): the high-noise and the low-noise expert are separate
files of the same layout; training one restricts sigmas to its range, split at the Wan 2.2 reference's
boundary (0.875 for text-to-video, 0.9 for image-to-video, or ``expert_boundary``), and the expert and
boundary go into the LoRA file's metadata.

Images train as 1-frame videos (the data pipeline gives image latents a frame axis, :class:`Geometry`
``video``). Clips have 1 or 4k+1 frames (the Wan VAEs' temporal rule: 4 pixel frames per latent frame
after the first). Wan 2.1 VACE (``WAN21_Vace``) is the WanVace family (training/pipelines/wan_vace.py,
which reuses these layers), Wan 2.2 S2V (``WAN22_S2V``) the WanS2V family (training/pipelines/wan_s2v.py).
The other Wan relatives ComfyUI builds from subclasses (camera, HuMo, Animate) and other concat layouts
(Fun control, reference conv) are refused by name.

Fixture tiers (all detected by ComfyUI's own detection from keys and shapes, on 0.3.75 and current
ComfyUI, no config in the file): T2V 1.1 M (devkit/fixtures.py ``build_tiny_wan_t2v``), TI2V-5B layout
1.14 M, 2.2 I2V layout 1.12 M, 2.1 I2V 2.99 M (devkit/fixtures_video.py). Detection pins ``text_dim`` to
UMT5-XXL's 4096 (it reads no text width from the weights) and the clip-vision width to 1280, so the tiny
CLIP-L fixture (768) cannot condition them: the tests feed seeded 4096-wide conds, and an end-to-end
graph needs a 4096-wide text encoder (none is small enough for the fixtures yet).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..cache.start_image import CLIP_FEA, CONCAT_LATENT
from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .out_of_place import OutOfPlaceResidualAdds
from .presets import ai_toolkit

_ATTENTION = r"(self_attn|cross_attn)\.(q|k|v|o)|cross_attn\.(k_img|v_img)"
_MLP = r"ffn\.(0|2)"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    # A Wan block has no other Linear (its modulation is a plain parameter): all_linear = attention_mlp.
    "all_linear": rf"{_ATTENTION}|{_MLP}",
}

_RELATIVES = {
    "VaceWanModel": "Wan VACE", "CameraWanModel": "Wan camera control", "HumoWanModel": "Wan HuMo",
    "AnimateWanModel": "Wan Animate",
}
_OWN_FAMILIES = {"WanModel_S2V": "WanS2V"}  # a relative the Wan adapter refuses because its own family trains it

MASK_CHANNELS = 4  # WAN21.concat_cond's mask: one channel per pixel frame of a latent frame
EXPERTS = ("none", "high_noise", "low_noise")
TI2V_CHANNELS = 48  # Wan 2.2 VAE latents: ComfyUI detects TI2V-5B (WAN22_T2V) by out_dim 48
T2V_BOUNDARY, I2V_BOUNDARY = 0.875, 0.9  # the Wan 2.2 reference's expert switch (sigma), per task


@dataclass(frozen=True)
class WanOptions:
    """Wan training options.

    ``first_frame_clean``: TI2V-5B image-to-video training (see the module docstring); for a
    text-to-video layout only (an I2V model gets its start frame through the concatenated latent).
    ``expert``: ``none``, or the Wan 2.2 A14B expert this file is (``high_noise`` trains sigmas at or
    above the boundary, ``low_noise`` below it). ``expert_boundary``: that boundary sigma; 0 takes the
    Wan 2.2 reference's (0.875 text-to-video, 0.9 image-to-video, from the model's layout).
    Preflight (:meth:`WanAdapter.preflight_problems`) refuses ``first_frame_clean`` on a model that is not
    TI2V, ``expert`` on one that cannot be an A14B expert (TI2V-5B, Wan 2.1 I2V with clip vision; the
    width is not checked) and an expert range the Timestep Sampling bounds leave empty.
    """

    first_frame_clean: bool = False
    expert: str = "none"
    expert_boundary: float = 0.0

    def problems(self) -> list[str]:
        out = []
        if self.expert not in EXPERTS:
            out.append(f"expert must be one of {', '.join(EXPERTS)} (got {self.expert!r}).")
        if not 0.0 <= self.expert_boundary < 1.0:
            out.append(f"expert_boundary must be in [0, 1) (0 = the Wan 2.2 default; got {self.expert_boundary}).")
        if self.expert_boundary and self.expert == "none":
            out.append("expert_boundary is set but expert is none: choose high_noise or low_noise, or clear it.")
        return out


@dataclass(frozen=True)
class StartImageExtra(ExtraSpec):
    """An extra the Cache node builds on request: ``fix`` is what the user sets when it is missing."""

    fix: str = ""


def _layout_name(dm: nn.Module) -> str:
    """``"TI2V"`` (Wan 2.2 TI2V-5B: 48 channels, as ComfyUI's detection tells it), ``"I2V"`` (a
    concatenated start image) or ``"T2V"``."""
    if _concat_channels(dm):
        return "I2V"
    return "TI2V" if int(dm.out_dim) == TI2V_CHANNELS else "T2V"


def _concat_channels(dm: nn.Module) -> int:
    """Channels concatenated to the noise (0 for text-to-video)."""
    return int(dm.in_dim) - int(dm.out_dim)


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.wan.model import WanModel

    if not isinstance(dm, WanModel):
        return f"{type(dm).__name__} is not a Wan model; the Wan adapter cannot train it."
    if type(dm) is not WanModel:
        if type(dm).__name__ in _OWN_FAMILIES:
            return (f"{type(dm).__name__} is trained by the {_OWN_FAMILIES[type(dm).__name__]} family, not the Wan "
                    "adapter; load it with its own ComfyUI model class.")
        name = _RELATIVES.get(type(dm).__name__, type(dm).__name__)
        return (f"{name} models are not supported yet: their blocks take extra streams the Wan adapter does not "
                "feed. Wan 2.1 / 2.2 text-to-video, TI2V and image-to-video models are supported.")
    if getattr(dm, "ref_conv", None) is not None:
        return "Wan models with a reference-image convolution (Fun control 2.2) are not supported yet."
    extra = _concat_channels(dm)
    if extra not in (0, MASK_CHANNELS + int(dm.out_dim)):
        return (f"This Wan model takes {dm.in_dim} input channels for {dm.out_dim} output channels; the adapter "
                f"builds {dm.out_dim} (text-to-video) or {2 * int(dm.out_dim) + MASK_CHANNELS} (noise, mask and "
                "start-image latent of image-to-video), not control or inpainting layouts.")
    if dm.img_emb is not None and extra == 0:
        return "This Wan model has a clip-vision embedding but no concatenated start frame, which no Wan release has."
    return None


class WanEmbed(StageLayer):
    """Patch embedding, time embedding and its projection, text (and clip-vision) embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "patch_embedding", "time_embedding", "time_projection", "text_embedding")
        if dm.img_emb is not None:
            self.adopt("img_emb", dm.img_emb, "img_emb")
        self.patch_size = tuple(dm.patch_size)
        self.freq_dim = dm.freq_dim
        self.dim = dm.dim

    def forward(self, inputs):
        import comfy.ldm.common_dit
        from comfy.ldm.wan.model import sinusoidal_embedding_1d

        x, t, context, *clip = inputs
        clip_fea = clip[0] if clip else None
        image_tokens = -1 if clip_fea is None else clip_fea.shape[-2]
        sizes = torch.tensor([*x.shape[-3:], image_tokens], dtype=torch.int64, device=x.device)
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch_size)
        x = self.patch_embedding(x.float()).to(x.dtype)
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype))
        e = e.reshape(t.shape[0], -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))
        context = self.text_embedding(context)
        if clip_fea is not None and hasattr(self, "img_emb"):
            context = torch.cat([self.img_emb(clip_fea), context], dim=1)
        return x, e, e0, context, sizes


class WanBlock(StageLayer):
    """One attention block (self-attention with RoPE, text (and image) cross-attention, FFN)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        # Attributes read by ComfyUI's own WanModel.rope_encode, which is reused below (no parameters).
        self.rope_embedder = dm.rope_embedder
        self.patch_size = tuple(dm.patch_size)
        self.dim, self.num_heads = dm.dim, dm.num_heads
        self._rope_encode = type(dm).rope_encode
        self.last = last

    def forward(self, inputs):
        x, e, e0, context, sizes = inputs
        f, h, w, image_tokens = (int(v) for v in sizes)
        freqs = self._rope_encode(self, f, h, w, device=x.device, dtype=x.dtype, transformer_options={})
        context_img_len = None if image_tokens < 0 else image_tokens
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, e=e0, freqs=freqs, context=context, context_img_len=context_img_len,
                           transformer_options={})
        if self.last:
            return x, e, sizes
        return x, e, e0, context, sizes


class WanHead(StageLayer):
    """Final modulated projection, then un-patchify and crop to the input latent size."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("head", dm.head, "head")
        # Attributes read by ComfyUI's own WanModel.unpatchify, which is reused below.
        self.out_dim = dm.out_dim
        self.patch_size = tuple(dm.patch_size)
        self._unpatchify = type(dm).unpatchify

    def forward(self, inputs):
        x, e, sizes = inputs
        f, h, w = (int(v) for v in sizes[:3])
        x = self.head(x, e)
        grid = [-(-size // p) for size, p in zip((f, h, w), self.patch_size, strict=True)]
        return self._unpatchify(self, x, grid)[:, :, :f, :h, :w]


def start_frame_mask(latent: torch.Tensor) -> torch.Tensor:
    """``[B, 4, F, H, W]``: 1 on the first latent frame, 0 elsewhere — what ``WAN21.concat_cond`` makes of
    ``WanImageToVideo``'s ``concat_mask`` for one start image (``1 - mask``, repeated to 4 channels)."""
    b, _, f, h, w = latent.shape
    first = torch.ones(b, MASK_CHANNELS, 1, h, w, dtype=latent.dtype, device=latent.device)
    return torch.cat([first, first.new_zeros(b, MASK_CHANNELS, f - 1, h, w)], dim=2)


def clean_first_frame(noisy: torch.Tensor, clean: torch.Tensor, timestep: torch.Tensor,
                      temporal_patch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(network input, per-frame timestep [B, F])`` with the first latent frame clean.

    As ComfyUI samples with a noise mask that is 0 on the first frame: the sampler puts the clean
    latent there (``WAN22.scale_latent_inpaint`` keeps it unscaled; flow models' ``calculate_input`` is
    the identity) and ``WAN22.process_timestep`` gives each latent frame the timestep times the mean of
    its mask, so 0 on the first frame."""
    if temporal_patch != 1:
        raise NotImplementedError("A clean first frame needs one latent frame per token frame (temporal patch 1).")
    frames = noisy.shape[2]
    x = torch.cat([clean[:, :, :1].to(noisy.dtype), noisy[:, :, 1:]], dim=2)
    t = timestep.float().view(-1, 1)
    t = torch.cat([torch.zeros_like(t), t.expand(-1, frames - 1)], dim=1)
    return x, t


def single_model_expert_problems(options: object, model_name: str) -> list[str]:
    """The ``expert`` option on a Wan relative that is one model for every noise level (VACE, S2V), named."""
    if isinstance(options, WanOptions) and options.expert != "none":
        return [f"Wan option expert '{options.expert}' is for the two files of a Wan 2.2 A14B model; {model_name} "
                "is one model for every noise level: set expert to none (and expert_boundary to 0)."]
    return []


class WanAdapter:
    name = "Wan"
    options_type = WanOptions
    presets = (ai_toolkit("Wan 2.1 14B, 24 GB", "train_lora_wan21_14b_24gb", 32, resolutions=(632,)),
               ai_toolkit("Wan 2.1 1.3B, 24 GB", "train_lora_wan21_1b_24gb", 32, quantized_base="", resolutions=(632,)),
               ai_toolkit("Wan 2.2 14B, 24 GB", "train_lora_wan22_14b_24gb", 32,
                          quantized_base="4-bit (with an accuracy-recovery adapter)"))

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.blocks)
        if n == 0:
            raise ValueError("This Wan model has no attention blocks; nothing to train.")
        return [WanEmbed(dm), *(WanBlock(dm, i, last=i == n - 1) for i in range(n)), WanHead(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([WanBlock.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"blocks\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        pt, ph, pw = (int(p) for p in diffusion_model.patch_size)
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=4)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(text width, 0)``: UMT5-XXL's 4096 for every Wan model; Wan takes no pooled vector."""
        return int(diffusion_model.text_dim), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        dm = diffusion_model
        out = {}
        if _concat_channels(dm):
            clip = (" and connect the CLIP vision model of Wan 2.1 I2V (e.g. clip_vision_h, 'Load CLIP Vision') to its "
                    "clip_vision input" if dm.img_emb is not None else "")
            out[CONCAT_LATENT] = StartImageExtra(
                shape=("C", "F", "H", "W"), is_latent=True,
                description="the start-image latent (the VAE latent of the clip's first frame followed by gray "
                            "frames, as WanImageToVideo encodes it)",
                fix=f"set start_image to first_frame on 'Cache Latents & Text'{clip}, and cache again")
        if dm.img_emb is not None:
            out[CLIP_FEA] = ExtraSpec(
                shape=("*", 1280), required=False,
                description="clip-vision features of the first frame (CLIP Vision Encode, penultimate hidden states)")
        return out

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the (padded) latent, as ``patch_embedding`` cuts it; an image is one frame."""
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        return math.prod(-(-s // int(p)) for s, p in zip(sizes, diffusion_model.patch_size, strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        options = batch.options if isinstance(batch.options, WanOptions) else WanOptions()
        x, t = batch.noisy, batch.timestep
        image = batch.extras.get(CONCAT_LATENT)
        if options.first_frame_clean and image is not None:
            raise ValueError("first_frame_clean is for the TI2V-5B layout; an image-to-video model (36 input "
                             "channels) gets its start frame through the concatenated start-image latent: "
                             "leave first_frame_clean off.")
        if options.first_frame_clean and x.shape[2] > 1:
            if batch.clean is None:
                raise ValueError("first_frame_clean needs the clean latent in the batch.")
            x, t = clean_first_frame(x, batch.clean, t)
        if image is not None:
            x = torch.cat([x, start_frame_mask(x), image.to(x.dtype)], dim=1)
        clip_fea = batch.extras.get(CLIP_FEA)
        return (x, t, batch.cond) if clip_fea is None else (x, t, batch.cond, clip_fea)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        """With ``first_frame_clean``, 0 on the first latent frame (it is given, not predicted)."""
        if not (isinstance(options, WanOptions) and options.first_frame_clean):
            return None
        if len(latent_shape) != 4 or latent_shape[1] < 2:
            return None  # an image: trains as text-to-image
        mask = torch.ones(1, latent_shape[1], 1, 1)
        mask[:, 0] = 0.0
        return mask

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI's UMT5 tokenizer pads every caption to at least 512 tokens and its encoder zeroes the
        padded positions (``zero_out_masked``), so the cached conds already end in zero tokens and
        appending more zeros is what a longer caption's batch mate would see at inference; ComfyUI
        gives Wan no text attention mask."""
        return max(lengths)

    def sigma_bounds(self, diffusion_model: nn.Module, options: object) -> tuple[float, float] | None:
        """The sigma range of the Wan 2.2 expert being trained, or None (every sigma)."""
        if not isinstance(options, WanOptions) or options.expert == "none":
            return None
        boundary = self.expert_boundary(diffusion_model, options)
        return (boundary, 1.0) if options.expert == "high_noise" else (0.0, boundary)

    def expert_boundary(self, diffusion_model: nn.Module, options: WanOptions) -> float:
        if options.expert_boundary:
            return options.expert_boundary
        return I2V_BOUNDARY if _concat_channels(diffusion_model) else T2V_BOUNDARY

    def preflight_problems(self, diffusion_model: nn.Module, facts) -> list[str]:
        """Wan options that do not fit this model or the run's timesteps (training/pipelines/checks.py
        ``FamilyFacts``), each naming the option and the fix."""
        from ..objective.timesteps import MIN_SIGMA_RANGE

        options, dm = facts.options, diffusion_model
        if not isinstance(options, WanOptions):
            return []
        out = []
        layout = _layout_name(dm)
        if options.first_frame_clean and layout != "TI2V":
            how = ("gets its start frame through the concatenated start-image latent" if layout == "I2V" else
                   "has no per-frame timestep in ComfyUI (WAN22.process_timestep is the TI2V model class's), so a "
                   "clean first frame would train what its sampler never does")
            out.append(f"Wan option first_frame_clean is for Wan 2.2 TI2V-5B ({TI2V_CHANNELS} latent channels); this "
                       f"{layout} model {how}: turn first_frame_clean off, or load the TI2V-5B model.")
        if options.expert != "none" and (layout == "TI2V" or dm.img_emb is not None):
            what = ("Wan 2.2 TI2V-5B is one model for every noise level" if layout == "TI2V" else
                    "this Wan 2.1 image-to-video model (clip-vision input) is one model for every noise level")
            out.append(f"Wan option expert '{options.expert}' is for the two files of a Wan 2.2 A14B model (high-noise "
                       f"and low-noise experts); {what}: set expert to none (and expert_boundary to 0).")
        bounds = self.sigma_bounds(dm, options)
        if bounds is not None:
            ts = facts.timesteps
            low, high = max(ts.sigma_min, bounds[0]), min(ts.sigma_max, bounds[1])
            if high - low < MIN_SIGMA_RANGE:
                out.append(f"Wan option expert '{options.expert}' trains sigmas in [{bounds[0]:g}, {bounds[1]:g}] "
                           f"(expert_boundary {self.expert_boundary(dm, options):g}), and Timestep Sampling's "
                           f"sigma_min {ts.sigma_min:g} / sigma_max {ts.sigma_max:g} leave (almost) nothing of it: "
                           "widen sigma_min/sigma_max on the Timestep Sampling node (or disconnect it), or change "
                           "expert_boundary.")
        return out

    def run_metadata(self, diffusion_model: nn.Module, options: object) -> dict[str, str]:
        """LoRA file metadata of this run's Wan options (the expert and its boundary, a clean first frame)."""
        if not isinstance(options, WanOptions):
            return {}
        out = {}
        if options.expert != "none":
            out["wan.expert"] = options.expert
            out["wan.expert_boundary"] = str(self.expert_boundary(diffusion_model, options))
        if options.first_frame_clean:
            out["wan.first_frame_clean"] = "true"
        return out


ADAPTER = register(WanAdapter(), model_classes=("WAN21",))
