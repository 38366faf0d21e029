"""Flux (``comfy.ldm.flux.model.Flux``: FLUX.1 dev/schnell, FLUX.1 Kontext and fine-tunes) as pipeline stage layers.

Stage tuples (``B`` batch, ``T`` text tokens, ``N`` image tokens, references included):

- embed: ``(x, timestep, context, y, guidance, *references)`` -> ``(img, txt, vec, ids, hw)``
- each double block and each single block but the last one: the same tuple in and out
- the last block drops what the final layer does not use: ``(img, vec, hw)``
- final: ``(img, vec, hw)`` -> the prediction, shaped like ``x``

Reference images (FLUX.1 Kontext; the ``reference_<i>`` extras, processed latents) are patchified
like the latent and appended to the image tokens with their own rotary positions, exactly as
ComfyUI's ``Flux._forward`` does with ``ref_latents`` (:func:`reference_positions`); every block
attends over them, and the final layer keeps only the target's tokens, so the loss sees the target
alone. The references are optional: a Kontext model trains text-to-image without them, and a
FLUX.1 text-to-image model takes them the way ComfyUI's ``ReferenceLatent`` node hands them over.

The same layers run Flux.2 (:mod:`.flux2`: the same ComfyUI class with shared modulation, a fourth
rotary axis counting text tokens, and no pooled vector): with ``global_modulation`` the embed
stage also computes the shared modulations once and hands them on as ``mods`` (``[B, 15, hidden]``:
double img 6, double txt 6, single 3), the tuples becoming ``(img, txt, vec, mods, ids, hw)``.

``img`` comes from ComfyUI's own patchify (``Flux.process_img``). ``ids`` are the rotary positions
of the text then image tokens as int64 ``[B, T+N, axes]``: the rotary embedding ``pe`` has no
gradient, so it may not cross a stage boundary as a float tensor; each block recomputes it from the
ids with the model's parameter-free ``pe_embedder`` (ComfyUI casts positions to fp32 itself, so
integer ids give exactly the ``pe`` of ComfyUI's forward). ``hw`` is the latent height and width
(int64) for cropping the output exactly like ``Flux._forward``. Single blocks take ``img`` and
``txt`` separately and concatenate them as ComfyUI does between the two block kinds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .base import (
    REFERENCE_PREFIX,
    Batch,
    ExtraSpec,
    Geometry,
    StageLayer,
    reference_extra,
    refuse_unsupported,
    register,
)
from .distillation import Distillation
from .out_of_place import OutOfPlaceResidualAdds
from .presets import ai_toolkit


@dataclass(frozen=True)
class FluxOptions:
    """Flux and Flux.2 training options.

    ``guidance``: what the guidance embedding of a guidance-distilled model (FLUX.1-dev, FLUX.1 Kontext
    dev, FLUX.2 dev) sees while training. 1.0 is what diffusion-pipe, musubi-tuner and ai-toolkit train dev LoRAs with: the LoRA
    learns the content, not a guidance level, and samples well at the usual 3.5 (ComfyUI's
    FluxGuidance default). Models without a guidance embedding (schnell, FLUX.2 Klein) ignore it.
    """

    guidance: float = 1.0

    def problems(self) -> list[str]:
        if not 0.0 <= self.guidance <= 100.0:
            return [f"guidance must be between 0 and 100 (got {self.guidance})."]
        return []


_ATTENTION = r"(img|txt)_attn\.(qkv|proj)|linear[12]"
_MLP = r"(img|txt)_mlp\.[02]"
_MODULATION = r"((img|txt)_mod|modulation)\.lin"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}


def _support_problem(dm: nn.Module) -> str | None:
    """Why a Flux relative whose data flow differs from Flux.1 is refused (it needs its own adapter), or None."""
    from comfy.ldm.flux.model import Flux

    if not isinstance(dm, Flux):
        return (f"{type(dm).__name__} is a Flux relative that PipeTrainer cannot train yet; Flux.1 models "
                "(dev, schnell and their fine-tunes) are supported.")
    if dm.params.global_modulation or len(dm.params.axes_dim) != 3:
        return ("This is a Flux.2-style network (shared modulation, 4 rotary axes) loaded as a FLUX.1 model; "
                "PipeTrainer trains Flux.2 as ComfyUI's Flux2 model class (its own family), so load it with "
                "ComfyUI's Flux.2 detection (Load Diffusion Model).")
    relative = _flux1_lookalike(dm.params)
    if relative:
        return (f"{relative}. PipeTrainer's Flux adapter follows Flux.1's data flow and would train this model "
                "silently wrong, so it refuses; the model needs its own adapter. Supported: Flux.1 models "
                "(dev, schnell and their fine-tunes).")
    if dm.params.in_channels != dm.params.out_channels:
        return ("Flux models with image conditioning concatenated to the latent (Fill, Canny, Depth) are not "
                "supported yet; Flux.1 text-to-image models are.")
    if not hasattr(dm, "final_layer"):
        return "This Flux model has no final layer (a feature extractor); it cannot be trained."
    return None


def _flux1_lookalike(params) -> str | None:
    """What makes a model ComfyUI builds with its ``Flux`` class differ from Flux.1, or None.

    ComfyUI loads some relatives as ``Flux`` and marks them only by ``FluxParams`` fields that newer
    ComfyUI added (0.3.75 has none of them, hence ``getattr``): Ovis-Image normalises the text embedding
    (``txt_norm``) and uses a gated MLP (``yak_mlp``); text rotary positions (``txt_ids_dims``, all zero
    in Flux.1) belong to such relatives. The stage layers skip all of that, and the forward would still
    run. LongCat-Image (text rotary positions and image rope shifts) is ComfyUI's own ``LongCatImage``
    model class, which :mod:`.longcat_image` registers as a family of its own, so it never reaches here.
    """
    if getattr(params, "txt_norm", False):
        return ("This is Ovis-Image (a Flux relative: it normalises the text embedding with txt_norm, "
                f"uses a gated MLP and text rotary positions txt_ids_dims={list(params.txt_ids_dims)})")
    txt_ids_dims = list(getattr(params, "txt_ids_dims", None) or [])
    if txt_ids_dims:
        return ("This is a Flux relative that gives text tokens rotary positions "
                f"(txt_ids_dims={txt_ids_dims}; Flux.1 has none) loaded as a plain Flux model (LongCat-Image, "
                "which does too, trains as its own family when ComfyUI loads it as its LongCatImage model)")
    different = [name for name, flux1 in (("yak_mlp", False), ("mlp_silu_act", False), ("ops_bias", True))
                 if getattr(params, name, flux1) != flux1]
    if different:
        return f"This Flux relative differs from Flux.1 in {', '.join(different)}"
    return None


MAX_REFERENCES = 4
"""Reference images a FLUX.1 (Kontext) example may carry: ComfyUI's Kontext workflows chain one or
two ``ReferenceLatent`` nodes; more tokens than that cost attention time for little gain."""


def reference_positions(method: str, ref_shapes: Sequence[tuple[int, int]], latent_hw: tuple[int, int],
                        patch: int, index_scale: float) -> list[tuple[float, int, int]]:
    """``(index, h_offset, w_offset)`` of each reference image, as ComfyUI's ``Flux._forward`` places
    ``ref_latents`` (same on 0.3.75 and current ComfyUI for these methods).

    ``offset`` (FLUX.1 Kontext's default): every reference on rotary index 1, shifted beside or below
    the ones before it; ``index`` (Flux.2's default): reference ``k`` on index ``k * index_scale``;
    ``uxo``: index 0, shifted past the target latent and the references before it.
    """
    h_len, w_len = ((s + patch // 2) // patch for s in latent_hw)
    h = w = 0
    index = 0.0
    out = []
    for ref_h, ref_w in ref_shapes:
        if method == "index":
            index += index_scale
            h_offset = w_offset = 0
        elif method == "uxo":
            index = 0.0
            h_offset, w_offset = h_len * patch + h, w_len * patch + w
            h += ref_h
            w += ref_w
        elif method == "offset":
            index = 1.0
            h_offset = w_offset = 0
            if ref_h + h > ref_w + w:
                w_offset = w
            else:
                h_offset = h
            h = max(h, ref_h + h_offset)
            w = max(w, ref_w + w_offset)
        else:
            raise NotImplementedError(
                f"Reference images placed by the {method!r} method are not supported in training; "
                "'offset', 'index' and 'uxo' are.")
        out.append((index, h_offset, w_offset))
    return out


def text_position_axes(params) -> list[int]:
    """The rotary axes along which text tokens count 0, 1, 2... (all zero for FLUX.1).

    Current ComfyUI names them in ``FluxParams.txt_ids_dims`` (Flux.2: ``[3]``); 0.3.75 has no such
    field and counts along axis 3 exactly when there are 4 axes (Flux.2)."""
    dims = getattr(params, "txt_ids_dims", None)
    if dims is None:
        return [3] if len(params.axes_dim) == 4 else []
    return [int(d) for d in dims]


def references_of(extras: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The batch's reference latents in order: ``reference_0``, ``reference_1``... while present."""
    refs = []
    while reference_extra(len(refs)) in extras:
        refs.append(extras[reference_extra(len(refs))])
    stray = sorted(k for k in extras if k.startswith(REFERENCE_PREFIX) and k not in
                   {reference_extra(i) for i in range(len(refs))})
    if stray:
        raise ValueError(f"Reference images must be numbered from 0 without gaps; got {stray} after {len(refs)}.")
    return refs


def _pack_modulations(*outs) -> torch.Tensor:
    """``[B, 3k, hidden]`` of k ComfyUI ``ModulationOut`` (shift, scale, gate each ``[B, 1, hidden]``)."""
    return torch.cat([t for m in outs for t in (m.shift, m.scale, m.gate)], dim=1)


def _modulation(mods: torch.Tensor, k: int):
    from comfy.ldm.flux.layers import ModulationOut

    return ModulationOut(mods[:, 3 * k: 3 * k + 1], mods[:, 3 * k + 1: 3 * k + 2], mods[:, 3 * k + 2: 3 * k + 3])


class FluxEmbed(StageLayer):
    """Patchify the latent (and the reference latents) and embed image, text, timestep, guidance and pooled vector."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "img_in", "time_in", "txt_in")
        if dm.params.guidance_embed:
            self.adopt("guidance_in", dm.guidance_in, "guidance_in")
        else:
            self.guidance_in = None
        if dm.vector_in is not None:
            self.adopt("vector_in", dm.vector_in, "vector_in")
        else:
            self.vector_in = None
        self.global_modulation = bool(dm.params.global_modulation)
        if self.global_modulation:
            for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
                self.adopt(name, getattr(dm, name), name)
        # Attributes read by ComfyUI's own Flux.process_img, which is reused below.
        self.params = dm.params
        self.patch_size = dm.patch_size
        self._process_img = type(dm).process_img
        self.text_axes = text_position_axes(dm.params)
        self.ref_method = getattr(dm.params, "default_ref_method", "offset")
        self.ref_index_scale = float(getattr(dm.params, "ref_index_scale", 1.0))

    def transformer_options(self, context: torch.Tensor) -> dict:
        """What ComfyUI's model class hands ``process_img`` (Flux.1: nothing; LongCat-Image: its rope shifts)."""
        return {}

    def _image_tokens(self, x: torch.Tensor, refs: Sequence[torch.Tensor], options: dict):
        img, img_ids = self._process_img(self, x, transformer_options=options)
        places = reference_positions(self.ref_method, [tuple(r.shape[-2:]) for r in refs], tuple(x.shape[-2:]),
                                     self.patch_size, self.ref_index_scale)
        for ref, (index, h_offset, w_offset) in zip(refs, places, strict=True):
            tokens, ids = self._process_img(self, ref, index=index, h_offset=h_offset, w_offset=w_offset,
                                            transformer_options=options)
            img, img_ids = torch.cat((img, tokens), dim=1), torch.cat((img_ids, ids), dim=1)
        return img, img_ids

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding

        x, timestep, context, y, guidance, *refs = inputs
        batch, _, h, w = x.shape
        img, img_ids = self._image_tokens(x, refs, self.transformer_options(context))
        txt_ids = torch.zeros(batch, context.shape[1], img_ids.shape[-1], device=x.device, dtype=img_ids.dtype)
        for axis in self.text_axes:
            txt_ids[:, :, axis] = torch.arange(context.shape[1], device=x.device, dtype=img_ids.dtype)
        ids = torch.cat((txt_ids, img_ids), dim=1)
        positions = ids.round().to(torch.int64)
        if not torch.equal(positions.to(ids.dtype), ids):
            raise ValueError("Flux token positions are not whole numbers; rotary scaling is not supported in training.")

        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timestep, 256).to(img.dtype))
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        if self.vector_in is not None:
            if y.shape[-1] == 0:  # no pooled embedding in the cache: ComfyUI uses zeros
                y = torch.zeros(batch, self.params.vec_in_dim, device=img.device, dtype=img.dtype)
            vec = vec + self.vector_in(y[:, : self.params.vec_in_dim])
        txt = self.txt_in(context)
        hw = torch.tensor([h, w], dtype=torch.int64, device=x.device)
        if self.global_modulation:
            mods = _pack_modulations(*self.double_stream_modulation_img(vec), *self.double_stream_modulation_txt(vec),
                                     self.single_stream_modulation(vec)[0])
            return img, txt, vec, mods, positions, hw
        return img, txt, vec, positions, hw


