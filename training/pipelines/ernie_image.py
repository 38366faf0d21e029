"""Ernie-Image (``comfy.ldm.ernie.model.ErnieImageModel``, ``model_base.ErnieImage``) as pipeline stage layers.

Why a family of its own: Ernie-Image is a single-stream DiT whose one sequence is the image patches
followed by the projected text (Ministral-3 3B states), with one adaLN modulation shared by every block
(computed once from the time embedding, like PixArt's adaLN-single but without per-block tables), a
3-axis rotary embedding over ``(index, row, column)`` ids and gated-GELU MLPs. No other family has that
data flow (Lumina 2 puts the text first and modulates per block; Flux.2 has double blocks).

Stage tuples (``B`` batch; ``N`` image patches, ``T`` text tokens):

- embed: ``(x [B, C, H, W], timestep [B], context [B, T, text_dim])`` -> ``(h [B, N+T, D], c [B, D], mod [B, 6D], ids, meta)``:
  ``x_embedder`` (patch conv), ``text_proj`` (absent when the text is as wide as the model), the time
  embedding ``c`` (``time_proj`` + ``time_embedding``; ComfyUI's flow ``model_sampling`` hands it
  ``sigma * 1000``) and ``mod = adaLN_modulation(c)``, the modulation every block chunks in six as
  ``forward`` does. ``ids`` (int64 ``[B, N+T, 3]``) are the rotary positions of ``forward``: image patch
  ``(T, row, col)``, text token ``(i, 0, 0)``; every block recomputes its rotary table from them with the
  parameter-free ``pos_embed`` (ComfyUI computes it once; the ids are whole numbers, so it is the same table).
- each block: the same tuple; the last gives ``(h, c, meta)``;
- final: ``final_norm`` on ``c``, ``final_linear``, the image tokens, un-patchify.

``meta`` (int64) holds the latent height and width. This is ``ErnieImageModel.forward`` on current ComfyUI
(v0.33) cut at its block boundaries, without a sampling-time ``rope_options`` patch. Its blocks add residuals
out of place; they still run under the out-of-place guard like every family's blocks.

Loss. ``model_base.ErnieImage`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the
config's shift 3 and multiplier 1000, and the CONST target ``noise - x0``; training/objective takes both from
the model (a ModelSamplingAuraFlow / SD3 node before Train LoRA is replayed as on the other flow families).

Text: the Ministral-3 3B encoder's states (3072 wide; ``text_proj`` says the width). ComfyUI's
``ErnieImage.extra_conds`` hands the model no text mask and its tokenizer does not pad, so ComfyUI never
batches captions of different lengths; with ``batch_size`` 1 training sees exactly that, in a larger
micro-batch the shorter captions get zero tokens appended (:meth:`ErnieImageAdapter.text_length`), which
take part in the attention. A cached text mask is not used (the model takes none).

Latents are 128-channel Flux.2 VAE latents; patch size 1 as ComfyUI's detection builds the model. A
layout with a larger patch needs whole multiples of it (``forward`` reshapes to ``H // p`` patches): the
geometry says so and preflight refuses other sizes.

Backward: ComfyUI's ``ErnieImageAttention`` ropes through comfy_kitchen's ``apply_rope_split_half`` op even
in training mode, and that op has no autograd formula; :meth:`ErnieImageAdapter.stage_layers` registers one
(patches/comfy_kitchen_rope_backward.py, through comfy_kitchen's own eager reference of the op).

Refused by name: diffusion models of the ErnieImage class that are not ComfyUI's ``ErnieImageModel``
(none in ComfyUI today).

Fixture tier: detection pins nothing but the family (the model is built at its defaults, hidden 4096: about
8 B parameters), so the tests build a tiny model in memory from ComfyUI's own ``ErnieImage`` config class
(tests/family_rows/ernie_image.py, 0.03 M parameters); the 1-vs-2-stage gloo check (tests/test_stage_split.py)
picks the row up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "ErnieImage"
_BLOCKS = r"layers\.\d+\."
_ATTENTION = r"self_attention\.(to_q|to_k|to_v|to_out\.0)"
_MLP = r"mlp\.(gate_proj|up_proj|linear_fc2)"
_TARGETS = {
    "attention": rf"{_BLOCKS}{_ATTENTION}",
    "attention_mlp": rf"{_BLOCKS}({_ATTENTION}|{_MLP})",
    # The blocks hold no modulation Linear: all of them share ``adaLN_modulation`` (its Linear is index 1).
    "all_linear": rf"{_BLOCKS}({_ATTENTION}|{_MLP})|adaLN_modulation\.1",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.ernie.model import ErnieImageModel

    if type(dm) is not ErnieImageModel:
        return (f"{type(dm).__name__} is not ComfyUI's ErnieImageModel; the {FAMILY} adapter cannot train it. "
                "Ernie-Image models are supported.")
    return None


class ErnieEmbed(StageLayer):
    """Patch embedding, text projection, time embedding, the shared modulation, rotary ids."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "x_embedder", "time_proj", "time_embedding", "adaLN_modulation")
        self.text_proj = None
        if dm.text_proj is not None:
            self.adopt("text_proj", dm.text_proj, "text_proj")
        self.patch_size = dm.patch_size

    def forward(self, inputs):
        x, timestep, context = inputs
        b, _, h, w = x.shape
        p = self.patch_size
        hp, wp = h // p, w // p
        img = self.x_embedder(x)
        text = context
        if self.text_proj is not None and text.numel() > 0:
            text = self.text_proj(text)
        n_text = text.shape[1]
        hidden = torch.cat([img, text], dim=1)
        # ComfyUI's ids (as whole numbers): image patch (T, row, col), then text token (i, 0, 0).
        img_ids = torch.zeros(hp, wp, 3, dtype=torch.int64, device=x.device)
        img_ids[:, :, 0] = n_text
        img_ids[:, :, 1] = torch.arange(hp, device=x.device).unsqueeze(1)
        img_ids[:, :, 2] = torch.arange(wp, device=x.device).unsqueeze(0)
        text_ids = torch.zeros(n_text, 3, dtype=torch.int64, device=x.device)
        text_ids[:, 0] = torch.arange(n_text, device=x.device)
        ids = torch.cat([img_ids.view(hp * wp, 3), text_ids]).unsqueeze(0).repeat(b, 1, 1)
        c = self.time_embedding(self.time_proj(timestep).to(x.dtype))
        mod = self.adaLN_modulation(c)
        meta = torch.tensor([h, w], dtype=torch.int64, device=x.device)
        return hidden, c, mod, ids, meta


