"""Ideogram 4 (``comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel``, ``model_base.Ideogram4``) as stage layers.

Why a family of its own: Ideogram 4 is a single-stream DiT over one packed ``[text, image]`` sequence whose
rows all share one width: text rows carry Qwen3-VL features (13 tapped layers, 53248 wide) through
``llm_cond_norm`` / ``llm_cond_proj``, image rows the 128-channel latent through ``input_proj``, and a learned
indicator embedding tells them apart. It modulates each block from one adaLN vector (``adaln_proj`` of a
scalar time embedding), uses Qwen3-VL's interleaved multi-axis RoPE, and masks padded text as its own
attention segment. Lumina 2 is the nearest relative (its ``FeedForward``), but neither its embedders nor its
token layout fit.

Stage tuples (``B`` batch; ``T`` text tokens; ``N`` latent positions, each one token: the Flux.2 VAE's 128
channels are already 2 x 2 patches of 32):

- embed: ``(x [B, C, H, W], timestep [B], context [B, T, 53248], text_mask [B, T] or [B, 0])``
  -> ``(h [B, T+N, D], adaln [B, 1, A], ids [B, T+N, 3], text_mask, meta)``: ComfyUI's ``_run_conditional``
  packing (its ``_img_to_tokens`` and ``_image_position_ids``; text positions ``(i, i, i)``, padded text
  rows as their own segment with indicator 0) and ``_backbone``'s prologue up to its blocks. The network sees
  ``1 - timestep`` (ComfyUI's ``_forward``; the flow ``model_sampling`` hands it the sigma, multiplier 1).
- each block: the same tuple; it recomputes the rotary table from ``ids`` with ComfyUI's own
  ``precompute_freqs_cis`` and ``_split_half_rope_matrix`` (parameter-free, as ``_backbone`` computes it once)
  and the additive segment mask from ``text_mask``; the last gives ``(h, adaln, meta)``.
- final: ``final_layer`` on ``adaln``, the image rows, ComfyUI's ``_tokens_to_img``, negated as ``_forward`` returns.

``meta`` (int64) holds the latent height and width and ``T``. This is current ComfyUI's (v0.33) conditional
forward cut at its block boundaries. Its blocks add residuals out of place; they still run under the
out-of-place guard like every family's blocks.

Loss. ``model_base.Ideogram4`` is ``ModelType.FLOW``: ``ModelSamplingDiscreteFlow`` with the config's shift
1.0 and multiplier 1, and the CONST target ``noise - x0`` (the model negates its output for that);
training/objective takes both from the model.

Text: the Qwen3-VL encoder returns its attention mask, which the cache keeps (extra ``attention_mask``);
ComfyUI's ``Ideogram4.extra_conds`` hands it to the model only when it masks something, and so do the
layers. A micro-batch's shorter captions get zero tokens appended with a mask of 0 (padding, as ComfyUI
treats it); without a cached mask they are unmasked (:meth:`Ideogram4Adapter.text_length`).

Refused by name: diffusion models of the Ideogram4 class that are not ComfyUI's ``Ideogram4Transformer2DModel``
(none in ComfyUI today). The unconditional image-only path (``context`` None) is never trained: every
cached caption, the empty one included, has text states.

Fixture tier: detection pins 18 heads of 256 (about 0.4 B parameters per block), so the tests build a tiny
model in memory from ComfyUI's own ``Ideogram4`` config class (tests/family_rows/ideogram4.py, 0.03 M
parameters); the 1-vs-2-stage gloo check (tests/test_stage_split.py) picks the row up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "Ideogram4"
TEXT_MASK = "attention_mask"
_BLOCKS = r"layers\.\d+\."
_ATTENTION = r"attention\.(qkv|o)"
_MLP = r"feed_forward\.w[123]"
_MODULATION = r"adaln_modulation"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.ideogram4.model import Ideogram4Transformer2DModel

    if type(dm) is not Ideogram4Transformer2DModel:
        return (f"{type(dm).__name__} is not ComfyUI's Ideogram4Transformer2DModel; the {FAMILY} adapter cannot "
                "train it. Ideogram 4 models are supported.")
    return None


def _padding(text_mask: torch.Tensor) -> torch.Tensor | None:
    """The text mask when it masks something (as ``Ideogram4.extra_conds`` passes it), else None."""
    if text_mask.shape[1] == 0 or bool((text_mask != 0).all()):
        return None
    return text_mask


class IdeogramEmbed(StageLayer):
    """Packing of text and image rows, input and text projections, indicator and time embeddings."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "input_proj", "llm_cond_norm", "llm_cond_proj", "t_embedding", "adaln_proj",
                        "embed_image_indicator")
        self.patch_size, self.ae_channels = dm.patch_size, dm.ae_channels
        self._img_to_tokens = type(dm)._img_to_tokens
        self._image_position_ids = type(dm)._image_position_ids

    def forward(self, inputs):
        import torch.nn.functional as F
        from comfy.ldm.ideogram4.model import LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR

        x, timestep, context, text_mask = inputs
        b, _, gh, gw = x.shape
        t = 1.0 - timestep
        img_tokens = self._img_to_tokens(self, x)
        n_text, n = context.shape[1], context.shape[1] + img_tokens.shape[1]
        x_full = torch.zeros(b, n, img_tokens.shape[-1], dtype=img_tokens.dtype, device=x.device)
        x_full[:, n_text:] = img_tokens
        text_pos = torch.arange(n_text, device=x.device).view(-1, 1).expand(n_text, 3)
        positions = torch.cat([text_pos, self._image_position_ids(self, gh, gw, x.device)], dim=0)
        ids = positions.unsqueeze(0).expand(b, n, 3).contiguous()
        indicator = torch.empty(b, n, dtype=torch.long, device=x.device)
        indicator[:, :n_text] = LLM_TOKEN_INDICATOR
        indicator[:, n_text:] = OUTPUT_IMAGE_INDICATOR
        mask = _padding(text_mask)
        if mask is not None:
            indicator[:, :n_text][mask == 0] = 0
        # ``_backbone`` up to its blocks
        image_rows = (indicator == OUTPUT_IMAGE_INDICATOR).to(x.dtype).unsqueeze(-1)
        h = self.input_proj(x_full * image_rows) * image_rows
        t_cond = self.t_embedding(t, dtype=x.dtype)
        if t.dim() == 1:
            t_cond = t_cond.unsqueeze(1)
        adaln = F.silu(self.adaln_proj(t_cond))
        text_rows = (indicator[:, :n_text] == LLM_TOKEN_INDICATOR).to(x.dtype).unsqueeze(-1)
        llm = self.llm_cond_proj(self.llm_cond_norm(context * text_rows)) * text_rows
        h[:, :n_text] = h[:, :n_text] + llm
        h = h + self.embed_image_indicator((indicator == OUTPUT_IMAGE_INDICATOR).to(torch.long), out_dtype=h.dtype)
        meta = torch.tensor([gh, gw, n_text], dtype=torch.int64, device=x.device)
        return h, adaln, ids, text_mask, meta


