"""PixArt Sigma and PixArt Alpha (``comfy.ldm.pixart.pixartms.PixArtMS``, ``model_base.PixArt``) as pipeline stage layers.

Why a family of its own: PixArt is a DiT with cross-attention to T5-XXL text (4096 wide), one shared
adaLN-single modulation (``t_block``) that every block adds to its own ``scale_shift_table``, a sin-cos
position embedding computed per resolution, and an eps-prediction head with learned sigma. No other
family has that data flow.

Stage tuples (``B`` batch, ``T`` text tokens, ``N`` image patches):

- embed: ``(x [B, 4, H, W], timestep [B], context [B, T, 4096])`` -> ``(x [B, N, D], y [B, T, D], t, t0, meta)``:
  ``x_embedder`` plus the sin-cos table ComfyUI's ``forward_orig`` computes for this latent size
  (``pe_interpolation`` / ``base_size`` as it derives them), the time embedding ``t`` (PixArt Alpha: plus
  its size and aspect-ratio micro-conditions), ``t0 = t_block(t)``, and the caption through
  ``y_embedder`` as ComfyUI calls it at sampling (``train=False``: no caption dropout inside the model);
- each block: the same tuple (the last one drops ``y`` and ``t0``: ``(x, t, meta)``); ComfyUI flattens the
  batch's captions to one ``[1, B*T, D]`` sequence before its blocks, and each block's cross-attention
  splits it per example again; the layer hands the block that same flattened view;
- final: ``T2IFinalLayer`` on ``t``, un-patchify, and the first 4 of the 8 output channels.

Learned sigma. PixArt predicts eps and a variance (``pred_sigma``: 8 output channels). ComfyUI's
``PixArtMS.forward`` returns only ``out[:, :in_channels]``, the eps that ComfyUI's sampler turns into the
denoised latent (``model_base.PixArt`` is ``ModelType.EPS``: ``ModelSamplingDiscrete``, 1000 steps of the
config's ``sqrt_linear`` schedule). The final layer keeps the same channels, so the loss is ComfyUI's eps
target on exactly the output ComfyUI samples with; the variance half gets no gradient (the LoRA presets
target the blocks, which feed both halves, and training/objective takes target and sigmas from the
model's own ``model_sampling``).

Micro-conditions (PixArt Alpha only: ``micro_condition``). ComfyUI's ``PixArt.extra_conds`` feeds
``c_size = [[height, width]]`` and ``c_ar = [[height / width]]`` from the sampled latent's size x 8 unless
the conditioning sets a width and height; the embed computes the same from the training latent (a
resolution of its own, as the latent is). PixArt Sigma has none.

Latents must be whole multiples of the patch (2): ComfyUI's position table and un-patchify take
``H // 2`` and ``W // 2`` patches, so odd sides fail in ComfyUI itself; preflight refuses them first.

Text: ComfyUI's PixArt T5 tokenizer does not pad (``min_length`` 1) and the model takes no text mask
(ComfyUI's cross-attention asserts ``mask is None``), so ComfyUI never batches captions of different lengths
together. With ``batch_size`` 1 training sees exactly that; in a larger micro-batch the shorter captions get
zero tokens appended (:meth:`PixArtAdapter.text_length`), which take part in the cross-attention.

Refused by name: diffusion models of the PixArt class that are not ``PixArtMS`` (none in ComfyUI today).
KV-compressed attention (``sr_ratio`` > 1) runs as ComfyUI runs it (the block gets ``(H, W)``), though
ComfyUI's detection never builds it.

Fixture tier: detection pins hidden size 1152 (about 21 M parameters per block and 12 M in the embedders),
so the tests build tiny models in memory from ComfyUI's own ``PixArtSigma`` and ``PixArtAlpha`` config
classes (tests/family_rows/pixart.py, 0.12 / 0.13 M parameters); tests/test_stage_split.py trains them 2
steps in 1 and 2 pipeline stages on gloo ranks (bitwise equal in fp32), and the slow tier loads a detected
1-block PixArt Sigma file (38 M parameters) through ComfyUI's stock loader (tests/test_real_size.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "PixArt"
_BLOCKS = r"blocks\.\d+\."
_ATTENTION = r"(attn\.(qkv|proj)|cross_attn\.(q_linear|kv_linear|proj))"
_MLP = r"mlp\.fc[12]"
_TARGETS = {
    "attention": rf"{_BLOCKS}{_ATTENTION}",
    "attention_mlp": rf"{_BLOCKS}({_ATTENTION}|{_MLP})",
    # PixArt's blocks hold no modulation Linear: all of them share ``t_block`` (adaLN-single).
    "all_linear": rf"{_BLOCKS}({_ATTENTION}|{_MLP})|t_block\.1",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.pixart.pixartms import PixArtMS

    if type(dm) is not PixArtMS:
        return (f"{type(dm).__name__} is not ComfyUI's PixArtMS; the {FAMILY} adapter cannot train it. "
                "PixArt Sigma and PixArt Alpha are supported.")
    return None


class PixArtEmbed(StageLayer):
    """Patch and position embedding, time embedding (with Alpha's micro-conditions), ``t_block``, caption."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "x_embedder", "t_embedder", "t_block", "y_embedder")
        self.micro_conditioning = dm.micro_conditioning
        if self.micro_conditioning:
            self.adopt_same(dm, "csize_embedder", "ar_embedder")
        self.patch_size, self.hidden_size = dm.patch_size, dm.hidden_size
        self.pe_interpolation, self.pe_precision = dm.pe_interpolation, dm.pe_precision

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """The sin-cos table of ``PixArtMS.forward_orig`` for this latent size (its formulas, its order)."""
        from comfy.ldm.pixart.pixartms import get_2d_sincos_pos_embed_torch

        _, _, h, w = x.shape
        c_res = (h + w) // 2
        pe_interpolation = self.pe_interpolation
        if pe_interpolation is None or self.pe_precision is not None:
            pe_interpolation = round(c_res / (512 / 8.0), self.pe_precision or 0)
        return get_2d_sincos_pos_embed_torch(
            self.hidden_size, h=h // self.patch_size, w=w // self.patch_size, pe_interpolation=pe_interpolation,
            base_size=(round(c_res / 64) * 64) // self.patch_size, device=x.device, dtype=x.dtype,
        ).unsqueeze(0)

    def forward(self, inputs):
        x, timestep, context = inputs
        b, _, h, w = x.shape
        tokens = self.x_embedder(x) + self._pos_embed(x)
        t = self.t_embedder(timestep, tokens.dtype)
        if self.micro_conditioning:  # ComfyUI's extra_conds from the latent's size: [[height, width]], [[h / w]]
            c_size = torch.tensor([h * 8, w * 8], dtype=x.dtype, device=x.device).repeat(b, 1)
            c_ar = torch.tensor([h / w], dtype=x.dtype, device=x.device).repeat(b, 1)
            t = t + torch.cat([self.csize_embedder(c_size, b), self.ar_embedder(c_ar, b)], dim=1)
        t0 = self.t_block(t)
        y = self.y_embedder(context.unsqueeze(1), False).squeeze(1)
        meta = torch.tensor([h, w], dtype=torch.int64, device=x.device)
        return tokens, y, t, t0, meta


class PixArtBlock(StageLayer):
    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        self.last = last

    def forward(self, inputs):
        x, y, t, t0, meta = inputs
        hw = (int(meta[0]), int(meta[1]))
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, y.reshape(1, -1, x.shape[-1]), t0, None, hw)
        if self.last:
            return x, t, meta
        return x, y, t, t0, meta