class ErnieBlock(StageLayer):
    """One shared-adaLN block over the image + text sequence."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.layers[index], f"layers.{index}")
        self.pos_embed = dm.pos_embed  # parameter-free
        self.last = last

    def forward(self, inputs):
        hidden, c, mod, ids, meta = inputs
        rotary = self.pos_embed(ids.float())
        temb = [t.unsqueeze(1).contiguous() for t in mod.chunk(6, dim=-1)]
        with OutOfPlaceResidualAdds(hidden):
            hidden = self.block(hidden, rotary, temb)
        if self.last:
            return hidden, c, meta
        return hidden, c, mod, ids, meta


class ErnieFinal(StageLayer):
    """``final_norm`` on the time embedding, ``final_linear``, the image tokens, un-patchify."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "final_norm", "final_linear")
        self.patch_size, self.out_channels = dm.patch_size, dm.out_channels

    def forward(self, inputs):
        hidden, c, meta = inputs
        h, w = int(meta[0]), int(meta[1])
        p, ch = self.patch_size, self.out_channels
        hp, wp = h // p, w // p
        hidden = self.final_norm(hidden, c).type_as(hidden)
        patches = self.final_linear(hidden)[:, :hp * wp, :]
        b = patches.shape[0]
        return patches.view(b, hp, wp, p, p, ch).permute(0, 5, 1, 3, 2, 4).contiguous().view(b, ch, h, w)


class ErnieImageAdapter:
    name = FAMILY
    options_type = NoOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        from ...patches.comfy_kitchen_rope_backward import enable_split_half_rope_backward

        dm = diffusion_model
        refuse_unsupported(self, dm)
        enable_split_half_rope_backward()  # ComfyUI's attention ropes through an op without a backward
        n = len(dm.layers)
        if n == 0:
            raise ValueError("This Ernie-Image model has no blocks; nothing to train.")
        return [ErnieEmbed(dm), *(ErnieBlock(dm, i, last=i == n - 1) for i in range(n)), ErnieFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([ErnieBlock.swappable] * len(diffusion_model.layers)), False]

    def lora_target_regex(self, preset: str) -> str:
        return _TARGETS[preset]

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(3072, 0)`` on Ernie-Image: Ministral-3 3B's states (read from ``text_proj``); no pooled vector."""
        dm = diffusion_model
        return int(dm.text_proj.in_features if dm.text_proj is not None else dm.hidden_size), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        p = int(diffusion_model.patch_size)
        h, w = latent_shape[-2:]
        return (int(h) // p) * (int(w) // p)

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("Ernie-Image needs the text encoder's states, and the cache has none: cache the dataset "
                             "with Ernie-Image's Ministral-3 3B text encoder.")
        return batch.noisy, batch.timestep, batch.cond

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut (see the module
        docstring: ComfyUI runs captions of different lengths separately; batch size 1 matches it exactly)."""
        return max(lengths)


ADAPTER = register(ErnieImageAdapter(), model_classes=("ErnieImage",))
