"""HunyuanVideo text- and image-to-video (``comfy.ldm.hunyuan_video.model.HunyuanVideo``) as pipeline stage layers.

Stage tuples (``B`` batch, ``N`` video tokens, ``T`` text tokens):

- embed: ``(x [B, C, F, H, W], timestep [B], context [B, T, ctx], y [B, 768], guidance [B], text_mask)``
  (image-to-video: ``x`` with the start-image latent's channels; see below)
  (``guidance`` always, unused by models without a guidance embedding)
  -> ``(img, txt, vec, text_mask, sizes)`` (``y`` only with a pooled-vector embedder)
- each double and each single block but the last: the same tuple in and out; the last gives
  ``(img, vec, sizes)``
- final: ``(img, vec, sizes)`` -> the prediction, shaped like ``x``

The blocks are ComfyUI's Flux ``DoubleStreamBlock`` / ``SingleStreamBlock``; the text goes through
HunyuanVideo's token refiner (``txt_in``) in the embed stage. ``sizes`` is int64 ``(F, H, W)`` of the
latent: the rotary embedding has no gradient, so each block recomputes it with the model's
parameter-free ``pe_embedder`` from positions made by ComfyUI's own ``HunyuanVideo.img_ids``.
``text_mask`` is the int64 text attention mask (``[B, 0]`` when there is none: ComfyUI then passes no
mask at all); each block rebuilds the additive attention mask from it as ``forward_orig`` does.

Token order differs by ComfyUI version: 0.3.75 builds the double blocks with ``flipped_img_txt`` and
puts image tokens first (ids, attention mask, single-block sequence); current ComfyUI puts text first.
The layers read the order from the blocks, so they follow ComfyUI's forward on both.

Image-to-video (``model_base.HunyuanVideoI2V``, 33 input channels; SkyReels I2V,
``HunyuanVideoSkyreelsI2V``, 32) trains as ComfyUI samples after ``HunyuanImageToVideo`` with its default
``guidance_type`` "v1 (concat)": the first stage joins the noise, the start-image latent (the clip's first frame
encoded alone, zero latent frames after it, ``process_latent_in`` like the training latent: extra
``concat_latent_alone`` of the Cache node's ``start_image = first_frame_alone``) and, for HunyuanVideoI2V,
``concat_cond``'s ``mask_inverted`` channel (1 on the start image's latent frame), in ``concat_keys`` order. Every
latent frame is noised and in the loss, as ComfyUI's v1 sampling does (the node gives the latent no noise mask).
HunyuanVideoI2V's prompt is encoded with the start image's CLIP-vision tokens as
``TextEncodeHunyuanVideo_ImageToVideo`` does (training/cache/start_image_prompt.py: the Cache node does it with
``first_frame_alone``, llava_llama3_vision connected to ``clip_vision`` and this family's text encoder); its text
entries carry the extra ``start_image_prompt`` and preflight refuses a cache without it. SkyReels I2V takes plain
prompts (no CLIP vision model). The other guidance types of ``HunyuanImageToVideo`` condition otherwise and are not
what this family trains: "v2 (replace)" (the "fixed" I2V release, same 33-channel layout, so the weights cannot
tell it apart) puts the start latent into the noised latent under a noise mask (a clean first frame) and
embeds ``guiding_frame_index`` as a second modulation for the first frame's tokens; "custom" passes the start
latent as ``ref_latent`` tokens. Sample a LoRA trained here with v1.

Refused by name: other concatenated-channel layouts, MeanFlow distillations, HunyuanImage (2-D patches).
HunyuanVideo 1.5 (``model_base.HunyuanVideo15``, a subclass) is its own family (:mod:`.hunyuan_video15`); this
one refuses a network with 1.5's inputs under another class.

Fixture tier (devkit/fixtures_video.py ``build_tiny_hunyuan_video``): detected by ComfyUI's own
detection on 0.3.75 and current ComfyUI; hidden 128 (1 head), 1 + 1 blocks, text width 768 read from
the weights, pooled 768 (fixed by detection): 1.83 M parameters; with 33 input channels, ComfyUI detects it as
``HunyuanVideoI2V`` (tests/family_rows/hunyuan_video.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..cache.start_image import CONCAT_LATENT_ALONE
from ..cache.start_image_prompt import START_IMAGE_PROMPT
from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .hunyuan_video_prompt import HUNYUAN_VIDEO_I2V_PROMPT
from .out_of_place import OutOfPlaceResidualAdds
from .wan import StartImageExtra

_ATTENTION = r"(img|txt)_attn\.(qkv|proj)|linear[12]"
_MLP = r"(img|txt)_mlp\.[02]"
_MODULATION = r"((img|txt)_mod|modulation)\.lin"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}
TEXT_MASK = "attention_mask"


@dataclass(frozen=True)
class HunyuanVideoOptions:
    """``guidance``: what the guidance embedding sees while training. 1.0, as musubi-tuner and
    diffusion-pipe train HunyuanVideo LoRAs: the LoRA learns content, not a guidance level, and samples
    at ComfyUI's usual 6.0."""

    guidance: float = 1.0

    def problems(self) -> list[str]:
        if not 0.0 <= self.guidance <= 100.0:
            return [f"guidance must be between 0 and 100 (got {self.guidance})."]
        return []


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    if not isinstance(dm, HunyuanVideo):
        return f"{type(dm).__name__} is not a HunyuanVideo model; the HunyuanVideo adapter cannot train it."
    if len(dm.patch_size) != 3:
        return "HunyuanImage (2-D patches) is not supported yet; HunyuanVideo text-to-video models are."
    if _concat_channels(dm) not in (0, int(dm.out_channels), int(dm.out_channels) + 1):
        return (f"This HunyuanVideo model takes {_concat_channels(dm)} concatenated input channels, a layout no "
                "HunyuanVideo release has (HunyuanVideoI2V: start-image latent and mask; SkyReels I2V: start-image "
                "latent); it cannot be trained.")
    if dm.byt5_in is not None or dm.vision_in is not None or dm.cond_type_embedding is not None:
        return ("This network has HunyuanVideo 1.5 inputs (ByT5, vision, condition types) but is no HunyuanVideo15 "
                "model class; HunyuanVideo 1.5 trains as the HunyuanVideo15 family (load it with ComfyUI's own loader).")
    if dm.time_r_in is not None:
        return "MeanFlow-distilled HunyuanVideo models are not supported yet; HunyuanVideo text-to-video models are."
    return None


