"""Wan 2.1 VACE (ComfyUI ``model_base.WAN21_Vace``, ``comfy.ldm.wan.model.VaceWanModel``) as pipeline stage layers.

VACE is a Wan 2.1 text-to-video model with a second, shorter stack of attention blocks (``vace_blocks``)
that reads a control stream: ``vace_context`` ``[B, N, vace_in_dim, F, H, W]``, N control videos, each
the inactive and reactive latents of a control clip and its mask (``WanVaceToVideo``) after
``WAN21_Vace.extra_conds`` (``process_latent_in`` on each 16-channel latent, then the 64 mask channels:
the pixel mask folded 8x8 onto the latent grid). ``vace_patch_embedding`` patchifies it; VACE block
``k`` runs after main block ``i`` (``vace_layers_mapping``: every ``num_layers // vace_layers``-th block,
starting at 0), updates the control tokens and adds its hint (``after_proj``) times the strength to the
main stream. VACE block 0 first adds ``before_proj`` of the control tokens to the patch-embedded
input of main block 0.

Stage tuples (``B`` batch, ``L`` video tokens, ``c`` the control tokens ``[N * B, L, dim]``, ComfyUI's
``vace_context.movedim(0, 1)`` order):

- embed: ``(x, timestep [B], context, vace_context)`` -> ``(x, e, e0, context, sizes, c)``
- a main block with its VACE block (one layer: VACE block 0 needs main block 0's input, which then never
  crosses a stage boundary) and a plain main block while VACE blocks follow: the same tuple in and out;
  after the last VACE block ``c`` is dropped and the tuple is Wan's (training/pipelines/wan.py), whose
  last layer also drops ``e0`` and ``context``
- head: Wan's.

Training uses strength 1.0, ``WanVaceToVideo``'s default: a LoRA learns the model as it is sampled at that
strength. VACE blocks get LoRA with the main blocks (same Linears; ``all_linear`` adds their
``before_proj``/``after_proj``).

The extra ``vace_context`` is required: training/cache/vace_control.py builds it per clip with ComfyUI's
own ``WanVaceToVideo`` when the Dataset node pairs a control clip with each clip (its control folder) and
the Cache node's ``vace_control`` is on; preflight refuses a VACE run on a cache without it, saying how to
build it (``VACE_CONTEXT_FIX``): trained without its control stream, a VACE LoRA would learn a model it is
never sampled as.

Several control streams (N > 1, chained ``WanVaceToVideo`` nodes) need nothing more here: the cache stores
them stacked along N in chain order and every VACE block runs each stream and adds each hint, as
``VaceWanModel`` does.

A reference image (``WanVaceToVideo``'s ``reference_image``) is one latent frame in front of every stream
and of the latent the sampler denoises; ``TrimVideoLatent`` cuts that frame after sampling. The cache puts
the same frame in front of the training latent (the node's own VAE latent of the reference: the control
stream marks that frame mask 0, "keep", with the reference as its content, so the model's trajectory there
is the reference noised), and a per-frame loss mask that is 0 on it: ComfyUI never outputs the frame, so
the model never has to deliver it as data; it is input that the video frames attend to
(training/cache/vace_control.py). Nothing in this module changes for it: the frame is one more latent frame.

An image item (a 1-frame clip, ``WanVaceToVideo`` with length 1) trains like a clip of one latent frame.

Also refused before a run: a VACE model whose mapping asks for more VACE blocks than it has (ComfyUI
cannot run it either), Wan's ``first_frame_clean`` and ``expert`` options.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..cache.vace_control import VACE_CONTEXT
from .base import ExtraSpec, StageLayer, refuse_unsupported, register
from .out_of_place import OutOfPlaceResidualAdds
from .wan import (
    _ATTENTION,
    _MLP,
    StartImageExtra,
    WanAdapter,
    WanBlock,
    WanEmbed,
    WanHead,
    WanOptions,
    single_model_expert_problems,
)

STRENGTH = 1.0  # WanVaceToVideo's default strength
_VACE_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|before_proj|after_proj",
}
_MAIN_TARGETS = {"attention": _ATTENTION, "attention_mlp": rf"{_ATTENTION}|{_MLP}", "all_linear": rf"{_ATTENTION}|{_MLP}"}
VACE_CONTEXT_FIX = (
    "a VACE LoRA trained without its control stream would not learn what WanVaceToVideo samples: give the "
    "Dataset node a control_folder with a control video per clip (clip.mp4, optional clip.2.mp4..., "
    "clip_mask.mp4 or .png, clip_ref.png) and set the Cache node's vace_control on")


def vace_mapping(dm: nn.Module) -> dict[int, int]:
    """``{main block index: VACE block index}``, ComfyUI's own ``vace_layers_mapping``."""
    return dict(dm.vace_layers_mapping)


