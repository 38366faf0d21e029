"""Krea 2 (``comfy.ldm.krea2.model.SingleStreamDiT``, ``model_base.Krea2``) as pipeline stage layers.

Why a family of its own: Krea 2 is a single-stream DiT unlike any other here. Its text conditioning is
a stack of 12 Qwen3-VL-4B hidden layers (``[B, T, 12 x 2560]`` as ComfyUI carries it) fused inside the
model by a small transformer (``txtfusion``: two blocks across the layers of each token, a Linear over
the layers, two refiner blocks) and ``txtmlp``; text and image tokens then run joined through ``blocks``
(AdaLN modulation shared by every block from ``tproj``, grouped-query attention with a sigmoid gate,
SwiGLU MLP, 3-axis RoPE with text at position 0). No other family's layers fit.

Stage tuples (``B`` batch; ``T`` text tokens; ``N`` image patches; ``F`` the width):

- embed: ``(x [B, 16, 1, H, W], timestep [B], context [B, T, 12 x 2560])`` ->
  ``(cx [B, T+N, F], tvec [B, 1, 6F], t [B, 1, F], pos [B, T+N, 3] int64, meta)``: ComfyUI's own
  ``_unpack_context`` and ``process_img`` (pads odd sides), ``first``, the time MLP ``tmlp`` and ``tproj``,
  ``txtfusion`` and ``txtmlp``; text positions 0 as in ComfyUI's ``_forward``;
- each block but the last: the same tuple; every block recomputes the rotary table from ``pos`` with the
  parameter-free ``pe_embedder`` (whole-number positions, exact in int64), as ComfyUI computes it once;
  the last block drops what only blocks read: ``(cx, t, meta)``;
- final: ComfyUI's ``last`` (RMSNorm modulated by ``t``, Linear) over the joined sequence, the image
  tokens taken, un-patchified and cropped as ComfyUI's ``_forward`` does.

``meta`` (int64) holds the latent height and width and ``T``, ``N``. Qwen-Image's VAE (Wan 2.1 latent
format, ``latent_dimensions`` 3) makes 5-D latents ``[B, 16, 1, H, W]``: an image trains as one frame
(:class:`~.base.Geometry` ``video``); more frames are refused (ComfyUI's forward would fold frames into the
batch, which its text tokens cannot follow).

Loss. ``model_base.Krea2`` is ``ModelType.FLUX``: ComfyUI's ``ModelSamplingFlux`` with the config's shift
1.15 (a ModelSamplingFlux node before Train LoRA is replayed like on Flux) and the CONST target
``noise - x0``; training/objective takes both from the model. The model embeds the sigma itself
(multiplier 1; ``timestep_embedding`` scales by 1000).

Text: ComfyUI's Krea 2 text encoder (CLIPLoader type ``krea2``) drops its mask when a caption has no
padding (one caption per encode), so the model takes no text mask: the shorter captions of a micro-batch
get zero tokens appended (:meth:`Krea2Adapter.text_length`), which take part in attention as ComfyUI's
unmasked batched conds do.

Turbo. ComfyUI has one model class for Krea 2: nothing in the checkpoint tells the Turbo (few-step,
distilled) weights from others, so they train like any Krea 2 model. A LoRA trained naively on a distilled
checkpoint (this trainer's plain flow-matching loss over the model's full sigma range) can lose the
checkpoint's few-step behaviour. The family declares Krea 2 Turbo as distilled (``distillation``): the Training
Adapter node merges a de-distillation LoRA while training and leaves it out of the saved LoRA, which keeps the
few-step sampling (training/pipelines/distillation.py).

Reference latents: ComfyUI's detection sets no reference method for Krea 2, so its forward ignores
``ref_latents`` unless a conditioning node sets one (its style-reference template uses
``index_timestep_zero``). This family trains text-to-image only; no references are taken from the cache.

Refused by name: a ``SingleStreamDiT`` whose patchified input width is not ``channels x patch^2`` (another
input layout than ComfyUI's forward reads), or with no blocks.

Fixture tier: detection pins head size 128 and 12 x 2560-wide text (billions of parameters), so the tests
build a tiny model in memory from ComfyUI's own ``Krea2`` config class (tests/family_rows/krea2.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .distillation import Distillation
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "Krea2"
_NAMED = 20  # sources named in a preflight problem; the rest are counted
_ATTENTION = r"attn\.(wq|wk|wv|gate|wo)"
_MLP = r"mlp\.(gate|up|down)"
_SHARED_MODULATION = r"tproj\.1"  # the AdaLN projection every block reads (embed stage)
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.krea2.model import SingleStreamDiT

    if not isinstance(dm, SingleStreamDiT):
        return f"{type(dm).__name__} is not a Krea 2 SingleStreamDiT; the {FAMILY} adapter cannot train it."
    if dm.first.in_features != dm.channels * dm.patch**2:
        return (f"This Krea 2 model takes {dm.first.in_features} input features for {dm.channels} latent channels "
                "(image or control channels concatenated to the latent), which this adapter does not build.")
    if len(dm.blocks) == 0:
        return "This Krea 2 model has no transformer blocks; nothing to train."
    return None


class Krea2Embed(StageLayer):
    """Unpack the 12-layer text stack, fuse it, patchify and embed the latent, time embeddings, positions."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "first", "tmlp", "tproj", "txtfusion", "txtmlp")
        # read by ComfyUI's own process_img / _unpack_context, reused below
        self.patch, self.txtlayers, self.txtdim, self.tdim = dm.patch, dm.txtlayers, dm.txtdim, dm.tdim
        self._process_img = type(dm).process_img
        self._unpack_context = type(dm)._unpack_context

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding

        x, timestep, context = inputs
        if x.ndim == 5:
            if x.shape[2] != 1:
                raise ValueError(f"Krea 2 trains on image latents [B, C, 1, H, W]; got {list(x.shape)}. "
                                 "Cache images (not videos) with Krea 2's VAE (Qwen-Image's).")
            x = x[:, :, 0]
        h, w = x.shape[-2:]
        context = self._unpack_context(self, context)
        img, imgpos, _, _ = self._process_img(self, x)
        img_tokens = img.shape[1]
        img = self.first(img)
        t = self.tmlp(timestep_embedding(timestep, self.tdim).unsqueeze(1).to(img.dtype))
        tvec = self.tproj(t)
        context = self.txtmlp(self.txtfusion(context, mask=None, transformer_options={}))
        txtlen = context.shape[1]
        txtpos = torch.zeros(x.shape[0], txtlen, 3, device=x.device, dtype=torch.float32)
        pos = torch.cat((txtpos, imgpos), dim=1)
        positions = pos.round().to(torch.int64)
        if not torch.equal(positions.to(pos.dtype), pos):
            raise ValueError("Krea 2 token positions are not whole numbers; rotary scaling is not supported in training.")
        meta = torch.tensor([h, w, txtlen, img_tokens], dtype=torch.int64, device=x.device)
        return torch.cat((context, img), dim=1), tvec, t, positions, meta


