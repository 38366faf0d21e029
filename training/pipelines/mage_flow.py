"""Mage-Flow (``comfy.ldm.mage_flow.model.MageFlowTransformer2DModel``, ``model_base.MageFlow``) as stage layers.

Why a family of its own: ComfyUI's ``MageFlow`` model class subclasses ``QwenImage`` (it shares its
conditioning), so without its own registration the Qwen-Image family would claim it; but its transformer
is another class with another data flow: patch size 1 (tokens are the 128 latent channels of one
position, no 2 x 2 packing), Flux 2's 4-D latent format (Mage's own VAE, 16 x downscale), a sin-cos
timestep table rounded to the timestep's dtype, text tokens at rotary position 0 and image positions
centred as ``[-ceil(n/2), floor(n/2))``. Its blocks and final norm are Qwen-Image's own
(``QwenImageTransformerBlock``, ``LastLayer``), so the LoRA presets are Qwen-Image's.

Stage tuples (``B`` batch, ``T`` text tokens, ``N`` image tokens incl. the reference images' tokens):

- embed: ``(x [B, 128, H, W], timestep [B], context [B, T, 2560], *references)`` ->
  ``(img, txt, temb, ids [B, T+N, 3] int64, meta)``: ComfyUI's own ``process_img`` for the latent and each
  reference (the i-th reference is rotary frame ``i``, its tokens after the noisy latent's, as ComfyUI's
  ``_forward`` places ``ref_latents``), ``img_in``, ``txt_norm``, ``txt_in``, ``time_text_embed``;
- each transformer block but the last: the same tuple; every block recomputes the rotary table from ``ids``
  with the parameter-free ``pe_embedder`` (whole numbers, exact in int64), as ComfyUI computes it once;
  the last block drops ``txt`` (ComfyUI never reads it; its text-only LoRA weights get the exact zero gradient);
- final: ``norm_out`` (modulated by ``temb``), ``proj_out``, the noisy latent's tokens back to ``[B, 128, H, W]``.

``meta`` (int64) holds the latent height and width and the noisy latent's token count.

Timestep. ``MageFlow.process_timestep`` hands the model its timestep in bf16 (Mage rounds its frequency
table to the timestep's dtype, on fp32 devices too). ComfyUI's ``apply_model`` calls it on the sampler's
timestep; the embed layer calls the same method on the trainer's timestep, so training sees the rounded
table ComfyUI samples with.

Loss. ``model_base.MageFlow`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the
config's shift 6.0 (a ModelSamplingAuraFlow / SD3 node before Train LoRA is replayed) and the CONST target
``noise - x0``; training/objective takes both from the model.

Text: the Qwen3-VL-4B last hidden state (2560 wide, CLIPLoader type ``mage``); ComfyUI drops the text mask
when a caption has no padding (one caption per encode), so the shorter captions of a micro-batch get zero
tokens appended (:meth:`MageFlowAdapter.text_length`), as Qwen-Image's do.

Edit models: Mage-Flow-Edit has Mage-Flow's weights layout, so the reference extras (``reference_0`` ...,
up to :data:`MAX_REFERENCES`, the references' Mage VAE latents) are optional. ``TextEncodeMageFlowEdit``
resizes every reference to the output size before encoding it (Mage's rotary positions align reference and
target by position): give the Dataset's control images the training image's size. That node also shows the
images to the text encoder; the Cache node encodes Mage captions text-only (``reference_in_prompt`` has no
Mage style yet), so an edit LoRA's captions lack the images' tokens that sampling's prompt has.

Turbo: Mage-Flow-Turbo (few-step, distilled) has the same layout and ComfyUI one model class for both; it
trains like the base, and a LoRA trained naively on it can lose its 4-step behaviour; the family declares it
(``distillation``), so a de-distillation adapter can be merged while training (the Training Adapter node).

Refused by name: a transformer whose input width differs from its output width (control or image channels
concatenated to the latent, which ComfyUI's forward does not build), or with no blocks.

Fixture tier: detection pins 24 heads of 128 (~4 B parameters), so the tests build tiny models in memory
from ComfyUI's own ``MageFlow`` config class (tests/family_rows/mage_flow.py), one with two references.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, reference_extra, refuse_unsupported, register
from .distillation import Distillation
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds
from .qwen_image import _TARGETS, _KeepInGraph

FAMILY = "MageFlow"
MAX_REFERENCES = 16  # TextEncodeMageFlowEdit's image inputs


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.mage_flow.model import MageFlowTransformer2DModel

    if not isinstance(dm, MageFlowTransformer2DModel):
        return f"{type(dm).__name__} is not a Mage-Flow transformer; the {FAMILY} adapter cannot train it."
    if dm.in_channels != dm.out_channels:
        return (f"This Mage-Flow model takes {dm.in_channels} input channels for {dm.out_channels} output channels "
                "(control or image channels concatenated to the latent), which this adapter does not build.")
    if len(dm.transformer_blocks) == 0:
        return "This Mage-Flow model has no transformer blocks; nothing to train."
    return None


class MageEmbed(StageLayer):
    """Tokens of the latent and its references, text and timestep embeddings, rotary positions as ids."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "img_in", "txt_norm", "txt_in", "time_text_embed")
        self._process_img = type(dm).process_img

    def forward(self, inputs):
        import comfy.model_base

        x, timestep, context, *references = inputs
        if x.ndim != 4:
            raise ValueError(f"Mage-Flow trains on image latents [B, C, H, W]; got {list(x.shape)}. "
                             "Cache images with Mage-Flow's VAE.")
        h, w = x.shape[-2:]
        img, img_ids, _ = self._process_img(self, x)
        num_embeds = img.shape[1]
        for index, ref in enumerate(references, start=1):  # ComfyUI's _forward: reference i is frame i
            tokens, ref_ids, _ = self._process_img(self, ref, index=index)
            img = torch.cat((img, tokens), dim=1)
            img_ids = torch.cat((img_ids, ref_ids), dim=1)
        txt_ids = torch.zeros((x.shape[0], context.shape[1], 3), device=x.device)
        ids = torch.cat((txt_ids, img_ids), dim=1)
        positions = ids.round().to(torch.int64)
        if not torch.equal(positions.to(ids.dtype), ids):
            raise ValueError("Mage-Flow token positions are not whole numbers; rotary scaling is not supported in training.")
        img = self.img_in(img)
        txt = self.txt_in(self.txt_norm(context))
        # the model class's own timestep rule (a bf16 timestep), as apply_model applies it
        timestep = comfy.model_base.MageFlow.process_timestep(None, timestep)
        temb = self.time_text_embed(timestep, img)
        meta = torch.tensor([h, w, num_embeds], dtype=torch.int64, device=x.device)
        return img, txt, temb, positions, meta


