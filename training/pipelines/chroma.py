"""Chroma (``comfy.ldm.chroma.model.Chroma``) as pipeline stage layers.

Chroma is FLUX.1-schnell's blocks without their modulation Linears: one small network, the
"distilled guidance layer" (an MLP approximator), computes every block's shift/scale/gate at once
from the timestep, the guidance and a modulation index (344 rows; ComfyUI's ``Chroma.forward_orig``).
Text comes from T5-XXL alone (no pooled vector), unpadded (ComfyUI's PixArt T5 tokenizer), and the
model runs without a text attention mask.

Stage tuples (``B`` batch, ``T`` text tokens, ``N`` image tokens, ``M`` = 344 modulation rows):

- embed: ``(x, timestep, context, guidance, text_keep)`` -> ``(img, txt, mods, ids, hw, keep)``
- each double block and each single block but the last one: the same tuple in and out
- the last block: ``(img, mods, hw)``; final: ``(img, mods, hw)`` -> the prediction, shaped like ``x``

``mods`` is the approximator's output ``[B, M, hidden]``; each block takes its rows with ComfyUI's
own ``Chroma.get_modulations``. ``ids`` are int64 rotary positions (text all zero, then the image
grid), recomputed into ``pe`` per block as in :mod:`.flux`. ``keep`` is a bool ``[B, T]``: False marks
the zero tokens a micro-batch appended to a shorter caption. ComfyUI samples one caption at its own
length, so those tokens are masked out of the attention keys (an additive mask), which makes each
example's output what ComfyUI computes for it alone; a micro-batch of equal lengths runs unmasked.

ChromaRadiance (pixel space, a NeRF-style decoder head) is a subclass that ComfyUI registers as
another model class; it is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds
from .presets import ai_toolkit

MODULATION_ROWS = 344  # ComfyUI's Chroma.forward_orig: mod_index_length
GUIDANCE = 0.0  # model_base.Chroma.extra_conds: the guidance ComfyUI gives Chroma unless a graph sets one

_ATTENTION = r"(img|txt)_attn\.(qkv|proj)|linear[12]"
_MLP = r"(img|txt)_mlp\.[02]"
_APPROXIMATOR = r"distilled_guidance_layer\.(in_proj|out_proj|layers\.\d+\.(in_layer|out_layer))"
_BLOCKS = r"(double_blocks|single_blocks)\.\d+\."


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.chroma.model import Chroma

    if not isinstance(dm, Chroma):
        return f"{type(dm).__name__} is not ComfyUI's Chroma network; PipeTrainer's Chroma adapter cannot train it."
    if type(dm) is not Chroma:
        return (f"{type(dm).__name__} (Chroma Radiance, a pixel-space Chroma) is not supported yet; "
                "Chroma (latent space) is.")
    if dm.skip_mmdit or dm.skip_dit:
        return "This Chroma model skips blocks (skip_mmdit / skip_dit); PipeTrainer trains the full model only."
    if not hasattr(dm, "final_layer"):
        return "This Chroma model has no final layer (a feature extractor); it cannot be trained."
    return None


def text_keep(cond: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: each cond's tokens up to its last non-zero token (a T5 output token is never all
    zero, so the trailing all-zero tokens are the ones the micro-batch appended)."""
    nonzero = cond.ne(0).any(dim=-1)
    positions = torch.arange(cond.shape[1], device=cond.device)
    last = torch.where(nonzero, positions, -1).max(dim=1).values
    return positions[None] <= last[:, None]