def _concat_channels(dm: nn.Module) -> int:
    """Channels ``concat_cond`` appends to the noise: 0 (text-to-video), 16 (SkyReels I2V: ``concat_image``) or
    17 (HunyuanVideoI2V: ``concat_image`` and ``mask_inverted``)."""
    return int(dm.in_channels) - int(dm.out_channels)


def start_frame_channel(x: torch.Tensor) -> torch.Tensor:
    """``[B, 1, F, H, W]``: ``concat_cond``'s ``mask_inverted`` after ``HunyuanImageToVideo`` (v1), 1 on the start
    image's one latent frame (``concat_mask`` is 0 there), 0 after."""
    mask = x.new_zeros(x.shape[0], 1, *x.shape[2:])
    mask[:, :, :1] = 1
    return mask


def _image_first(dm: nn.Module) -> bool:
    """Image tokens before text ones (0.3.75's ``flipped_img_txt`` blocks), else text first (current)."""
    return bool(len(dm.double_blocks) and getattr(dm.double_blocks[0], "flipped_img_txt", False))


class _Positions:
    """Rotary embedding and attention mask of one example shape, as ``forward_orig`` builds them."""

    def __init__(self, dm: nn.Module):
        self.pe_embedder = dm.pe_embedder
        self.patch_size = list(dm.patch_size)
        self._img_ids = type(dm).img_ids
        self.image_first = _image_first(dm)

    def pe_and_mask(self, img, txt, text_mask, sizes):
        f, h, w = (int(v) for v in sizes)
        bs = img.shape[0]
        img_ids = self._img_ids(self, img.new_empty(bs, 0, f, h, w))
        txt_ids = torch.zeros((bs, txt.shape[1], 3), device=img.device, dtype=img.dtype)
        ids = torch.cat((img_ids, txt_ids) if self.image_first else (txt_ids, img_ids), dim=1)
        pe = self.pe_embedder(ids)
        if text_mask.numel() == 0:
            return pe, None
        additive = (text_mask - 1).to(img.dtype) * torch.finfo(img.dtype).max
        attn_mask = torch.zeros((1, 1, img.shape[1] + txt.shape[1]), dtype=img.dtype, device=img.device)
        if self.image_first:
            attn_mask[:, 0, img.shape[1]:] = additive
        else:
            attn_mask[:, 0, :txt.shape[1]] = additive
        return pe, attn_mask


