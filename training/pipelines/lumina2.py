"""Lumina Image 2.0 and Z-Image (``comfy.ldm.lumina.model.NextDiT``) as pipeline stage layers.

Stage tuples (``B`` batch, ``T`` caption tokens, ``N`` image tokens, both after pad tokens):

- embed: ``(x [B, C, H, W], timestep [B], context [B, T', cap_feat_dim])`` -> ``(cap, img, adaln, ids, meta)``
- each context refiner block (caption tokens only, no modulation), then each noise refiner block
  (image tokens only, modulated): the same tuple in and out
- the last refiner (or the embed, without refiners) joins ``cap`` and ``img`` into one sequence:
  ``(x [B, T+N, dim], adaln, ids, meta)``, the tuple of every main block
- final: ``(x, adaln, meta)`` -> the prediction, shaped like ``x``

This is ComfyUI's ``NextDiT._forward`` cut at its block boundaries (both hosts, no reference
latents): the network sees ``1 - timestep`` (Lumina's time runs from noise to image), times
``time_scale`` (1000 for Z-Image), and returns the negated output, which ComfyUI's flow
``model_sampling`` (CONST: the target is ``noise - x0``) expects. Z-Image pads captions and image
tokens to multiples of 32 with its learned pad tokens. Rotary positions cross stage boundaries as
int64 ids (caption token ``i`` is ``(i + 1, 0, 0)``, image patch ``(T + 1, row, col)``, image pad
tokens ``(0, 0, 0)``); every block recomputes its rotary embedding from them with the
parameter-free ``rope_embedder``, as ComfyUI computes it once. ``meta`` holds the latent height and
width and ``T`` (int64) for the final un-patchify and crop. Lumina's blocks add residuals out of
place; they still run under the out-of-place guard like every family's blocks.

Models: Lumina 2 (dim 2304, Gemma-2-2B text, shift 6) and Z-Image Turbo/Base (dim 3840, Qwen3-4B
text, shift 3; model class ``ZImage`` subclasses ``Lumina2``). Z-Image Omni (SigLIP image features)
trains here as text-to-image (its forward without reference latents is the plain one). Current
ComfyUI's NewBie (a pooled CLIP text vector) and the pixel-space Z-Image have other data flows and
are refused by name.

Text: ComfyUI hands Lumina's main blocks no text mask (current ComfyUI none at all), so shorter
captions of a micro-batch get zero tokens appended (:meth:`text_length`).

Fixture tier: detection pins full-size dims (Lumina 2 >= 422 M, Z-Image >= 899 M), so the tests
build tiny models in memory from ComfyUI's own ``Lumina2`` and ``ZImage`` config classes
(tests/family_rows/lumina2.py).
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

_BLOCKS = r"(layers|noise_refiner|context_refiner)\.\d+\."
_ATTENTION = r"attention\.(qkv|out)"
_MLP = r"feed_forward\.(w1|w2|w3)"
_MODULATION = r"adaLN_modulation\.[01]"  # Lumina 2: [SiLU, Linear]; Z-Image: [Linear]
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.lumina.model import NextDiT

    if not isinstance(dm, NextDiT):
        return f"{type(dm).__name__} is not a Lumina 2 / Z-Image model; the Lumina 2 adapter cannot train it."
    if type(dm) is not NextDiT:
        return (f"{type(dm).__name__} (e.g. the pixel-space Z-Image) has another output head, which PipeTrainer "
                "cannot train yet; Lumina 2 and Z-Image (Turbo, Base) are supported.")
    if getattr(dm, "clip_text_pooled_proj", None) is not None:
        return ("NewBie-style Lumina models (a pooled CLIP text vector in the time embedding) are not supported yet; "
                "Lumina 2 and Z-Image (Turbo, Base) are.")
    return None


def _patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, C, H, W]`` (padded) -> ``[B, H/p * W/p, p*p*C]`` in ComfyUI's patch order."""
    b, c, h, w = x.shape
    return x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)