class IdeogramBlock(StageLayer):
    """One transformer block over the packed sequence."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.layers[index], f"layers.{index}")
        self.head_dim, self.rope_theta, self.mrope_section = dm.head_dim, dm.rope_theta, dm.mrope_section
        self.last = last

    def _freqs(self, ids: torch.Tensor) -> torch.Tensor:
        from comfy.ldm.ideogram4.model import _split_half_rope_matrix
        from comfy.text_encoders.llama import precompute_freqs_cis

        freqs = precompute_freqs_cis(self.head_dim, ids[0].transpose(0, 1), self.rope_theta,
                                     rope_dims=self.mrope_section, interleaved_mrope=True, device=ids.device)
        return _split_half_rope_matrix(freqs)

    @staticmethod
    def _attention_mask(text_mask: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``_run_conditional``'s segment mask (padded text its own segment), made additive as ``_backbone`` does."""
        from comfy.ldm.ideogram4.model import SEQUENCE_PADDING_INDICATOR

        mask = _padding(text_mask)
        if mask is None:
            return None
        segment = torch.ones(mask.shape[0], n, dtype=torch.long, device=mask.device)
        segment[:, :mask.shape[1]][mask == 0] = SEQUENCE_PADDING_INDICATOR
        attend = (segment.unsqueeze(2) == segment.unsqueeze(1)).unsqueeze(1)
        return torch.zeros_like(attend, dtype=dtype).masked_fill_(~attend, -torch.finfo(dtype).max)

    def forward(self, inputs):
        h, adaln, ids, text_mask, meta = inputs
        mask = self._attention_mask(text_mask, h.shape[1], h.dtype)
        with OutOfPlaceResidualAdds(h):
            h = self.block(h, mask, self._freqs(ids), adaln, transformer_options={})
        if self.last:
            return h, adaln, meta
        return h, adaln, ids, text_mask, meta


class IdeogramFinal(StageLayer):
    """``final_layer``, the image rows, ComfyUI's ``_tokens_to_img``, negated."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size, self.ae_channels = dm.patch_size, dm.ae_channels
        self._tokens_to_img = type(dm)._tokens_to_img

    def forward(self, inputs):
        h, adaln, meta = inputs
        gh, gw, n_text = (int(v) for v in meta)
        out = self.final_layer(h, adaln)
        return -self._tokens_to_img(self, out[:, n_text:], gh, gw)


class Ideogram4Adapter:
    name = FAMILY
    options_type = NoOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.layers)
        if n == 0:
            raise ValueError("This Ideogram 4 model has no blocks; nothing to train.")
        return [IdeogramEmbed(dm), *(IdeogramBlock(dm, i, last=i == n - 1) for i in range(n)), IdeogramFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([IdeogramBlock.swappable] * len(diffusion_model.layers)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"{_BLOCKS}({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        return Geometry(patch=(1, 1, 1))  # one token per latent position (the VAE's channels are the 2 x 2 patch)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(53248, 0)`` on Ideogram 4: 13 Qwen3-VL layers (read from ``llm_cond_proj``); no pooled vector."""
        return int(diffusion_model.llm_cond_proj.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {TEXT_MASK: ExtraSpec(shape=("T",), source="text", required=False, follows_text=True,
                                     description="the text attention mask of the Qwen3-VL text encoder")}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        return int(latent_shape[-2]) * int(latent_shape[-1])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("Ideogram 4 needs the text encoder's states, and the cache has none: cache the dataset "
                             "with Ideogram 4's Qwen3-VL text encoder.")
        mask = batch.extras.get(TEXT_MASK)
        x = batch.noisy
        mask = mask.to(torch.int64) if mask is not None else torch.zeros(x.shape[0], 0, dtype=torch.int64)
        return x, batch.timestep, batch.cond, mask

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; shorter ones get zero tokens (masked when a mask is cached)."""
        return max(lengths)


ADAPTER = register(Ideogram4Adapter(), model_classes=("Ideogram4",))
