"""HunyuanVideo 1.5 (``model_base.HunyuanVideo15``: ComfyUI's ``HunyuanVideo`` network with 1.5's inputs) as stage layers.

Why a family of its own: ComfyUI builds 1.5 on the HunyuanVideo network, but its inputs differ from 1.0's in
every way the stage tuple sees. There is no pooled vector; the text is Qwen2.5-VL's 3584-wide states
plus the ByT5 glyph states of a caption's quoted text (``txt_byt5``, mapped by ``byt5_in``), each tagged by
``cond_type_embedding`` (0 text, 1 ByT5, 2 vision) and joined ByT5 first; the latent is the 32-channel,
16x-downscaled video latent (1 x 1 x 1 patches), and the network input is that noise with 33 channels
concatenated (``HunyuanVideo15.concat_cond``: 32 start-image latent channels and 1 mask channel).

Stage tuples (``B`` batch, ``T`` text tokens, ``G`` ByT5 tokens (0 without), ``N`` video tokens):

- embed: ``(x [B, 32 or 65, F, H, W], timestep [B], context [B, T, 3584], guidance [B], keep [B, V+G+T or 0],
  txt_byt5 [B, G, 1472] or [B, 0, 0][, clip_fea [B, V, 1152]])`` -> ``(img, txt [B, V+G+T, hidden], vec, keep,
  sizes)``: a 32-channel ``x`` gets the concat channels as text-to-video has them (``concat_cond`` without a
  start image: all zero; image-to-video inputs arrive with them, see below), ``img_in``, ``time_in``
  (+ ``guidance_in`` where the model has one), the token refiner ``txt_in`` over the text with its mask, the
  text's condition-type embedding, then ``byt5_in`` over the ByT5 states with theirs, put in front, then
  ``vision_in`` over SigLIP's states with theirs (image-to-video with a CLIP vision model), in front of all;
- each double and each single block but the last: the same tuple; the last gives ``(img, vec, sizes)``;
- final: ``(img, vec, sizes)`` -> the prediction (HunyuanVideo's final layer and 3-D un-patchify).

``sizes`` is int64 ``(F, H, W)``: each block recomputes the parameter-free rotary embedding from positions
made by ComfyUI's own ``HunyuanVideo.img_ids`` (text and ByT5 tokens at 0). ``keep`` (int64, 1 = a real
token) is empty when every token is real: ComfyUI then passes no mask (``HunyuanVideo15.extra_conds`` drops
an all-ones mask). Otherwise it is the ByT5 tokens' (up to each one's last non-zero token), then the cached
text mask (or each cond's tokens up to its last non-zero one); each block turns it into ``forward_orig``'s
additive key mask, per example. (ComfyUI's own forward takes a text mask only without ByT5 states: its
mask covers the text alone; the trainer masks both.)

Loss: ``ModelType.FLOW`` with the config's shift 7.0 (a ModelSamplingSD3 node before Train LoRA is
replayed), CONST target; training/objective takes both from the model.

Image-to-video: a cache made with the Cache node's ``start_image = first_frame_alone`` (and the SigLIP CLIP vision
model, ``sigclip_vision_patch14_384``, connected to its ``clip_vision``) trains as ComfyUI samples after
``HunyuanVideo15ImageToVideo`` and ``CLIP Vision Encode`` (crop center, as the 1.5 I2V template): the first stage
joins the noise, the start-image latent (the clip's first frame encoded alone, zero latent frames after it,
``process_latent_in`` like the training latent: extra ``concat_latent_alone``) and ``concat_mask``'s channel (1 on
the start image's latent frame) as ``HunyuanVideo15.concat_cond`` does, and the embed stage puts ``vision_in`` over
SigLIP's last hidden state (extra ``clip_vision_last``, ComfyUI's ``clip_fea``) in front of the text as
``forward_orig`` does. ComfyUI's sampling conditions on the start image through these alone (the node gives
the latent no noise mask), so every latent frame is noised with the same sigma and in the loss, as there.
Without a start image the family trains text-to-video (the 1.5 image-to-video checkpoint too, as ComfyUI
samples it without one); a Wan ``first_frame`` cache is refused naming ``first_frame_alone``
(:meth:`HunyuanVideo15Adapter.start_image_problem`).

Refused by name: the super-resolution distilled model (``HunyuanVideo15_SR_Distilled``: 98 input channels,
the low-resolution video latent concatenated to the noise, which the cache does not hold) and MeanFlow
distillations (``time_r_in`` embeds the sampler's next sigma, which a training step has none of).

ComfyUI 0.3.75 has the class too (image tokens before text there, read from the blocks as
:mod:`.hunyuan_video` does); the family trains on both hosts.

Fixture tiers (tests/family_rows/hunyuan_video15.py): a detected file (hidden 128, two double blocks, SigLIP's
1152-wide vision projection that detection matches on, no ByT5 mapper: 3.30 M), and, because detection pins
128-wide heads and a 7 M ByT5 mapper, two narrower models in memory from ComfyUI's own ``HunyuanVideo15`` config
class (with a narrow ByT5 mapper of ComfyUI's class, or a text mask) that tests/test_stage_split.py splits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..cache.start_image import CLIP_VISION_LAST, CONCAT_LATENT_ALONE
from .base import Batch, ExtraSpec, Geometry, StageLayer, register
from .hunyuan_image import HunyuanImageAdapter
from .hunyuan_video import (
    HunyuanDoubleBlock,
    HunyuanFinal,
    HunyuanSingleBlock,
    _image_first,
)
from .out_of_place import OutOfPlaceResidualAdds
from .qwen_image import _KeepInGraph

FAMILY = "HunyuanVideo15"
BYT5 = "conditioning_byt5small"  # the text encoder's cond key; model_base.HunyuanVideo15 hands it as txt_byt5
# LoRA targets: HunyuanImage 2.1's (the same blocks; hunyuan_image.py)
_TEXT, _BYT5, _VISION = 0, 1, 2  # cond_type_embedding rows


def _concat_channels(dm: nn.Module) -> int:
    """Channels ``concat_cond`` appends to the noise: 33 (image latent + mask) on every 1.5 release."""
    return int(dm.img_in.proj.weight.shape[1]) - int(dm.out_channels)


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    if not isinstance(dm, HunyuanVideo):
        return f"{type(dm).__name__} is not ComfyUI's HunyuanVideo network; the {FAMILY} adapter cannot train it."
    if len(dm.patch_size) != 3:
        return f"This {FAMILY} model has 2-D patches (a HunyuanImage layout); HunyuanVideo 1.5 video models are supported."
    out = int(dm.out_channels)
    if _concat_channels(dm) == 2 * out + 2:
        return ("The HunyuanVideo 1.5 super-resolution distilled model (HunyuanVideo15_SR_Distilled) is not supported: "
                "it is conditioned on the low-resolution video latent concatenated to the noise, which the cache does "
                "not hold. The HunyuanVideo 1.5 480p / 720p text-to-video models are supported.")
    if _concat_channels(dm) not in (0, out + 1):
        return (f"This {FAMILY} model takes {_concat_channels(dm)} concatenated channels, a layout no HunyuanVideo 1.5 "
                f"release has ({out + 1}: start-image latent and mask); it cannot be trained.")
    if dm.time_r_in is not None:
        return ("MeanFlow-distilled HunyuanVideo 1.5 models (time_r_in) are not supported: they embed the sampler's "
                "next sigma, which a training step has none of. The HunyuanVideo 1.5 base models are supported.")
    if not hasattr(dm, "final_layer"):
        return f"This {FAMILY} model has no final layer (a feature extractor); it cannot be trained."
    return None


def start_mask(x: torch.Tensor, frames: int) -> torch.Tensor:
    """``[B, 1, F, H, W]``: 1 on the start image's ``frames`` latent frames, 0 after — what
    ``HunyuanVideo15.concat_cond`` makes of ``HunyuanVideo15ImageToVideo``'s ``concat_mask`` (``1 - mask``)."""
    mask = x.new_zeros(x.shape[0], 1, *x.shape[2:])
    mask[:, :, :frames] = 1
    return mask