class LuminaEmbed(StageLayer):
    """Time, caption and patch embeddings, pad tokens, rotary positions as ids."""

    def __init__(self, dm: nn.Module, join: bool):
        super().__init__()
        self.adopt_same(dm, "t_embedder", "cap_embedder", "x_embedder")
        self.pad_multiple = dm.pad_tokens_multiple
        if self.pad_multiple is not None:
            self.adopt_tensor("cap_pad_token", dm, "cap_pad_token")  # the model's own (frozen) Parameters
            self.adopt_tensor("x_pad_token", dm, "x_pad_token")
        self.patch_size = dm.patch_size
        self.time_scale = dm.time_scale
        self.join = join

    def _pad(self, tokens: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        extra = (-tokens.shape[1]) % self.pad_multiple
        pad = token.to(device=tokens.device, dtype=tokens.dtype).unsqueeze(0).repeat(tokens.shape[0], extra, 1)
        return torch.cat((tokens, pad), dim=1)

    def forward(self, inputs):
        import comfy.ldm.common_dit

        x, timestep, context = inputs
        batch, _, h, w = x.shape
        p = self.patch_size
        x = comfy.ldm.common_dit.pad_to_patch_size(x, (p, p))
        adaln = self.t_embedder((1.0 - timestep) * self.time_scale, dtype=x.dtype)
        cap = self.cap_embedder(context)
        if self.pad_multiple is not None:
            cap = self._pad(cap, self.cap_pad_token)
        img = self.x_embedder(_patchify(x, p))
        gh, gw = x.shape[-2] // p, x.shape[-1] // p
        n_cap = cap.shape[1]
        cap_ids = torch.zeros(batch, n_cap, 3, dtype=torch.int64, device=x.device)
        cap_ids[:, :, 0] = torch.arange(n_cap, device=x.device) + 1
        img_ids = torch.zeros(batch, gh * gw, 3, dtype=torch.int64, device=x.device)
        img_ids[:, :, 0] = n_cap + 1
        img_ids[:, :, 1] = torch.arange(gh, device=x.device).view(-1, 1).repeat(1, gw).flatten()
        img_ids[:, :, 2] = torch.arange(gw, device=x.device).view(1, -1).repeat(gh, 1).flatten()
        if self.pad_multiple is not None:
            img = self._pad(img, self.x_pad_token)
            img_ids = torch.nn.functional.pad(img_ids, (0, 0, 0, img.shape[1] - gh * gw))
        ids = torch.cat((cap_ids, img_ids), dim=1)
        meta = torch.tensor([h, w, n_cap], dtype=torch.int64, device=x.device)
        if self.join:
            return torch.cat((cap, img), dim=1), adaln, ids, meta
        return cap, img, adaln, ids, meta


def _freqs(rope_embedder: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``rope_embedder(positions).movedim(1, 2)`` from integer positions (exact as floats)."""
    return rope_embedder(ids.float()).movedim(1, 2)


class LuminaRefiner(StageLayer):
    """One refiner block: a context refiner over the caption tokens or a noise refiner over the image tokens."""

    swappable = True

    def __init__(self, dm: nn.Module, kind: str, index: int, join: bool):
        super().__init__()
        self.adopt("block", getattr(dm, kind)[index], f"{kind}.{index}")
        self.rope_embedder = dm.rope_embedder
        self.noise = kind == "noise_refiner"
        self.join = join

    def forward(self, inputs):
        cap, img, adaln, ids, meta = inputs
        n_cap = int(meta[2])
        if self.noise:
            freqs = _freqs(self.rope_embedder, ids[:, n_cap:])
            with OutOfPlaceResidualAdds(img):
                img = self.block(img, None, freqs, adaln, transformer_options={})
        else:
            freqs = _freqs(self.rope_embedder, ids[:, :n_cap])
            with OutOfPlaceResidualAdds(cap):
                cap = self.block(cap, None, freqs, transformer_options={})
        if self.join:
            return torch.cat((cap, img), dim=1), adaln, ids, meta
        return cap, img, adaln, ids, meta


class LuminaBlock(StageLayer):
    """One main transformer block over the joint caption + image sequence."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.layers[index], f"layers.{index}")
        self.rope_embedder = dm.rope_embedder
        self.last = last

    def forward(self, inputs):
        x, adaln, ids, meta = inputs
        freqs = _freqs(self.rope_embedder, ids)
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, None, freqs, adaln, transformer_options={})
        if self.last:
            return x, adaln, meta
        return x, adaln, ids, meta


class LuminaFinal(StageLayer):
    """Final modulated projection, un-patchify the image tokens, crop, negate (ComfyUI's ``return -x``)."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size = dm.patch_size
        self.out_channels = dm.out_channels

    def forward(self, inputs):
        x, adaln, meta = inputs
        h, w, n_cap = (int(v) for v in meta)
        p, c = self.patch_size, self.out_channels
        gh, gw = -(-h // p), -(-w // p)
        x = self.final_layer(x, adaln)[:, n_cap:n_cap + gh * gw]
        x = x.reshape(x.shape[0], gh, gw, p, p, c).permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3)
        return -x[:, :, :h, :w]


class Lumina2Adapter:
    name = "Lumina2"
    options_type = NoOptions
    distillation = Distillation(checkpoints="Z-Image Turbo")

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.layers)
        if n == 0:
            raise ValueError("This Lumina 2 / Z-Image model has no transformer layers; nothing to train.")
        refiners = [("context_refiner", i) for i in range(len(dm.context_refiner))]
        refiners += [("noise_refiner", i) for i in range(len(dm.noise_refiner))]
        return [
            LuminaEmbed(dm, join=not refiners),
            *(LuminaRefiner(dm, kind, i, join=k == len(refiners) - 1) for k, (kind, i) in enumerate(refiners)),
            *(LuminaBlock(dm, i, last=i == n - 1) for i in range(n)),
            LuminaFinal(dm),
        ]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        dm = diffusion_model
        blocks = len(dm.context_refiner) + len(dm.noise_refiner) + len(dm.layers)
        return [False, *([LuminaBlock.swappable] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"{_BLOCKS}({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(caption width, 0)``: Gemma-2-2B's 2304 for Lumina 2, Qwen3-4B's 2560 for Z-Image."""
        return int(diffusion_model.cap_embedder[1].in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the latent padded to the patch size (Z-Image's pad tokens carry no image)."""
        p = int(diffusion_model.patch_size)
        return math.prod(-(-s // p) for s in latent_shape[-2:])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        return batch.noisy, batch.timestep, batch.cond

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI encodes one caption at a time (no padding, so 0.3.75 passes no mask either) and current
        ComfyUI ignores Lumina's caption mask; zero tokens appended to the shorter captions of a batch
        take part in the attention as ComfyUI's unmasked batched conds do."""
        return max(lengths)


ADAPTER = register(Lumina2Adapter(), model_classes=("Lumina2",))
