"""LongCat-Image (``model_base.LongCatImage``: ComfyUI's ``Flux`` network in LongCat's layout) as pipeline stage layers.

Why a family of its own: ComfyUI builds LongCat-Image with its Flux network and its Flux model class's
subclass ``LongCatImage``, whose data flow differs from FLUX.1 in three places that the Flux family
(:mod:`.flux`) would skip, training silently wrong (it refuses such a model, see ``_flux1_lookalike``):

- text tokens get rotary positions: they count 0, 1, 2... along the axes ``FluxParams.txt_ids_dims``
  ([1, 2], set by ComfyUI's detection for a 3584-wide context without a pooled vector);
- ``LongCatImage._apply_model`` shifts the image positions by ComfyUI's ``rope_options``: index
  ``shift_t`` 1, rows and columns by the text length (``shift_y`` = ``shift_x`` = the cond's tokens),
  which ``Flux.process_img`` applies. :class:`LongCatEmbed` hands ``process_img`` exactly those options
  (built as ``_apply_model`` builds them), so the image tokens sit past the text tokens on every axis;
- no guidance (``extra_conds`` drops it) and no pooled vector (``encode_adm`` returns None).

Everything else is Flux's: the stage layers are :mod:`.flux`'s (double and single blocks, final layer),
with the same tuples: embed ``(x, timestep, context, y [B, 0], guidance [B, 0])`` ->
``(img, txt, vec, ids, hw)``; each block the same tuple; the last block ``(img, vec, hw)``; final -> the
prediction shaped like ``x``. Blocks are swappable and run under the out-of-place residual guard there.

Loss. ``model_base.LongCatImage`` is a ``Flux`` model (``ModelType.FLUX``): ComfyUI's
``ModelSamplingFlux`` with the config's settings (the LongCatImage config sets none: ComfyUI's defaults)
and the CONST target ``noise - x0``; training/objective takes both from the model.

Text: Qwen2.5-VL's 3584-wide states. ComfyUI's LongCat tokenizer pads every caption to 512 tokens and
cuts longer ones, and the encoder strips the chat template, so every cond has the same length; the
model takes no text mask (``Flux.extra_conds`` passes a mask only with an image mask shape), so the
pad states take part in attention as at sampling, and ``shift_y`` / ``shift_x`` is that same length.

Not taken: reference images (LongCat-Image-Edit puts its references in the prompt through the text
encoder's edit template, which the cache does not encode), so LongCat trains text-to-image; the
Flux relatives' refusals (a Fill-style concatenated input, Ovis's ``txt_norm`` / gated MLP, shared
modulation, no final layer) hold here too, by name.

Fixture tier: detection pins 3584-wide text and the real hidden size, so the tests build a tiny model in
memory from ComfyUI's own ``LongCatImage`` config class (tests/family_rows/longcat_image.py, 0.19 M
parameters); tests/test_stage_split.py trains it 2 steps in 1 and 2 gloo stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, StageLayer, refuse_unsupported, register
from .flux import FluxAdapter, FluxEmbed, flux_stage_layers
from .options import NoOptions

FAMILY = "LongCat"
SHIFT_T = 1.0  # LongCatImage._apply_model: rope_opts.setdefault("shift_t", 1.0)


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.flux.model import Flux

    if not isinstance(dm, Flux):
        return f"{type(dm).__name__} is not ComfyUI's Flux network; the {FAMILY} adapter cannot train it."
    params = dm.params
    if params.global_modulation or len(params.axes_dim) != 3:
        return "This LongCat-Image model has Flux.2's shared modulation or 4 rotary axes; it cannot be LongCat-Image."
    different = [name for name, longcat in (("txt_norm", False), ("yak_mlp", False), ("mlp_silu_act", False),
                                            ("ops_bias", True)) if getattr(params, name, longcat) != longcat]
    if different:
        return (f"This model differs from LongCat-Image in {', '.join(different)} (another Flux relative); the "
                f"{FAMILY} adapter would train it silently wrong, so it refuses.")
    if params.in_channels != params.out_channels:
        return ("LongCat-Image models with image conditioning concatenated to the latent are not supported; "
                "LongCat-Image text-to-image is.")
    if not hasattr(dm, "final_layer"):
        return "This LongCat-Image model has no final layer (a feature extractor); it cannot be trained."
    return None


class LongCatEmbed(FluxEmbed):
    """Flux's embed stage with LongCat's rope shifts and without guidance (ComfyUI's ``extra_conds`` drops it)."""

    def __init__(self, dm: nn.Module):
        super().__init__(dm)
        if "guidance_in" in self.comfy_paths:
            del self.comfy_paths["guidance_in"]
        self.guidance_in = None

    def transformer_options(self, context: torch.Tensor) -> dict:
        """``rope_options`` as ``LongCatImage._apply_model`` sets them when the graph sets none."""
        pe_len = float(context.shape[1])
        return {"rope_options": {"shift_t": SHIFT_T, "shift_y": pe_len, "shift_x": pe_len}}


class LongCatAdapter(FluxAdapter):
    name = FAMILY
    options_type = NoOptions
    max_references = 0

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        refuse_unsupported(self, diffusion_model)
        layers = flux_stage_layers(diffusion_model)
        return [LongCatEmbed(diffusion_model), *layers[1:]]

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(3584, 0)`` on LongCat-Image: Qwen2.5-VL's states; ``encode_adm`` gives no pooled vector."""
        return int(diffusion_model.params.context_in_dim), 0

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("LongCat-Image needs the text encoder's states, and the cache has none: cache the "
                             "dataset with LongCat-Image's Qwen2.5-VL text encoder.")
        # No pooled vector and no guidance: empty tensors in their places of Flux's embed tuple.
        none = torch.zeros(batch.noisy.shape[0], 0, dtype=batch.noisy.dtype)
        return batch.noisy, batch.timestep, batch.cond, none, none.clone()

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch (ComfyUI's LongCat encoder gives every caption 512 tokens)."""
        return max(lengths)


ADAPTER = register(LongCatAdapter(), model_classes=("LongCatImage",))