class PixArtFinal(StageLayer):
    """``T2IFinalLayer``, un-patchify, and the eps channels (ComfyUI's ``out[:, :in_channels]``)."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size, self.out_channels, self.in_channels = dm.patch_size, dm.out_channels, dm.in_channels
        self.pred_sigma = dm.pred_sigma

    def forward(self, inputs):
        x, t, meta = inputs
        p, c = self.patch_size, self.out_channels
        gh, gw = int(meta[0]) // p, int(meta[1]) // p
        x = self.final_layer(x, t)
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], gh, gw, p, p, c)).reshape(x.shape[0], c, gh * p, gw * p)
        return x[:, :self.in_channels] if self.pred_sigma else x


class PixArtAdapter:
    name = FAMILY
    options_type = NoOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.blocks)
        if n == 0:
            raise ValueError("This PixArt model has no blocks; nothing to train.")
        return [PixArtEmbed(dm), *(PixArtBlock(dm, i, last=i == n - 1) for i in range(n)), PixArtFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([PixArtBlock.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return _TARGETS[preset]

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(4096, 0)`` on PixArt: T5-XXL's states (read from the caption projection); no pooled vector."""
        return int(diffusion_model.y_embedder.y_proj.fc1.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        p = int(diffusion_model.patch_size)
        h, w = latent_shape[-2:]
        return (int(h) // p) * (int(w) // p)

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("PixArt needs the text encoder's states, and the cache has none: cache the dataset "
                             "with PixArt's T5-XXL text encoder (CLIPLoader type pixart).")
        return batch.noisy, batch.timestep, batch.cond

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut (see the module
        docstring: ComfyUI runs captions of different lengths separately; batch size 1 matches it exactly)."""
        return max(lengths)


ADAPTER = register(PixArtAdapter(), model_classes=("PixArt",))