def _attention_mask(keep: torch.Tensor, image_tokens: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive ``[B, 1, 1, T+N]`` key mask hiding the appended text tokens, or None when there are none."""
    if bool(keep.all()):
        return None
    keys = torch.cat((keep, keep.new_ones(keep.shape[0], image_tokens)), dim=1)
    mask = torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, torch.finfo(dtype).min)
    return mask[:, None, None, :]


class ChromaEmbed(StageLayer):
    """Patchify the latent, embed image and text, and run the modulation approximator."""

    def __init__(self, dm: nn.Module):
        from comfy.ldm.flux.model import Flux

        super().__init__()
        self.adopt_same(dm, "img_in", "txt_in", "distilled_guidance_layer")
        # Flux.process_img reads only these two attributes: the same patchify and grid positions as Chroma._forward.
        self.params = dm.params
        self.patch_size = dm.patch_size
        self._process_img = Flux.process_img

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding

        x, timestep, context, guidance, keep = inputs
        batch, _, h, w = x.shape
        img, img_ids = self._process_img(self, x, transformer_options={})
        txt_ids = torch.zeros(batch, context.shape[1], img_ids.shape[-1], device=x.device, dtype=img_ids.dtype)
        positions = torch.cat((txt_ids, img_ids), dim=1).to(torch.int64)

        img = self.img_in(img)
        dtype = img.dtype
        step = timestep_embedding(timestep, 16).to(dtype)
        guide = timestep_embedding(guidance, 16).to(dtype)
        index = timestep_embedding(torch.arange(MODULATION_ROWS, device=x.device), 32).to(dtype)
        time_guidance = torch.cat((step, guide), dim=1).unsqueeze(1).expand(-1, MODULATION_ROWS, -1)
        mods = self.distilled_guidance_layer(torch.cat((time_guidance, index.expand(batch, -1, -1)), dim=-1))
        txt = self.txt_in(context)
        hw = torch.tensor([h, w], dtype=torch.int64, device=x.device)
        return img, txt, mods, positions, hw, keep


class _ChromaBlock(StageLayer):
    swappable = True

    def __init__(self, dm: nn.Module, kind: str, index: int, last: bool):
        from comfy.ldm.chroma.model import Chroma

        super().__init__()
        blocks = "double_blocks" if kind == "double" else "single_blocks"
        self.adopt("block", getattr(dm, blocks)[index], f"{blocks}.{index}")
        self.pe_embedder = dm.pe_embedder
        self.params = dm.params  # read by Chroma.get_modulations, reused below
        self._modulations = Chroma.get_modulations
        self.kind, self.index, self.last = kind, index, last

    def forward(self, inputs):
        img, txt, mods, ids, hw, keep = inputs
        pe = self.pe_embedder(ids)
        mask = _attention_mask(keep, img.shape[1], img.dtype)
        if self.kind == "double":
            vec = (self._modulations(self, mods, "double_img", idx=self.index),
                   self._modulations(self, mods, "double_txt", idx=self.index))
            with OutOfPlaceResidualAdds(img, txt):
                img, txt = self.block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=mask, transformer_options={})
        else:
            text_len = txt.shape[1]
            x = torch.cat((txt, img), dim=1)
            with OutOfPlaceResidualAdds(x):
                x = self.block(x, vec=self._modulations(self, mods, "single", idx=self.index), pe=pe, attn_mask=mask,
                               transformer_options={})
            img, txt = x[:, text_len:], x[:, :text_len]
        if self.last:
            return img, mods, hw
        return img, txt, mods, ids, hw, keep


class ChromaFinal(StageLayer):
    """Final modulated projection, then un-patchify and crop to the input latent size."""

    def __init__(self, dm: nn.Module):
        from comfy.ldm.chroma.model import Chroma

        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size = dm.patch_size
        self.params = dm.params
        self._modulations = Chroma.get_modulations

    def forward(self, inputs):
        img, mods, hw = inputs
        out = self.final_layer(img, vec=self._modulations(self, mods, "final"))
        h, w = int(hw[0]), int(hw[1])
        p = self.patch_size
        gh, gw = (h + p // 2) // p, (w + p // 2) // p
        batch, _, features = out.shape
        channels = features // (p * p)
        out = out.reshape(batch, gh, gw, channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(batch, channels, gh * p, gw * p)[:, :, :h, :w]


class ChromaAdapter:
    name = "Chroma"
    options_type = NoOptions  # guidance stays ComfyUI's Chroma default (0): the Train node's 1.0 is FLUX.1-dev's
    presets = (ai_toolkit("Chroma, 24 GB", "train_lora_chroma_24gb", 16),)

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n_double, n_single = len(dm.double_blocks), len(dm.single_blocks)
        if n_double + n_single == 0:
            raise ValueError("This Chroma model has no transformer blocks; nothing to train.")
        if 3 * n_single + 12 * n_double + 2 > MODULATION_ROWS:
            raise ValueError(f"This Chroma model has more blocks than ComfyUI's {MODULATION_ROWS} modulation rows cover.")
        total = n_double + n_single
        doubles = [_ChromaBlock(dm, "double", i, last=i == total - 1) for i in range(n_double)]
        singles = [_ChromaBlock(dm, "single", i, last=n_double + i == total - 1) for i in range(n_single)]
        return [ChromaEmbed(dm), *doubles, *singles, ChromaFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.double_blocks) + len(diffusion_model.single_blocks)
        return [False, *([_ChromaBlock.swappable] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        """Blocks' attention (and MLPs); ``all_linear`` adds the modulation approximator, Chroma's only
        modulation Linears."""
        if preset == "attention":
            return rf"{_BLOCKS}({_ATTENTION})"
        if preset == "attention_mlp":
            return rf"{_BLOCKS}({_ATTENTION}|{_MLP})"
        return rf"{_BLOCKS}({_ATTENTION}|{_MLP})|{_APPROXIMATOR}"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        p = diffusion_model.patch_size
        h, w = latent_shape[-2:]
        return ((h + p // 2) // p) * ((w + p // 2) // p)

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        noisy = batch.noisy
        # ComfyUI hands extra conds such as guidance to the model in the compute dtype.
        guidance = torch.full((noisy.shape[0],), GUIDANCE, dtype=noisy.dtype)
        return noisy, batch.timestep, batch.cond, guidance, text_keep(batch.cond)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(T5-XXL width 4096, 0)``: Chroma takes no pooled vector."""
        return int(diffusion_model.params.context_in_dim), 0

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the zero tokens the others get are masked out of the
        attention (see the module docstring), nothing is cut."""
        return max(lengths)


ADAPTER = register(ChromaAdapter(), model_classes=("Chroma",))