class Krea2Block(StageLayer):
    """One single-stream block over the joined text and image tokens; the last drops what only blocks read."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        self.pe_embedder = dm.pe_embedder  # parameter-free
        self.last = last

    def forward(self, inputs):
        cx, tvec, t, pos, meta = inputs
        freqs = self.pe_embedder(pos.float())
        with OutOfPlaceResidualAdds(cx):
            cx = self.block(cx, tvec, freqs, None, timestep_zero_index=None, transformer_options={})
        if self.last:
            return cx, t, meta
        return cx, tvec, t, pos, meta


class Krea2Final(StageLayer):
    """ComfyUI's ``last`` over the joined sequence, the image tokens un-patchified and cropped."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("last_layer", dm.last, "last")
        self.patch, self.channels = dm.patch, dm.channels

    def forward(self, inputs):
        cx, t, meta = inputs
        h, w, txtlen, img_tokens = (int(v) for v in meta)
        out = self.last_layer(cx, t)[:, txtlen:txtlen + img_tokens]
        p, c = self.patch, self.channels
        gh, gw = -(-h // p), -(-w // p)
        out = out.reshape(out.shape[0], gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(out.shape[0], c, gh * p, gw * p)
        return out[:, :, :h, :w].unsqueeze(2)


class Krea2Adapter:
    name = FAMILY
    options_type = NoOptions
    distillation = Distillation(checkpoints="Krea 2 Turbo")

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.blocks)
        return [Krea2Embed(dm), *(Krea2Block(dm, i, last=i == n - 1) for i in range(n)), Krea2Final(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([Krea2Block.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        regex = rf"blocks\.\d+\.({_TARGETS[preset]})"
        return rf"{regex}|{_SHARED_MODULATION}" if preset == "all_linear" else regex

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch)
        return Geometry(patch=(1, p, p), video=True)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(12 x 2560, 0)`` on Krea 2: the flattened Qwen3-VL layer stack ComfyUI's text encoder hands over."""
        return int(diffusion_model.txtlayers) * int(diffusion_model.txtdim), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        p = int(diffusion_model.patch)
        return math.prod(-(-int(s) // p) for s in latent_shape[-2:])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("Krea 2 needs the text encoder's states, and the cache has none: cache the dataset "
                             "with Krea 2's text encoder (CLIPLoader type krea2).")
        return batch.noisy, batch.timestep, batch.cond

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def preflight_problems(self, diffusion_model: nn.Module, facts) -> list[str]:
        """Video latents (more than one frame), which the embed layer would refuse only once training runs."""
        videos = sorted(source for source, shape in facts.latents.items() if len(shape) == 4 and shape[1] > 1)
        if not videos:
            return []
        shown = ", ".join(videos[:_NAMED]) + (f" and {len(videos) - _NAMED} more" if len(videos) > _NAMED else "")
        return [f"Krea 2 trains on images (one latent frame), and the cache holds videos: {shown}. Remove them from "
                "the dataset (or set max_frames to 1 on the Dataset node to train their first frame) and cache again."]

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut."""
        return max(lengths)


ADAPTER = register(Krea2Adapter(), model_classes=("Krea2",))