class FluxDoubleBlock(StageLayer):
    """One double-stream block (separate image and text weights, joint attention)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.double_blocks[index], f"double_blocks.{index}")
        self.pe_embedder = dm.pe_embedder
        self.last = last

    def forward(self, inputs):
        img, txt, *conds, ids, hw = inputs
        vec = conds[0] if len(conds) == 1 else tuple(
            (_modulation(conds[1], 2 * s), _modulation(conds[1], 2 * s + 1)) for s in (0, 1))
        pe = self.pe_embedder(ids)
        with OutOfPlaceResidualAdds(img, txt):
            img, txt = self.block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=None, transformer_options={})
        if self.last:
            return img, conds[0], hw
        return img, txt, *conds, ids, hw


class FluxSingleBlock(StageLayer):
    """One single-stream block over the text tokens followed by the image tokens."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.single_blocks[index], f"single_blocks.{index}")
        self.pe_embedder = dm.pe_embedder
        self.last = last

    def forward(self, inputs):
        img, txt, *conds, ids, hw = inputs
        vec = conds[0] if len(conds) == 1 else _modulation(conds[1], 4)
        text_len = txt.shape[1]
        x = torch.cat((txt, img), dim=1)
        pe = self.pe_embedder(ids)
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, vec=vec, pe=pe, attn_mask=None, transformer_options={})
        img = x[:, text_len:]
        if self.last:
            return img, conds[0], hw
        return img, x[:, :text_len], *conds, ids, hw


