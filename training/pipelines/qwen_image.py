"""Qwen-Image and Qwen-Image-Edit (``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel``) as pipeline stage layers.

Stage tuples (``B`` batch, ``T`` text tokens, ``N`` image tokens incl. the reference images' tokens):

- embed: ``(x [B, C, 1, H, W], timestep [B], context [B, T, 3584], *references)`` ->
  ``(img, txt, temb, ids, meta)``
- each transformer block but the last: the same tuple in and out; the last drops ``txt``
- final: ``(img, temb, meta)`` -> the prediction, shaped like ``x``

Qwen-Image takes Wan 2.1 VAE latents, so its latents are 5-D ``[B, 16, 1, H, W]`` (ComfyUI's
``Wan21`` latent format: ``latent_dimensions = 3``); an image trains as a 1-frame latent
(:class:`Geometry` ``video``), and more than one frame is refused (0.3.75's patchify cannot take it).
``img`` and ``ids`` come from ComfyUI's own ``process_img`` for the latent and each reference, placed
as ComfyUI places ``ref_latents`` with the model's default method ("index": the i-th reference is
rotary frame ``i + 1``, its tokens appended after the noisy latent's). ``ids`` cross stage boundaries
as int64 (the rotary embedding has no gradient; every block recomputes it with the parameter-free
``pe_embedder``, exactly as ComfyUI computes it once). ``meta`` holds the latent height, width and
the noisy latent's token count (int64) for the final crop. Qwen-Image-Edit-2511 (current ComfyUI
detects it by its ``__index_timestep_zero__`` marker) modulates the reference tokens with timestep
0: ``temb`` then holds ``2B`` rows as in ComfyUI's forward and ``meta`` carries the split index.

Edit models. Qwen-Image-Edit and Edit-2509 have the same weights layout as Qwen-Image, so nothing in
the model tells them apart: the reference extras (``reference_0`` ... the items' reference images'
VAE latents, :func:`~.base.reference_extra`) are optional, and an item with references trains as
ComfyUI's ``TextEncodeQwenImageEdit(Plus)`` conditioning samples it. A model ComfyUI marks as
2511 requires ``reference_0``. Qwen-Image-Layered (an extra time embedding, negative reference
indices, several frames) has another data flow and is refused by name.

Text: the Qwen2.5-VL hidden states (3584 wide); ComfyUI gives the model no text mask for one
caption, so shorter captions of a micro-batch get zero tokens appended (:meth:`text_length`).

Fixture tier: detection pins full-size dims (>= 380 M with one block), so the tests build tiny
models in memory from ComfyUI's own ``QwenImage`` config class (tests/family_rows/qwen_image.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, reference_extra, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds
from .presets import ai_toolkit
from .qwen_image_prompt import STYLES as REFERENCE_PROMPT_STYLES
from .qwen_image_prompt import takes_reference_prompt as _takes_reference_prompt

MAX_REFERENCES = 3  # TextEncodeQwenImageEditPlus takes up to 3 images
_NAMED = 20  # sources named in a preflight problem; the rest are counted

_ATTENTION = r"attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)"
_MLP = r"(img|txt)_mlp\.net\.(0\.proj|2)"
_MODULATION = r"(img|txt)_mod\.1"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}

_SUPPORTED_REF_METHODS = ("index", "index_timestep_zero")


def _ref_method(dm: nn.Module) -> str:
    """The model's own reference placement (ComfyUI 0.3.75 has only "index" and no attribute)."""
    return str(getattr(dm, "default_ref_method", "index"))


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    if not isinstance(dm, QwenImageTransformer2DModel):
        return f"{type(dm).__name__} is not a Qwen-Image model; the Qwen-Image adapter cannot train it."
    if type(dm) is not QwenImageTransformer2DModel:
        return (f"{type(dm).__name__} is a Qwen-Image relative with its own data flow, which PipeTrainer cannot "
                "train yet; Qwen-Image and Qwen-Image-Edit (incl. 2509 and 2511) are supported.")
    time_embed = getattr(dm, "time_text_embed", None)
    if getattr(time_embed, "use_additional_t_cond", False) or _ref_method(dm) not in _SUPPORTED_REF_METHODS:
        return ("Qwen-Image-Layered models (an extra time embedding, layers as frames, negative reference indices) "
                "are not supported yet; Qwen-Image and Qwen-Image-Edit (incl. 2509 and 2511) are.")
    if not hasattr(dm, "proj_out"):
        return "This Qwen-Image model has no final layer (a feature extractor); it cannot be trained."
    if dm.in_channels != dm.out_channels * dm.patch_size**2:
        return (f"This Qwen-Image model takes {dm.in_channels} input features for {dm.out_channels} output channels "
                "(control or image channels concatenated to the latent), which this adapter does not build.")
    return None


