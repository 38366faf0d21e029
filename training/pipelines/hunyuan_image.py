"""HunyuanImage 2.1 (``model_base.HunyuanImage21``, ComfyUI's ``HunyuanVideo`` network with 2-D patches) as stage layers.

Why a family of its own: ComfyUI builds HunyuanImage 2.1 with its HunyuanVideo network, but as another
model class (``model_base.HunyuanImage21`` is no ``model_base.HunyuanVideo``) over 2-D latents: a 1 x 1
patch over the 64-channel, 32x-downscaled latent, two rotary axes (``img_ids_2d``), no pooled vector, and
ByT5 glyph states (``txt_byt5``) mapped by ``byt5_in`` and appended after the text tokens. The double and
single blocks are the HunyuanVideo family's (:mod:`.hunyuan_video`), with 2-D positions.

Stage tuples (``B`` batch, ``T`` text tokens, ``G`` ByT5 tokens (0 without), ``N`` image tokens):

- embed: ``(x [B, C, H, W], timestep [B], context [B, T, 3584], guidance [B], text_mask [B, T or 0],
  txt_byt5 [B, G, 1472] or [B, 0, 0])`` -> ``(img, txt [B, T+G, hidden], vec, keep [B, T+G or 0], sizes)``:
  ``img_in``, ``time_in`` (+ ``guidance_in`` on a guidance-distilled model), the token refiner
  ``txt_in`` over the text with its mask, then ``byt5_in`` over the ByT5 states, appended as
  ``forward_orig`` does;
- each double and each single block but the last: the same tuple, tokens in ``forward_orig``'s order (image
  first on ComfyUI 0.3.75, text first on current ComfyUI, read from the blocks as :mod:`.hunyuan_video` does);
  the last gives ``(img, vec, sizes)``; final: ``final_layer`` and ComfyUI's 2-D un-patchify.

``sizes`` is int64 ``(H, W)``: each block recomputes the parameter-free rotary embedding from positions
made by ComfyUI's own ``HunyuanVideo.img_ids_2d`` (text and ByT5 tokens at 0). ``keep`` (int64, 1 = a
real token) is empty when every token is real: ComfyUI then passes no mask (``extra_conds`` drops an
all-ones mask). Otherwise it is the cached text mask (zero for the tokens a micro-batch appended to a
shorter caption), or, without one, each cond's tokens up to its last non-zero one, then the ByT5 tokens
likewise; each block turns it into ``forward_orig``'s additive key mask, per example.

Loss. ``model_base.HunyuanImage21`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the
config's shift 5.0 (a ModelSamplingSD3 / AuraFlow node before Train LoRA is replayed) and the CONST
target; training/objective takes both from the model.

Text: Qwen2.5-VL's 3584-wide states (ComfyUI's HunyuanImage tokenizer and encoder) with their attention
mask where the encoder gives one (``attention_mask``, as HunyuanVideo's); ``guidance`` (the Train
node's, default 1.0) only on a guidance-distilled model, as ``extra_conds`` hands it; ByT5 states of a
caption's quoted text as the optional ``conditioning_byt5small`` extra (ComfyUI's cond key, which the cache
keeps where the encoder gives it; a caption without quoted text has none, and in a micro-batch with one that
has, zero tokens that the mask leaves out).

Refused by name: HunyuanImage 2.1 Refiner (``model_base.HunyuanImage21Refiner``: 3-D patches over its
own two-frame latent, the image to refine concatenated to the noise, and ``disable_time_r``), MeanFlow
distillations (``time_r_in`` embeds the sampler's next sigma, which training has none of), and
HunyuanVideo 1.5 inputs (vision states, condition-type embedding).

ComfyUI 0.3.75 has this model class too; the family trains on both hosts.

Fixture tier: detection pins 128-wide heads and a 1472 -> 2048 -> 2048 ByT5 mapper (7 M parameters), so
the tests build a tiny model in memory from ComfyUI's own ``HunyuanImage21`` config class with a narrow
``ByT5Mapper`` of ComfyUI's own class (tests/family_rows/hunyuan_image.py, 0.37 M parameters); tests/test_stage_split.py
trains it 2 steps in 1 and 2 gloo stages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .chroma import text_keep
from .hunyuan_video import TEXT_MASK, HunyuanDoubleBlock, HunyuanSingleBlock, HunyuanVideoOptions, _image_first

FAMILY = "HunyuanImage"
BYT5 = "conditioning_byt5small"  # the text encoder's cond key; model_base.HunyuanImage21 hands it as txt_byt5
_TARGETS = {
    "attention": r"(img|txt)_attn\.(qkv|proj)|linear[12]",
    "attention_mlp": r"(img|txt)_attn\.(qkv|proj)|linear[12]|(img|txt)_mlp\.[02]",
    "all_linear": r"(img|txt)_attn\.(qkv|proj)|linear[12]|(img|txt)_mlp\.[02]|((img|txt)_mod|modulation)\.lin",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    if not isinstance(dm, HunyuanVideo):
        return f"{type(dm).__name__} is not ComfyUI's HunyuanVideo network; the {FAMILY} adapter cannot train it."
    if len(dm.patch_size) != 2:
        return ("HunyuanImage 2.1 Refiner (HunyuanImage21Refiner) is not supported: it refines a two-frame latent "
                "with 3-D patches, conditioned on the image to refine concatenated to the noise, which the "
                "cache does not hold. The HunyuanImage 2.1 base model (2-D patches) is supported.")
    if dm.in_channels != dm.out_channels:
        return "HunyuanImage models with an image concatenated to the latent are not supported; text-to-image is."
    if dm.time_r_in is not None:
        return ("MeanFlow-distilled HunyuanImage 2.1 (time_r_in) is not supported: it embeds the sampler's next "
                "sigma, which a training step has none of. The HunyuanImage 2.1 base model is supported.")
    if dm.vision_in is not None or dm.cond_type_embedding is not None:
        return "HunyuanVideo 1.5 inputs (vision states, condition-type embedding) are not supported here."
    if not hasattr(dm, "final_layer"):
        return "This HunyuanImage model has no final layer (a feature extractor); it cannot be trained."
    return None


class _Positions2D:
    """Rotary embedding and per-example key mask of one latent size, as ``forward_orig`` builds them, in its
    token order (:func:`.hunyuan_video._image_first`: image first on 0.3.75, text first on current ComfyUI)."""

    def __init__(self, dm: nn.Module):
        self.pe_embedder = dm.pe_embedder
        self.patch_size = list(dm.patch_size)
        self._img_ids_2d = type(dm).img_ids_2d
        self.image_first = _image_first(dm)

    def pe_and_mask(self, img, txt, keep, sizes):
        h, w = (int(v) for v in sizes)
        bs, n, t = img.shape[0], img.shape[1], txt.shape[1]
        img_ids = self._img_ids_2d(self, img.new_empty(bs, 0, h, w))
        txt_ids = torch.zeros((bs, t, 2), device=img.device, dtype=img.dtype)
        pe = self.pe_embedder(torch.cat((img_ids, txt_ids) if self.image_first else (txt_ids, img_ids), dim=1))
        if keep.numel() == 0:
            return pe, None
        mask = torch.zeros((bs, 1, 1, t + n), dtype=img.dtype, device=img.device)
        text = slice(n, n + t) if self.image_first else slice(0, t)
        mask[:, 0, 0, text] = (keep - 1).to(img.dtype) * torch.finfo(img.dtype).max
        return pe, mask


class HunyuanImageEmbed(StageLayer):
    """Patch, time and guidance embeddings, the token refiner over the text, ``byt5_in`` over the ByT5 states."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "img_in", "time_in", "txt_in")
        self.guidance_embed = bool(dm.params.guidance_embed)
        if self.guidance_embed:
            self.adopt("guidance_in", dm.guidance_in, "guidance_in")
        if dm.byt5_in is not None:
            self.adopt("byt5_in", dm.byt5_in, "byt5_in")
        else:
            self.byt5_in = None

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding

        x, t, context, guidance, keep, byt5 = inputs
        sizes = torch.tensor(list(x.shape[-2:]), dtype=torch.int64, device=x.device)
        img = self.img_in(x)
        vec = self.time_in(timestep_embedding(t, 256, time_factor=1.0).to(img.dtype))
        if self.guidance_embed:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        text_keep_ = keep[:, :context.shape[1]]
        mask = (text_keep_ - 1).to(img.dtype) * torch.finfo(img.dtype).max if keep.numel() else None
        txt = self.txt_in(context, t, mask, transformer_options={})
        if self.byt5_in is not None and byt5.shape[1]:
            txt = torch.cat((txt, self.byt5_in(byt5)), dim=1)
        return img, txt, vec, keep, sizes