class FluxFinal(StageLayer):
    """Final modulated projection of the target's tokens (reference tokens are dropped first, as ComfyUI
    drops them from the output), then un-patchify and crop to the input latent size."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size = dm.patch_size

    def forward(self, inputs):
        img, vec, hw = inputs
        h, w = int(hw[0]), int(hw[1])
        p = self.patch_size
        gh, gw = (h + p // 2) // p, (w + p // 2) // p
        out = self.final_layer(img[:, : gh * gw], vec)
        batch, _, features = out.shape
        channels = features // (p * p)
        out = out.reshape(batch, gh, gw, channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(batch, channels, gh * p, gw * p)[:, :, :h, :w]


def flux_stage_layers(dm: nn.Module) -> list[StageLayer]:
    """Embed, every double then every single block, final: the layers of any model of ComfyUI's Flux class."""
    n_double, n_single = len(dm.double_blocks), len(dm.single_blocks)
    if n_double + n_single == 0:
        raise ValueError("This Flux model has no transformer blocks; nothing to train.")
    total = n_double + n_single
    doubles = [FluxDoubleBlock(dm, i, last=i == total - 1) for i in range(n_double)]
    singles = [FluxSingleBlock(dm, i, last=n_double + i == total - 1) for i in range(n_single)]
    return [FluxEmbed(dm), *doubles, *singles, FluxFinal(dm)]