class QwenEmbed(StageLayer):
    """Patchify the latent and its references, embed image, text and timestep; rotary positions as ids."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "img_in", "txt_norm", "txt_in", "time_text_embed")
        self.patch_size = dm.patch_size  # read by ComfyUI's own process_img, reused below
        self._process_img = type(dm).process_img
        self.timestep_zero = _ref_method(dm) == "index_timestep_zero"

    def forward(self, inputs):
        x, timestep, context, *references = inputs
        if x.ndim != 5 or x.shape[2] != 1:
            raise ValueError(f"Qwen-Image trains on image latents [B, C, 1, H, W]; got {list(x.shape)}. "
                             "Cache images (not videos) with the Qwen-Image VAE.")
        batch, h, w, p = x.shape[0], x.shape[-2], x.shape[-1], self.patch_size
        img, img_ids, _ = self._process_img(self, x)
        num_embeds = img.shape[1]
        for index, ref in enumerate(references, start=1):  # the "index" method of ComfyUI's _forward
            tokens, ref_ids, _ = self._process_img(self, ref, index=index)
            img = torch.cat((img, tokens), dim=1)
            img_ids = torch.cat((img_ids, ref_ids), dim=1)
        txt_start = round(max(((w + p // 2) // p) // 2, ((h + p // 2) // p) // 2))
        txt_ids = torch.arange(txt_start, txt_start + context.shape[1], device=x.device)
        txt_ids = txt_ids.reshape(1, -1, 1).repeat(batch, 1, 3)
        ids = torch.cat((txt_ids.to(img_ids.dtype), img_ids), dim=1)
        positions = ids.round().to(torch.int64)
        if not torch.equal(positions.to(ids.dtype), ids):
            raise ValueError("Qwen-Image token positions are not whole numbers; rotary scaling is not supported in training.")

        img = self.img_in(img)
        txt = self.txt_in(self.txt_norm(context))
        split = -1
        if self.timestep_zero and references:  # 2511: reference tokens are modulated with timestep 0
            timestep = torch.cat((timestep, timestep * 0), dim=0)
            split = num_embeds
        temb = self.time_text_embed(timestep, img)
        meta = torch.tensor([h, w, num_embeds, split], dtype=torch.int64, device=x.device)
        return img, txt, temb, positions, meta


class _KeepInGraph(torch.autograd.Function):
    """``keep`` unchanged, with ``dropped`` joined to the graph by a zero gradient.

    ComfyUI never uses the last block's text stream: that block's text MLP and text output projection
    change nothing, so their LoRA parameters would get no gradient at all (DeepSpeed's optimizers and
    the engine expect one for every trainable parameter). A zero gradient is the exact derivative."""

    @staticmethod
    def forward(ctx, keep: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        ctx.dropped = (dropped.shape, dropped.dtype, dropped.device)
        return keep.view_as(keep)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.dropped
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _zero_index(meta: torch.Tensor) -> int | None:
    split = int(meta[3])
    return None if split < 0 else split


class QwenBlock(StageLayer):
    """One dual-stream transformer block (separate image and text weights, joint attention)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.transformer_blocks[index], f"transformer_blocks.{index}")
        self.pe_embedder = dm.pe_embedder
        self.last = last

    def forward(self, inputs):
        img, txt, temb, ids, meta = inputs
        pe = self.pe_embedder(ids.float()).to(img.dtype).contiguous()
        split = _zero_index(meta)
        kwargs = {} if split is None else {"timestep_zero_index": split}  # the argument exists only where 2511 does
        with OutOfPlaceResidualAdds(img, txt):
            txt, img = self.block(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=None,
                                  temb=temb, image_rotary_emb=pe, transformer_options={}, **kwargs)
        if self.last:
            return _KeepInGraph.apply(img, txt), temb, meta
        return img, txt, temb, ids, meta