class MageBlock(StageLayer):
    """One of Qwen-Image's dual-stream blocks (separate image and text weights, joint attention)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.transformer_blocks[index], f"transformer_blocks.{index}")
        self.pe_embedder = dm.pe_embedder  # parameter-free
        self.last = last

    def forward(self, inputs):
        img, txt, temb, ids, meta = inputs
        pe = self.pe_embedder(ids.float()).contiguous()  # ComfyUI's Mage forward keeps the table's own dtype
        with OutOfPlaceResidualAdds(img, txt):
            txt, img = self.block(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=None,
                                  temb=temb, image_rotary_emb=pe, transformer_options={})
        if self.last:
            return _KeepInGraph.apply(img, txt), temb, meta
        return img, txt, temb, ids, meta


class MageFinal(StageLayer):
    """Final modulated norm and projection; the noisy latent's tokens back to ``[B, C, H, W]``."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "norm_out", "proj_out")
        self.out_channels = dm.out_channels

    def forward(self, inputs):
        img, temb, meta = inputs
        h, w, num_embeds = (int(v) for v in meta)
        img = self.proj_out(self.norm_out(img, temb))[:, :num_embeds]
        return img.reshape(img.shape[0], h, w, self.out_channels).movedim(-1, 1)


class MageFlowAdapter:
    name = FAMILY
    options_type = NoOptions
    distillation = Distillation(checkpoints="Mage-Flow-Turbo")

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.transformer_blocks)
        return [MageEmbed(dm), *(MageBlock(dm, i, last=i == n - 1) for i in range(n)), MageFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([MageBlock.swappable] * len(diffusion_model.transformer_blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"transformer_blocks\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        return Geometry(patch=(1, 1, 1))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(2560, 0)``: Qwen3-VL-4B's last hidden state; no pooled vector."""
        return int(diffusion_model.txt_in.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """Up to :data:`MAX_REFERENCES` reference images' VAE latents, all optional (edit and text-to-image
        checkpoints share one layout); the data pipeline applies ``process_latent_in``."""
        return {
            reference_extra(i): ExtraSpec(
                shape=("C", "*", "*"), source="latent", required=False, is_latent=True,
                description=f"reference image {i + 1} (the image an edit starts from)" if i == 0
                else f"reference image {i + 1}")
            for i in range(MAX_REFERENCES)
        }

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """One token per latent position of the noisy latent (references add tokens but no noise)."""
        return int(latent_shape[-2]) * int(latent_shape[-1])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("Mage-Flow needs the text encoder's states, and the cache has none: cache the dataset "
                             "with Mage-Flow's text encoder (CLIPLoader type mage).")
        references = []
        for i in range(MAX_REFERENCES):
            ref = batch.extras.get(reference_extra(i))
            if ref is None:
                break
            references.append(ref)
        return (batch.noisy, batch.timestep, batch.cond, *references)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut."""
        return max(lengths)


# An own registration: MageFlow subclasses QwenImage, whose family would otherwise claim it.
ADAPTER = register(MageFlowAdapter(), model_classes=("MageFlow",))
