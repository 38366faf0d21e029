"""AuraFlow (``comfy.ldm.aura.mmdit.MMDiT``, ``model_base.AuraFlow``) as pipeline stage layers.

Why a family of its own: AuraFlow's MMDiT is not SD3's (training/pipelines/mmdit.py). It has joint
("double") blocks over separate text and image streams followed by single blocks over one joined
sequence, 8 learned register tokens in front of the text, a learned (interpolated) positional table
instead of SD3's cropped sin-cos one, no pooled vector, and bias-free Linears with other names. So it
shares only the un-patchify idea with SD3, and nothing here can reuse SD3's layers.

Stage tuples (``B`` batch; ``T`` = 8 register tokens + the text tokens; ``N`` image patches):

- embed: ``(x [B, C, H, W], timestep [B], context [B, T', 2048])`` -> ``(x [B, N, dim], c [B, T, dim], g, meta)``:
  ComfyUI's ``patchify`` (pads odd sides), ``init_x_linear``, ``apply_pos_embeds`` (its own method,
  bilinear-interpolating the table past ``max_seq``), ``cond_seq_linear`` with the register tokens in
  front, ``g`` the time embedding (``t_embedder``; ComfyUI's flow ``model_sampling`` hands it the sigma,
  multiplier 1, and the embedder scales by 1000 itself);
- each double block: the same tuple; the last one joins ``cat([c, x])`` (as ComfyUI's ``_forward``) into
  ``(cx [B, T+N, dim], g, meta)``, the tuple of every single block;
- the last single block keeps the image tokens: ``(x, g, meta)``;
- final: ``modF`` modulation, ``final_linear``, un-patchify, crop to the latent's size.

``meta`` (int64) holds the latent height and width and ``T``. This is ComfyUI's ``MMDiT._forward`` cut at
its block boundaries, identical on ComfyUI 0.3.75 and current ComfyUI (v0.33). Its blocks add residuals out
of place; they still run under the out-of-place guard like every family's blocks.

Loss. ``model_base.AuraFlow`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the
config's shift 1.73 (a ModelSamplingAuraFlow node before Train LoRA is replayed in training like on the
other flow families) and the CONST target ``noise - x0``; training/objective takes both from the model.

Text: Pile-T5-XL's 2048-wide states (``AuraT5Model``), padded by ComfyUI's tokenizer to at least 256 tokens
with zeroed pad states; the model takes no text mask, so the rare longer caption gives the others of its
micro-batch zero tokens (:meth:`AuraFlowAdapter.text_length`), as ComfyUI's zeroed pads already are.

Refused by name: a layout without single blocks (its last double block is built ``is_last``, with a
2 x dim modulation that ComfyUI's own block cannot split in six: it cannot run in ComfyUI either).

Fixture tier: detection pins dim 3072 (about 340 M parameters per double block), so the tests build a
tiny model in memory from ComfyUI's own ``AuraFlow`` config class (tests/family_rows/auraflow.py, 0.17 M
parameters); tests/test_stage_split.py trains it 2 steps through DeepSpeed's pipeline engine in 1 and 2
stages on gloo ranks (bitwise equal in fp32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "AuraFlow"
_BLOCKS = r"(double_layers|single_layers)\.\d+\."
_ATTENTION = r"attn\.w[12][qkvo]"
_MLP = r"mlp[CX]?\.c_(fc1|fc2|proj)"
_MODULATION = r"mod(C|X|CX)\.1"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.aura.mmdit import MMDiT

    if not isinstance(dm, MMDiT):
        return f"{type(dm).__name__} is not an AuraFlow MMDiT; the {FAMILY} adapter cannot train it."
    if len(dm.single_layers) == 0:
        return ("This AuraFlow model has no single blocks: its last double block is built without a text MLP and "
                "with a modulation ComfyUI's own forward cannot split, so it cannot run in ComfyUI either. "
                "AuraFlow models with double and single blocks (v0.1-v0.3) are supported.")
    return None


class AuraEmbed(StageLayer):
    """Patchify, input projection, positional table, text projection with register tokens, time embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "init_x_linear", "cond_seq_linear", "t_embedder")
        # Parameters of the model itself, which loading fills: the same tensors (attribute names as ComfyUI's,
        # read by its own patchify / apply_pos_embeds, which are reused below).
        self.adopt_tensor("positional_encoding", dm, "positional_encoding")
        self.adopt_tensor("register_tokens", dm, "register_tokens")
        self.patch_size, self.h_max, self.w_max = dm.patch_size, dm.h_max, dm.w_max
        self._patchify = type(dm).patchify
        self._apply_pos_embeds = type(dm).apply_pos_embeds

    def forward(self, inputs):
        import comfy.ops

        x, timestep, context = inputs
        _, _, h, w = x.shape
        x = self._apply_pos_embeds(self, self.init_x_linear(self._patchify(self, x)), h, w)
        c = self.cond_seq_linear(context)
        c = torch.cat([comfy.ops.cast_to_input(self.register_tokens, c).repeat(c.size(0), 1, 1), c], dim=1)
        g = self.t_embedder(timestep, x.dtype)
        meta = torch.tensor([h, w, c.shape[1]], dtype=torch.int64, device=x.device)
        return x, c, g, meta