class QwenFinal(StageLayer):
    """Final modulated norm and projection of the noisy latent's tokens, un-patchify, crop to the input size."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "norm_out", "proj_out")
        self.patch_size = dm.patch_size
        self.out_channels = dm.out_channels

    def forward(self, inputs):
        img, temb, meta = inputs
        h, w, num_embeds = (int(v) for v in meta[:3])
        if _zero_index(meta) is not None:
            temb = temb.chunk(2, dim=0)[0]
        img = self.proj_out(self.norm_out(img, temb))
        p, c = self.patch_size, self.out_channels
        gh, gw = -(-h // p), -(-w // p)
        out = img[:, :num_embeds].view(img.shape[0], gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(img.shape[0], c, 1, gh * p, gw * p)[..., :h, :w]


class QwenImageAdapter:
    name = "QwenImage"
    options_type = NoOptions
    presets = (ai_toolkit("Qwen-Image, 24 GB", "train_lora_qwen_image_24gb", 16,
                          quantized_base="3-bit (with an accuracy-recovery adapter)"),)
    # The Cache node's reference_in_prompt styles: ComfyUI's TextEncodeQwenImageEdit(Plus) (qwen_image_prompt.py).
    reference_prompts = REFERENCE_PROMPT_STYLES

    def takes_reference_prompt(self, clip: object) -> bool:
        """Whether the Cache's ``clip`` is Qwen-Image's text encoder, which reads the reference images."""
        return _takes_reference_prompt(clip)

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.transformer_blocks)
        if n == 0:
            raise ValueError("This Qwen-Image model has no transformer blocks; nothing to train.")
        return [QwenEmbed(dm), *(QwenBlock(dm, i, last=i == n - 1) for i in range(n)), QwenFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([QwenBlock.swappable] * len(diffusion_model.transformer_blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"transformer_blocks\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p), video=True)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(text width, 0)``: Qwen2.5-VL-7B's 3584; Qwen-Image takes no pooled vector."""
        return int(diffusion_model.txt_in.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """Up to :data:`MAX_REFERENCES` reference images' VAE latents (any size; the data pipeline applies
        ``process_latent_in``). Required only for a model ComfyUI marks as an edit model (2511)."""
        required_first = _ref_method(diffusion_model) == "index_timestep_zero"
        return {
            reference_extra(i): ExtraSpec(
                shape=("C", "*", "*"), source="latent", required=required_first and i == 0, is_latent=True,
                description=f"reference image {i + 1} (the image an edit starts from)" if i == 0
                else f"reference image {i + 1}")
            for i in range(MAX_REFERENCES)
        }

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the noisy latent as ``process_img`` pads it (references add tokens but no noise)."""
        p = int(diffusion_model.patch_size)
        return math.prod(-(-s // p) for s in latent_shape[-2:])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        references = []
        for i in range(MAX_REFERENCES):
            ref = batch.extras.get(reference_extra(i))
            if ref is None:
                break
            references.append(ref.unsqueeze(2) if ref.ndim == 4 else ref)  # [B, C, h, w] -> one frame
        return (batch.noisy, batch.timestep, batch.cond, *references)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def preflight_problems(self, diffusion_model: nn.Module, facts) -> list[str]:
        """Video latents (more than one frame), which the embed layer would refuse only once training runs.

        The reference limit needs no rule here: a cached ``reference_3`` or later has no extra of this
        family and preflight names it (training/pipelines/checks.py ``extra_problems``)."""
        videos = sorted(source for source, shape in facts.latents.items() if len(shape) == 4 and shape[1] > 1)
        if not videos:
            return []
        shown = ", ".join(videos[:_NAMED]) + (f" and {len(videos) - _NAMED} more" if len(videos) > _NAMED else "")
        return [f"Qwen-Image trains on images (one latent frame: ComfyUI's Qwen-Image takes frames only as the layers "
                f"of Qwen-Image-Layered), and the cache holds videos: {shown}. Remove them from the dataset (or set "
                "max_frames to 1 on the Dataset node to train their first frame) and cache again."]

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI drops Qwen-Image's text mask when a caption has no padding (always, one caption per
        encode), so a model sees every token it is given; zero tokens appended to the shorter captions
        of a batch take part in the attention like ComfyUI's unmasked batched conds."""
        return max(lengths)


ADAPTER = register(QwenImageAdapter(), model_classes=("QwenImage",))