def reference_specs(count: int, what: str) -> dict[str, ExtraSpec]:
    """Optional ``reference_0..count-1`` extras: raw VAE latents of any size, processed like the latent."""
    return {reference_extra(i): ExtraSpec(
        shape=("C", "*", "*"), source="latent", required=False, is_latent=True,
        description=f"reference image {i} of {what} (its VAE latent), seen as ComfyUI's ReferenceLatent hands it over")
        for i in range(count)}


class FluxAdapter:
    name = "Flux"
    options_type = FluxOptions
    presets = (ai_toolkit("FLUX.1 dev, 24 GB", "train_lora_flux_24gb", 16),
               ai_toolkit("FLUX.1 Kontext dev, 24 GB", "train_lora_flux_kontext_24gb", 16, resolutions=(512, 768)))
    distillation = Distillation(checkpoints="FLUX.1 schnell")  # dev is guidance-distilled: ``guidance``
    max_references = MAX_REFERENCES

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        refuse_unsupported(self, diffusion_model)
        return flux_stage_layers(diffusion_model)

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.double_blocks) + len(diffusion_model.single_blocks)
        return [False, *([FluxDoubleBlock.swappable] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"(double_blocks|single_blocks)\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """Optional reference images (FLUX.1 Kontext); a text-to-image dataset has none."""
        return reference_specs(self.max_references, "a FLUX.1 Kontext edit pair")

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the latent as ComfyUI's ``Flux.process_img`` pads and cuts it."""
        p = diffusion_model.patch_size
        h, w = latent_shape[-2:]
        return ((h + p // 2) // p) * ((w + p // 2) // p)

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        noisy, pooled, options = batch.noisy, batch.pooled, batch.options or self.options_type()
        size = noisy.shape[0]
        if pooled is None:
            pooled = torch.zeros(size, 0, dtype=noisy.dtype)
        # ComfyUI hands extra conds such as guidance to the model in the compute dtype.
        guidance = torch.full((size,), options.guidance, dtype=noisy.dtype)
        return noisy, batch.timestep, batch.cond, pooled, guidance, *references_of(batch.extras)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width or 0)``: T5-XXL 4096 and CLIP-L 768 for Flux.1 dev/schnell."""
        params = diffusion_model.params
        return int(params.context_in_dim), int(params.vec_in_dim or 0)

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI's Flux T5 tokenizer pads every caption to at least 256 tokens with its pad token (in
        the cache) and cuts none, so only captions past 256 tokens make the others of their batch see
        zero tokens. ComfyUI gives Flux.1 no text attention mask by default, so those zero tokens take
        part in the attention; cutting at 256 or 512 instead would train on less of a caption than
        sampling encodes."""
        return max(lengths)


ADAPTER = register(FluxAdapter(), model_classes=("Flux",))
