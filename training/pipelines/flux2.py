"""Flux.2 (``comfy.model_base.Flux2``: FLUX.2 dev, and FLUX.2 Klein where the host ComfyUI has it).

ComfyUI builds Flux.2 with the same network class as FLUX.1 (``comfy.ldm.flux.model.Flux``), and the
data flow through the blocks is the same, so the stage layers are :mod:`.flux`'s (which read the
differences from ``FluxParams``: shared modulation computed once in the embed stage, a fourth rotary
axis along which text tokens count, reference tokens on rotary index ``10 * k``). What differs is
family policy, which lives here:

- the text: ComfyUI's ``Flux2.extra_conds`` left-pads the cond with zero tokens to 512, so the
  caption always ends at the same rotary text position; :meth:`Flux2Adapter.first_stage_inputs` does
  the same to the micro-batch (the zeros a shorter caption got at the end move to the front);
- no pooled vector; guidance only where the model has a guidance embedding (dev; Klein has none);
- LoRA presets: the shared modulation Linears (``double_stream_modulation_*``,
  ``single_stream_modulation``) belong to ``all_linear``;
- up to 10 reference images (Flux.2's multi-reference editing);
- sigmas: ComfyUI's ``ModelSamplingFlux`` with the config's shift 2.02, read from ``model_sampling``.

Klein (current ComfyUI) is the same class without a guidance embedding and with a Qwen3 text width:
nothing here depends on those sizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .base import Batch, ExtraSpec, register
from .flux import _ATTENTION, _MLP, FluxAdapter, FluxOptions, reference_specs

TEXT_TOKENS = 512  # model_base.Flux2.extra_conds pads shorter conds (on the left) to this many tokens
MAX_REFERENCES = 10

_SHARED_MODULATION = r"(double_stream_modulation_(img|txt)|single_stream_modulation)\.lin"
_BLOCKS = r"(double_blocks|single_blocks)\.\d+\."


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.flux.model import Flux

    if not isinstance(dm, Flux):
        return f"{type(dm).__name__} is not ComfyUI's Flux network; PipeTrainer's Flux.2 adapter cannot train it."
    params = dm.params
    if not params.global_modulation or len(params.axes_dim) != 4:
        return "This Flux.2 model has no shared modulation or not 4 rotary axes; PipeTrainer cannot train it."
    if getattr(params, "txt_norm", False) or getattr(params, "yak_mlp", False):
        return "This Flux.2 relative (txt_norm / yak_mlp) needs its own adapter; PipeTrainer cannot train it yet."
    if params.in_channels != params.out_channels:
        return "Flux.2 models with image conditioning concatenated to the latent are not supported yet."
    if not hasattr(dm, "final_layer"):
        return "This Flux.2 model has no final layer (a feature extractor); it cannot be trained."
    return None


def left_aligned_text(cond: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, max(length, T), C]``: each cond's tokens up to its last non-zero token, moved to the end,
    with zero tokens before them (what ``Flux2.extra_conds`` makes of one cond).

    The micro-batch appended zero tokens to the shorter conds (``text_length``); a text encoder never
    outputs an all-zero token, so trailing zero tokens are exactly those, and they move to the front
    where ComfyUI puts its own padding."""
    batch, tokens, _ = cond.shape
    out = cond.new_zeros(batch, max(length, tokens), cond.shape[-1])
    nonzero = cond.ne(0).any(dim=-1)
    for i in range(batch):
        real = int(nonzero[i].nonzero().max()) + 1 if nonzero[i].any() else 0
        if real:
            out[i, out.shape[1] - real:] = cond[i, :real]
    return out


class Flux2Adapter(FluxAdapter):
    name = "Flux2"
    options_type = FluxOptions
    max_references = MAX_REFERENCES

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def lora_target_regex(self, preset: str) -> str:
        blocks = {"attention": _ATTENTION, "attention_mlp": rf"{_ATTENTION}|{_MLP}", "all_linear": rf"{_ATTENTION}|{_MLP}"}
        regex = rf"{_BLOCKS}({blocks[preset]})"
        return rf"{regex}|{_SHARED_MODULATION}" if preset == "all_linear" else regex

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """Optional reference images (Flux.2 multi-reference editing)."""
        return reference_specs(self.max_references, "a Flux.2 edit example")

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        inputs = super().first_stage_inputs(batch)
        return inputs[0], inputs[1], left_aligned_text(inputs[2], TEXT_TOKENS), *inputs[3:]

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, 0)``: Mistral-3 (dev, 15360) or Qwen3 (Klein) hidden states, no pooled vector."""
        return int(diffusion_model.params.context_in_dim), 0

    def text_length(self, lengths) -> int:
        """The longest cond of the micro-batch (nothing is cut); :meth:`first_stage_inputs` then puts the
        added zero tokens in front and pads to 512, as ComfyUI does for one cond. Captions past 512
        tokens make the others of their batch start at a later text position than in sampling."""
        return max(lengths)


ADAPTER = register(Flux2Adapter(), model_classes=("Flux2",))