class HunyuanImageDouble(HunyuanDoubleBlock):
    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__(dm, index, last)
        self.positions = _Positions2D(dm)


class HunyuanImageSingle(HunyuanSingleBlock):
    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__(dm, index, last)
        self.positions = _Positions2D(dm)


class HunyuanImageFinal(StageLayer):
    """Final modulated projection and ``forward_orig``'s 2-D un-patchify."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size = list(dm.patch_size)
        self.out_channels = dm.out_channels

    def forward(self, inputs):
        img, vec, sizes = inputs
        h, w = (int(v) for v in sizes)
        (ph, pw) = self.patch_size
        img = self.final_layer(img, vec, modulation_dims=None)
        img = img.reshape(img.shape[0], h // ph, w // pw, self.out_channels, ph, pw).permute(0, 3, 1, 4, 2, 5)
        return img.reshape(img.shape[0], self.out_channels, h, w)


class HunyuanImageAdapter:
    """HunyuanImage 2.1; HunyuanVideo 1.5 (hunyuan_video15.py) runs the same network on video and extends this
    adapter through the class attributes below (its layers, support check, text encoder and ByT5 order)."""

    name = FAMILY
    options_type = HunyuanVideoOptions  # guidance, for the guidance-distilled models
    text_extras = {BYT5: True}  # kept by the cache (text_extras.py)
    layer_classes: tuple[type, type, type, type] = (HunyuanImageEmbed, HunyuanImageDouble, HunyuanImageSingle,
                                                    HunyuanImageFinal)  # embed, double, single, final
    support_problem = staticmethod(_support_problem)
    label, text_encoder = "HunyuanImage", "HunyuanImage 2.1's Qwen2.5-VL text encoder"
    byt5_first = False  # where the ByT5 tokens sit in the text mask, as the model's forward joins them

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = self.support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        nd, ns = len(dm.double_blocks), len(dm.single_blocks)
        if nd + ns == 0:
            raise ValueError(f"This {self.label} model has no transformer blocks; nothing to train.")
        embed, double, single, final = self.layer_classes
        layers: list[StageLayer] = [embed(dm)]
        layers += [double(dm, i, last=ns == 0 and i == nd - 1) for i in range(nd)]
        layers += [single(dm, i, last=i == ns - 1) for i in range(ns)]
        return [*layers, final(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.double_blocks) + len(diffusion_model.single_blocks)
        return [False, *([True] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"(double_blocks|single_blocks)\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        ph, pw = (int(p) for p in diffusion_model.patch_size[-2:])  # a refused refiner's 3-D patch too (preflight)
        return Geometry(patch=(1, ph, pw))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(3584, 0)``: Qwen2.5-VL's states (read from the token refiner); no pooled vector."""
        return int(diffusion_model.params.context_in_dim), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        out = {TEXT_MASK: ExtraSpec(shape=("T",), source="text", required=False, follows_text=True,
                                    description="the text attention mask of the text encoder")}
        if diffusion_model.byt5_in is not None:
            width = int(diffusion_model.byt5_in.fc1.in_features)
            out[BYT5] = ExtraSpec(shape=("*", width), source="text", required=False,
                                  description="ByT5 states of the caption's quoted text (txt_byt5)")
        return out

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        return math.prod(-(-int(s) // int(p)) for s, p in zip(latent_shape[-2:], diffusion_model.patch_size[-2:],
                                                                strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError(f"{self.label} needs the text encoder's states, and the cache has none: cache the "
                             f"dataset with {self.text_encoder}.")
        options = batch.options if isinstance(batch.options, HunyuanVideoOptions) else HunyuanVideoOptions()
        x, cond = batch.noisy, batch.cond
        size = x.shape[0]
        mask = batch.extras.get(TEXT_MASK)
        keep = mask.to(torch.int64) if mask is not None else text_keep(cond).to(torch.int64)
        byt5 = batch.extras.get(BYT5)
        if byt5 is None:
            byt5 = x.new_zeros(size, 0, 0)
        else:
            glyphs = text_keep(byt5).to(torch.int64)
            keep = torch.cat((glyphs, keep) if self.byt5_first else (keep, glyphs), dim=1)
        if bool(keep.all()):
            keep = keep.new_zeros(size, 0)  # every token real: ComfyUI passes no mask
        guidance = torch.full((size,), options.guidance, dtype=torch.float32)
        return x, batch.timestep, cond, guidance, keep, byt5

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; shorter ones get zero tokens, masked out of the attention."""
        return max(lengths)


ADAPTER = register(HunyuanImageAdapter(), model_classes=("HunyuanImage21",))