class HunyuanEmbed(StageLayer):
    """Patch, time, pooled-vector and guidance embeddings, and the token refiner over the text."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        for name in ("img_in", "time_in", "txt_in"):
            self.adopt(name, getattr(dm, name), name)
        if dm.vector_in is not None:
            self.adopt("vector_in", dm.vector_in, "vector_in")
        self.guidance_embed = bool(dm.params.guidance_embed)
        if self.guidance_embed:
            self.adopt("guidance_in", dm.guidance_in, "guidance_in")
        self.vec_in_dim = dm.params.vec_in_dim
        self.in_channels = int(dm.in_channels)

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding

        x, t, context, *rest = inputs
        y = rest[0] if len(rest) == 3 else None  # (y, guidance, text mask) or (guidance, text mask)
        guidance, text_mask = rest[-2], rest[-1]
        sizes = torch.tensor(list(x.shape[-3:]), dtype=torch.int64, device=x.device)
        if self.in_channels - x.shape[1] == 1:  # HunyuanVideoI2V: concat_cond's mask_inverted after the image
            x = torch.cat((x, start_frame_channel(x)), dim=1)
        img = self.img_in(x)
        vec = self.time_in(timestep_embedding(t, 256, time_factor=1.0).to(img.dtype))
        if y is not None and hasattr(self, "vector_in"):
            vec = vec + self.vector_in(y[:, :self.vec_in_dim])
        if self.guidance_embed:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        mask = None
        if text_mask.numel():
            mask = (text_mask - 1).to(img.dtype) * torch.finfo(img.dtype).max
        txt = self.txt_in(context, t, mask, transformer_options={})
        return img, txt, vec, text_mask, sizes


class HunyuanDoubleBlock(StageLayer):
    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.double_blocks[index], f"double_blocks.{index}")
        self.positions = _Positions(dm)
        self.last = last

    def forward(self, inputs):
        img, txt, vec, text_mask, sizes = inputs
        pe, attn_mask = self.positions.pe_and_mask(img, txt, text_mask, sizes)
        with OutOfPlaceResidualAdds(img, txt):
            img, txt = self.block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options={})
        if self.last:
            return img, vec, sizes
        return img, txt, vec, text_mask, sizes


class HunyuanSingleBlock(StageLayer):
    """One single-stream block over the joined sequence (in ComfyUI's order), split again after it."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.single_blocks[index], f"single_blocks.{index}")
        self.positions = _Positions(dm)
        self.last = last

    def forward(self, inputs):
        img, txt, vec, text_mask, sizes = inputs
        pe, attn_mask = self.positions.pe_and_mask(img, txt, text_mask, sizes)
        n = img.shape[1]
        first = self.positions.image_first
        joined = torch.cat((img, txt) if first else (txt, img), dim=1)
        with OutOfPlaceResidualAdds(joined):
            joined = self.block(joined, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options={})
        img, txt = (joined[:, :n], joined[:, n:]) if first else (joined[:, -n:], joined[:, :-n])
        if self.last:
            return img, vec, sizes
        return img, txt, vec, text_mask, sizes


class HunyuanFinal(StageLayer):
    """Final modulated projection and ComfyUI's un-patchify (``forward_orig``'s reshape and permute)."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size = list(dm.patch_size)
        self.out_channels = dm.out_channels

    def forward(self, inputs):
        img, vec, sizes = inputs
        f, h, w = (int(v) for v in sizes)
        img = self.final_layer(img, vec, modulation_dims=None)
        shape = [s // p for s, p in zip((f, h, w), self.patch_size, strict=True)]
        img = img.reshape([img.shape[0], *shape, self.out_channels, *self.patch_size])
        img = img.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return img.reshape(img.shape[0], self.out_channels, f, h, w)


class HunyuanVideoAdapter:
    name = "HunyuanVideo"
    options_type = HunyuanVideoOptions
    start_image_prompts = (HUNYUAN_VIDEO_I2V_PROMPT,)  # HunyuanVideoI2V's captions (training/cache/start_image_prompt.py)

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        nd, ns = len(dm.double_blocks), len(dm.single_blocks)
        if nd + ns == 0:
            raise ValueError("This HunyuanVideo model has no transformer blocks; nothing to train.")
        layers: list[StageLayer] = [HunyuanEmbed(dm)]
        layers += [HunyuanDoubleBlock(dm, i, last=ns == 0 and i == nd - 1) for i in range(nd)]
        layers += [HunyuanSingleBlock(dm, i, last=i == ns - 1) for i in range(ns)]
        return [*layers, HunyuanFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.double_blocks) + len(diffusion_model.single_blocks)
        return [False, *([True] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"(double_blocks|single_blocks)\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        pt, ph, pw = (int(p) for p in diffusion_model.patch_size)
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=4)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(text width, pooled width)``: llava-llama3's 4096 (as the weights say) and CLIP-L's 768."""
        params = diffusion_model.params
        return int(params.context_in_dim), int(params.vec_in_dim or 0)

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """The text mask; image-to-video models also need the start image (latent, and in the prompt for
        HunyuanVideoI2V), refused with the Cache node setting that makes it when a cache lacks it."""
        out: dict[str, ExtraSpec] = {
            TEXT_MASK: ExtraSpec(shape=("T",), source="text", required=False, follows_text=True,
                                 description="the text attention mask of the text encoder")}
        concat = _concat_channels(diffusion_model)
        if concat:
            i2v = concat == int(diffusion_model.out_channels) + 1
            clip = (" and connect llava_llama3_vision ('Load CLIP Vision') to its clip_vision input" if i2v
                    else " (SkyReels I2V takes no CLIP vision model)")
            out[CONCAT_LATENT_ALONE] = StartImageExtra(
                shape=("C", "F", "H", "W"), is_latent=True,
                description="the start-image latent (the clip's first frame encoded alone, zero latent frames after "
                            "it, as HunyuanImageToVideo v1 (concat) builds it)",
                fix=f"set start_image to first_frame_alone on 'Cache Latents & Text'{clip}, and cache again")
            if i2v:
                out[START_IMAGE_PROMPT] = StartImageExtra(
                    shape=(1,), source="text",
                    description="captions encoded with the start image's CLIP-vision tokens, as "
                                "TextEncodeHunyuanVideo_ImageToVideo encodes them",
                    fix="set start_image to first_frame_alone on 'Cache Latents & Text', connect llava_llama3_vision "
                        "('Load CLIP Vision') to its clip_vision input and HunyuanVideo's text encoder (CLIP type "
                        "hunyuan_video) to its clip, and cache again")
        return out

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        return math.prod(-(-s // int(p)) for s, p in zip(sizes, diffusion_model.patch_size, strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        options = batch.options if isinstance(batch.options, HunyuanVideoOptions) else HunyuanVideoOptions()
        x, t = batch.noisy, batch.timestep
        image = batch.extras.get(CONCAT_LATENT_ALONE)
        if image is not None:  # concat_image; the embed stage adds HunyuanVideoI2V's mask_inverted channel
            x = torch.cat((x, image.to(x.dtype)), dim=1)
        out: list[torch.Tensor] = [x, t, batch.cond]
        if batch.pooled is not None:
            out.append(batch.pooled)
        out.append(torch.full((x.shape[0],), options.guidance, dtype=torch.float32))
        mask = batch.extras.get(TEXT_MASK)
        out.append(mask.to(torch.int64) if mask is not None else torch.zeros(x.shape[0], 0, dtype=torch.int64))
        return tuple(out)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; shorter ones get zero tokens (masked when a mask is cached)."""
        return max(lengths)


ADAPTER = register(HunyuanVideoAdapter(), model_classes=("HunyuanVideo",))