def _vace_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.wan.model import VaceWanModel

    if type(dm) is not VaceWanModel:
        return f"{type(dm).__name__} is not ComfyUI's VaceWanModel; the Wan VACE adapter trains only that class."
    if not hasattr(dm, "vace_blocks"):
        return "This VACE model has no VACE blocks (vace_layers is unset); load it as a Wan text-to-video model."
    wanted = sorted(set(vace_mapping(dm).values()))
    if wanted != list(range(len(dm.vace_blocks))):
        return (f"This VACE model has {len(dm.vace_blocks)} VACE blocks for {len(dm.blocks)} main blocks, and "
                f"ComfyUI's mapping asks for VACE blocks {wanted}: ComfyUI cannot run it either. Check the file.")
    if dm.img_emb is not None or int(dm.in_dim) != int(dm.out_dim):
        return "This VACE model has an image-to-video input; Wan 2.1 VACE releases are text-to-video models."
    return None


class VaceEmbed(WanEmbed):
    """Wan's embedding plus the control stream's patch embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__(dm)
        self.adopt_same(dm, "vace_patch_embedding")

    def forward(self, inputs):
        x, t, context, vace_context = inputs
        x, e, e0, context, sizes = super().forward((x, t, context))
        flat = vace_context.movedim(0, 1).reshape(-1, *vace_context.shape[2:])  # [N * B, C, F, H, W]
        c = self.vace_patch_embedding(flat.float()).to(flat.dtype).flatten(2).transpose(1, 2)
        if c.shape[1] != x.shape[1]:
            raise ValueError(f"vace_context {list(vace_context.shape)} makes {c.shape[1]} control tokens for "
                             f"{x.shape[1]} video tokens: it must have the training latent's frames, height and "
                             "width (cache the control clips again with the training clips).")
        return x, e, e0, context, sizes, c


class VaceBlock(WanBlock):
    """A main block, then (if ComfyUI maps one to it) its VACE block, whose hint joins the main stream.

    ``carry``: the control tokens continue after this layer (a VACE block follows)."""

    def __init__(self, dm: nn.Module, index: int, vace_index: int | None, carry: bool, last: bool):
        super().__init__(dm, index, last=last)
        self.carry = carry
        if vace_index is not None:
            self.adopt("vace", dm.vace_blocks[vace_index], f"vace_blocks.{vace_index}")

    def forward(self, inputs):
        x_in, e, e0, context, sizes, c = inputs
        f, h, w, _ = (int(v) for v in sizes)
        freqs = self._rope_encode(self, f, h, w, device=x_in.device, dtype=x_in.dtype, transformer_options={})
        with OutOfPlaceResidualAdds(x_in):
            x = self.block(x_in, e=e0, freqs=freqs, context=context, context_img_len=None, transformer_options={})
        if hasattr(self, "vace"):
            streams = list(c.split(x.shape[0], dim=0))
            for k, stream in enumerate(streams):
                with OutOfPlaceResidualAdds(stream):
                    hint, streams[k] = self.vace(stream, x=x_in, e=e0, freqs=freqs, context=context,
                                                 context_img_len=None, transformer_options={})
                x = x + hint * STRENGTH
            c = torch.cat(streams, dim=0)
        if self.last:
            return x, e, sizes
        return (x, e, e0, context, sizes, c) if self.carry else (x, e, e0, context, sizes)


class WanVaceAdapter(WanAdapter):
    """Wan 2.1 VACE: Wan's geometry, conditioning and schedule, plus the control stream."""

    name = "WanVace"
    options_type = WanOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _vace_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        mapping = vace_mapping(dm)
        last_vace = max(mapping)
        n = len(dm.blocks)
        layers: list[StageLayer] = [VaceEmbed(dm)]
        for i in range(n):
            if i <= last_vace:
                layers.append(VaceBlock(dm, i, mapping.get(i), carry=i < last_vace, last=i == n - 1))
            else:
                layers.append(WanBlock(dm, i, last=i == n - 1))
        return [*layers, WanHead(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([VaceBlock.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"blocks\.\d+\.({_MAIN_TARGETS[preset]})|vace_blocks\.\d+\.({_VACE_TARGETS[preset]})"

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {VACE_CONTEXT: StartImageExtra(
            shape=("*", int(diffusion_model.vace_in_dim), "F", "H", "W"),
            description="the VACE control conditioning (WanVaceToVideo's control video latents and mask, as "
                        "WAN21_Vace.extra_conds passes them)",
            fix=VACE_CONTEXT_FIX)}

    def first_stage_inputs(self, batch) -> tuple[torch.Tensor, ...]:
        options = batch.options if isinstance(batch.options, WanOptions) else WanOptions()
        if options.first_frame_clean:
            raise ValueError("first_frame_clean is for Wan 2.2 TI2V-5B; a VACE model takes its conditioning "
                             "frames through the control video: leave first_frame_clean off.")
        vace = batch.extras.get(VACE_CONTEXT)
        if vace is None:
            raise ValueError(f"A Wan VACE model needs '{VACE_CONTEXT}' for every example: {VACE_CONTEXT_FIX}.")
        return batch.noisy, batch.timestep, batch.cond, vace.to(batch.noisy.dtype)

    def preflight_problems(self, diffusion_model: nn.Module, facts) -> list[str]:
        """Wan's option checks, plus: a VACE model is one Wan 2.1 model for every noise level."""
        return super().preflight_problems(diffusion_model, facts) + single_model_expert_problems(facts.options,
                                                                                                  "Wan 2.1 VACE")


ADAPTER = register(WanVaceAdapter(), model_classes=("WAN21_Vace",))