class _Positions3D:
    """Rotary embedding and per-example key mask of one latent size, as ``forward_orig`` builds them, in its
    token order (:func:`.hunyuan_video._image_first`)."""

    def __init__(self, dm: nn.Module):
        self.pe_embedder = dm.pe_embedder
        self.patch_size = list(dm.patch_size)
        self._img_ids = type(dm).img_ids
        self.image_first = _image_first(dm)

    def pe_and_mask(self, img, txt, keep, sizes):
        f, h, w = (int(v) for v in sizes)
        bs, n, t = img.shape[0], img.shape[1], txt.shape[1]
        img_ids = self._img_ids(self, img.new_empty(bs, 0, f, h, w))
        txt_ids = torch.zeros((bs, t, 3), device=img.device, dtype=img.dtype)
        pe = self.pe_embedder(torch.cat((img_ids, txt_ids) if self.image_first else (txt_ids, img_ids), dim=1))
        if keep.numel() == 0:
            return pe, None
        mask = torch.zeros((bs, 1, 1, t + n), dtype=img.dtype, device=img.device)
        text = slice(n, n + t) if self.image_first else slice(0, t)
        mask[:, 0, 0, text] = (keep - 1).to(img.dtype) * torch.finfo(img.dtype).max
        return pe, mask


class HunyuanVideo15Embed(StageLayer):
    """Text-to-video concat channels (image-to-video brings its own), patch / time / guidance embeddings, token
    refiner, ByT5 mapper, SigLIP projection, and the condition-type embedding of each token kind."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "img_in", "time_in", "txt_in")
        self.guidance_embed = bool(dm.params.guidance_embed)
        if self.guidance_embed:
            self.adopt("guidance_in", dm.guidance_in, "guidance_in")
        self.byt5_in = None
        if dm.byt5_in is not None:
            self.adopt("byt5_in", dm.byt5_in, "byt5_in")
        self.cond_type_embedding = None
        if dm.cond_type_embedding is not None:
            self.adopt("cond_type_embedding", dm.cond_type_embedding, "cond_type_embedding")
        self.vision_in = None
        if dm.vision_in is not None:
            self.adopt("vision_in", dm.vision_in, "vision_in")
        self.in_channels = int(dm.img_in.proj.weight.shape[1])

    def _typed(self, tokens: torch.Tensor, kind: int) -> torch.Tensor:
        if self.cond_type_embedding is None:
            return tokens
        kinds = torch.full(tokens.shape[:2], kind, dtype=torch.long, device=tokens.device)
        return tokens + self.cond_type_embedding(kinds).to(tokens.dtype)

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding

        x, t, context, guidance, keep, byt5 = inputs[:6]
        vision = inputs[6] if len(inputs) > 6 else None  # image-to-video: SigLIP's last hidden state
        sizes = torch.tensor(list(x.shape[-3:]), dtype=torch.int64, device=x.device)
        missing = self.in_channels - x.shape[1]  # image-to-video inputs come concatenated (first_stage_inputs)
        if missing:  # concat_cond without a start image: zero latent, zero mask
            x = torch.cat((x, x.new_zeros(x.shape[0], missing, *x.shape[2:])), dim=1)
        img = self.img_in(x)
        vec = self.time_in(timestep_embedding(t, 256, time_factor=1.0).to(img.dtype))
        if self.guidance_embed:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        glyphs = byt5.shape[1] if self.byt5_in is not None else 0
        seen = vision.shape[1] if vision is not None else 0
        text_keep_ = keep[:, seen + glyphs:]
        mask = (text_keep_ - 1).to(img.dtype) * torch.finfo(img.dtype).max if keep.numel() else None
        txt = self._typed(self.txt_in(context, t, mask, transformer_options={}), _TEXT)
        if glyphs:
            txt = torch.cat((self._typed(self.byt5_in(byt5), _BYT5), txt), dim=1)  # ByT5 first, as 1.5 joins them
        if vision is not None:  # the vision states in front of all, as forward_orig joins them
            txt = torch.cat((self._typed(self.vision_in(vision), _VISION).to(txt.dtype), txt), dim=1)
        return img, txt, vec, keep, sizes


class HunyuanVideo15Double(HunyuanDoubleBlock):
    """A double block; the last one of a model without single blocks (the 1.5 releases) keeps the text stream
    it drops in the graph with a zero gradient (:class:`.qwen_image._KeepInGraph`: every LoRA parameter gets one)."""

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__(dm, index, last)
        self.positions = _Positions3D(dm)

    def forward(self, inputs):
        if not self.last:
            return super().forward(inputs)
        img, txt, vec, keep, sizes = inputs
        pe, attn_mask = self.positions.pe_and_mask(img, txt, keep, sizes)
        with OutOfPlaceResidualAdds(img, txt):
            img, txt = self.block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options={})
        return _KeepInGraph.apply(img, txt), vec, sizes


class HunyuanVideo15Single(HunyuanSingleBlock):
    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__(dm, index, last)
        self.positions = _Positions3D(dm)


class HunyuanVideo15Adapter(HunyuanImageAdapter):
    """HunyuanImage 2.1's adapter on video: its own layers (3-D positions, the concat channels, SigLIP's states),
    3-D patches, ByT5 tokens ahead of the text in the mask, image-to-video from a ``first_frame_alone`` cache."""

    name = FAMILY
    layer_classes = (HunyuanVideo15Embed, HunyuanVideo15Double, HunyuanVideo15Single, HunyuanFinal)
    support_problem = staticmethod(_support_problem)
    label = "HunyuanVideo 1.5"
    text_encoder = "HunyuanVideo 1.5's Qwen2.5-VL text encoder (CLIP type hunyuan_video_15)"
    byt5_first = True  # ByT5 tokens come first

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        pt, ph, pw = (int(p) for p in diffusion_model.patch_size[-3:])
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=4)

    def start_image_problem(self) -> str:
        """Why a cache with Wan's start-image conditioning cannot train this family (preflight says it)."""
        return ("it is Wan's start image (start_image first_frame: the first frame and gray frames encoded together, "
                "CLIP-vision penultimate states), and HunyuanVideo 1.5 image-to-video conditions as "
                "HunyuanVideo15ImageToVideo does (the start image encoded alone, zero latent frames after it, SigLIP's "
                "last hidden state): set start_image to first_frame_alone on 'Cache Latents & Text' (with the SigLIP "
                "CLIP vision model connected to clip_vision) and cache again, or set it to none to train "
                "text-to-video")

    def extras(self, diffusion_model: nn.Module) -> dict[str, ExtraSpec]:
        """HunyuanImage's text extras, and the optional image-to-video ones of a ``first_frame_alone`` cache."""
        dm = diffusion_model
        out = dict(super().extras(dm))
        if _concat_channels(dm):
            out[CONCAT_LATENT_ALONE] = ExtraSpec(
                shape=("C", "F", "H", "W"), required=False, is_latent=True,
                description="the start-image latent (the clip's first frame encoded alone, zero latent frames after "
                            "it, as HunyuanVideo15ImageToVideo builds it)")
        if dm.vision_in is not None:
            width = int(dm.vision_in_dim)
            out[CLIP_VISION_LAST] = ExtraSpec(
                shape=("*", width), required=False,
                description="SigLIP features of the first frame (CLIP Vision Encode crop center, last hidden state)")
        return out

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """HunyuanImage's tuple; with a start image (``first_frame_alone`` cache) the noise comes with the start-image
        latent and ``concat_mask``'s channel as ``HunyuanVideo15.concat_cond`` joins them, and SigLIP's states
        follow (their tokens, all real, in front of the mask as in front of the text). ComfyUI's sampling conditions
        on the start image through these alone: every latent frame is noised, timed and in the loss."""
        inputs = super().first_stage_inputs(batch)
        x, t, cond, guidance, keep, byt5 = inputs
        image = batch.extras.get(CONCAT_LATENT_ALONE)
        vision = batch.extras.get(CLIP_VISION_LAST)
        if image is None:
            if vision is not None:
                raise ValueError(f"{self.label} got SigLIP features without the start-image latent: cache with "
                                 "start_image first_frame_alone on 'Cache Latents & Text'.")
            return inputs
        x = torch.cat((x, image.to(x.dtype), start_mask(x, frames=1)), dim=1)
        if vision is None:
            return x, t, cond, guidance, keep, byt5
        if keep.numel():
            keep = torch.cat((keep.new_ones(keep.shape[0], vision.shape[1]), keep), dim=1)
        return x, t, cond, guidance, keep, byt5, vision.to(x.dtype)

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        return math.prod(-(-int(s) // int(p)) for s, p in zip(sizes, diffusion_model.patch_size, strict=True))


ADAPTER = register(HunyuanVideo15Adapter(), model_classes=("HunyuanVideo15",))