class AuraDouble(StageLayer):
    """One joint block over the text and image streams; the last joins them for the single blocks."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, join: bool):
        super().__init__()
        self.adopt("block", dm.double_layers[index], f"double_layers.{index}")
        self.join = join

    def forward(self, inputs):
        x, c, g, meta = inputs
        with OutOfPlaceResidualAdds(x, c):
            c, x = self.block(c, x, g, transformer_options={})
        if self.join:
            return torch.cat([c, x], dim=1), g, meta
        return x, c, g, meta


class AuraSingle(StageLayer):
    """One single block over the joined sequence; the last keeps only the image tokens."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.single_layers[index], f"single_layers.{index}")
        self.last = last

    def forward(self, inputs):
        cx, g, meta = inputs
        with OutOfPlaceResidualAdds(cx):
            cx = self.block(cx, g, transformer_options={})
        if self.last:
            return cx[:, int(meta[2]):], g, meta
        return cx, g, meta


class AuraFinal(StageLayer):
    """``modF`` modulation, ``final_linear``, un-patchify (ComfyUI's own method), crop."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "modF", "final_linear")
        self.patch_size, self.out_channels = dm.patch_size, dm.out_channels
        self._unpatchify = type(dm).unpatchify

    def forward(self, inputs):
        from comfy.ldm.aura.mmdit import modulate

        x, g, meta = inputs
        h, w = int(meta[0]), int(meta[1])
        shift, scale = self.modF(g).chunk(2, dim=1)
        x = self.final_linear(modulate(x, shift, scale))
        p = self.patch_size
        return self._unpatchify(self, x, (h + 1) // p, (w + 1) // p)[:, :, :h, :w]


class AuraFlowAdapter:
    name = FAMILY
    options_type = NoOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n_double, n_single = len(dm.double_layers), len(dm.single_layers)
        return [
            AuraEmbed(dm),
            *(AuraDouble(dm, i, join=i == n_double - 1) for i in range(n_double)),
            *(AuraSingle(dm, i, last=i == n_single - 1) for i in range(n_single)),
            AuraFinal(dm),
        ]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.double_layers) + len(diffusion_model.single_layers)
        return [False, *([True] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"{_BLOCKS}({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(2048, 0)`` on AuraFlow: Pile-T5-XL's states (read from ``cond_seq_linear``); no pooled vector."""
        return int(diffusion_model.cond_seq_linear.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        p = int(diffusion_model.patch_size)
        return math.prod(-(-int(s) // p) for s in latent_shape[-2:])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("AuraFlow needs the text encoder's states, and the cache has none: cache the dataset "
                             "with AuraFlow's Pile-T5 text encoder.")
        return batch.noisy, batch.timestep, batch.cond

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut (ComfyUI pads
        captions to 256 tokens with zeroed states already, and the model takes no text mask)."""
        return max(lengths)


ADAPTER = register(AuraFlowAdapter(), model_classes=("AuraFlow",))
