"""LTX-Video (``comfy.ldm.lightricks.model.LTXVModel``, ComfyUI model class ``LTXV``) as pipeline stage layers.

Stage tuples (``B`` batch, ``N`` video tokens, ``T`` text tokens, ``D`` hidden width):

- embed: ``(x [B, 128, F, H, W], timestep [B] or [B, N, 1], context [B, T, 4096], text_mask, rate)``
  -> ``(x, context, t_mod, t_emb, text_mask, sizes)``
- each transformer block but the last: the same tuple in and out; the last gives ``(x, t_emb, sizes)``
- head: ``(x, t_emb, sizes)`` -> the prediction, shaped like ``x``

``t_mod`` ``[B, 1 or N, 6 D]`` is the timestep modulation every block reads (``adaln_single``'s
projection), ``t_emb`` ``[B, 1 or N, D]`` the timestep embedding the head modulates with; it passes
through the blocks unchanged. ``text_mask`` is the int64 text attention mask (``[B, 0]`` when there is
none: ComfyUI then passes no mask); each block rebuilds the additive mask as ComfyUI's forward does.
``sizes`` is int64 ``(F, H, W, frame rate)``: the rotary embedding has no gradient, so it may not cross
a stage boundary as a float tensor; each block recomputes it from the latent grid with ComfyUI's own
code (the patchifier's coordinates, ``latent_to_pixel_coords`` with the VAE's scale factors, the rotary
frequencies of the ComfyUI version), as ComfyUI's forward does once. The frame rate scales the
temporal positions; it travels as the bit pattern of its float64 value (``rate``), so the positions
equal ComfyUI's for any rate, as the ``frame_rate`` that ``LTXVConditioning`` sets (family option
``frame_rate``, default ComfyUI's 25).

LTX-Video's blocks update the residual stream in place, partly as statements that rebind nothing
(``x.addcmul_(y, gate)``): each block runs on its own copy of the residual under the guard of
:mod:`.out_of_place` in its ``private`` mode (in-place ops on the copy run as written, every other use
of it sees a snapshot), so ComfyUI's block code runs unchanged and no tensor autograd saved is modified.

First-frame conditioning (family option ``first_frame_clean``): image-to-video as ComfyUI samples
after ``LTXVImgToVideo``: its noise mask is 0 on the first latent frame, so the sampler keeps the clean
latent there (``LTXV.scale_latent_inpaint`` keeps it unscaled; flow models' ``calculate_input`` is the
identity) and ``LTXV.process_timestep`` gives every token the timestep times its mask, 0 on the first
frame's tokens; the loss leaves that frame out. A 1-frame example (an image) trains as text-to-image.

Versions: ComfyUI 0.3.75 and current ComfyUI (whose LTX code has a shared ``LTXBaseModel``). The
layers call the version's own methods where it has them (rotary embedding, output modulation), so
each follows its ComfyUI's forward. LTX-2 (``LTXAVModel``, audio and video, class ``LTXAV``) is the
family of training/pipelines/ltx2.py; refused here by name: LTX models with cross-attention AdaLN or a
text connector (LTX-2 layouts).

Fixture tier (devkit/fixtures_ltxv.py ``build_tiny_ltxv``): a detected file on 0.3.75 and current
ComfyUI, hidden 64 (32 heads pinned by detection), 2 blocks, 128 latent channels, text width 4096:
0.46 M parameters. Clips have 1 or 8k+1 pixel frames (the LTX-Video VAE's temporal step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .out_of_place import OutOfPlaceResidualAdds

_ATTENTION = r"attn[12]\.(to_q|to_k|to_v|to_out\.0)"
_MLP = r"ff\.net\.(0\.proj|2)"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    # An LTX-Video block has no other Linear (its modulation is a parameter table): all_linear = attention_mlp.
    "all_linear": rf"{_ATTENTION}|{_MLP}",
}
TEXT_MASK = "attention_mask"
FRAME_STEP = 8  # the LTX-Video VAE: 8 pixel frames per latent frame after the first
DEFAULT_FRAME_RATE = 25.0  # LTXV.extra_conds' default (and LTXVConditioning's)

_RELATIVES = {"LTXAVModel": "LTX-2 audio-video (LTXAV)"}


@dataclass(frozen=True)
class LTXVOptions:
    """LTX-Video training options.

    ``frame_rate``: the clips' frames per second, as ``LTXVConditioning`` gives it at sampling; it scales
    the temporal rotary positions (ComfyUI's default 25). ``first_frame_clean``: image-to-video as
    ``LTXVImgToVideo`` samples it (see the module docstring).
    """

    frame_rate: float = DEFAULT_FRAME_RATE
    first_frame_clean: bool = False

    def problems(self) -> list[str]:
        if not 0.0 < self.frame_rate <= 1000.0:
            return [f"frame_rate must be between 0 and 1000 frames per second (got {self.frame_rate})."]
        return []


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.lightricks.model import LTXVModel

    if not isinstance(dm, LTXVModel):
        return f"{type(dm).__name__} is not an LTX-Video model; the LTX-Video adapter cannot train it."
    if type(dm) is not LTXVModel:
        name = _RELATIVES.get(type(dm).__name__, type(dm).__name__)
        return (f"{name} models are not supported yet: their blocks take extra streams the LTX-Video adapter "
                "does not feed. LTX-Video (0.9.x) models are supported.")
    if getattr(dm, "cross_attention_adaln", False) or getattr(dm, "caption_proj_before_connector", False):
        return ("LTX models with cross-attention AdaLN or a text connector (LTX-2 layouts) are not supported yet; "
                "LTX-Video (0.9.x) models are.")
    return None


def _pixel_coords(positions, sizes: torch.Tensor, batch: int, device) -> tuple[torch.Tensor, float]:
    """ComfyUI's pixel coordinates of the latent grid ``sizes`` and the frame rate, as its forward makes them."""
    from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

    f, h, w = (int(v) for v in sizes[:3])
    rate = float(sizes[3:4].view(torch.float64).item())
    coords = positions.patchifier.get_latent_coords(f, h, w, batch, device)
    return latent_to_pixel_coords(coords, positions.vae_scale_factors, causal_fix=positions.causal), rate


class _Positions:
    """The rotary embedding of one latent grid, by the ComfyUI version's own code (no parameters).

    Current ComfyUI computes it in ``LTXBaseModel._prepare_positional_embeddings`` (which reads the
    model's rotary configuration); 0.3.75 in the module function ``precompute_freqs_cis``."""

    def __init__(self, dm: nn.Module):
        self.patchifier = dm.patchifier
        self.vae_scale_factors = dm.vae_scale_factors
        self.causal = bool(dm.causal_temporal_positioning)
        self.inner_dim = int(dm.inner_dim)
        self._prepare = getattr(dm, "_prepare_positional_embeddings", None)  # a bound method of the model

    def pe(self, sizes: torch.Tensor, batch: int, dtype: torch.dtype, device):
        pixel_coords, rate = _pixel_coords(self, sizes, batch, device)
        if self._prepare is not None:
            return self._prepare(pixel_coords, rate, dtype)
        from comfy.ldm.lightricks.model import precompute_freqs_cis

        fractional = pixel_coords.to(torch.float32)
        fractional[:, 0] = fractional[:, 0] * (1.0 / rate)
        return precompute_freqs_cis(fractional, dim=self.inner_dim, out_dtype=dtype)


def additive_text_mask(text_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive cross-attention mask ComfyUI's forward makes of an integer text mask (None: no mask)."""
    if text_mask.numel() == 0:
        return None
    b, t = text_mask.shape
    return (text_mask - 1).to(dtype).reshape(b, 1, -1, t) * torch.finfo(dtype).max


class LTXVEmbed(StageLayer):
    """Token projection of the latent, timestep embedding and modulation, caption projection."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "patchify_proj", "adaln_single", "caption_projection")
        self.patchifier = dm.patchifier
        self.inner_dim = int(dm.inner_dim)
        self.timestep_scale = float(getattr(dm, "timestep_scale_multiplier", 1000.0))  # 0.3.75: fixed 1000

    def forward(self, inputs):
        x, t, context, text_mask, rate = inputs
        b = x.shape[0]
        sizes = torch.cat([torch.tensor(list(x.shape[-3:]), dtype=torch.int64, device=x.device), rate.to(x.device)])
        dtype = x.dtype
        x, _ = self.patchifier.patchify(x)
        x = self.patchify_proj(x)
        t_mod, t_emb = self.adaln_single((t * self.timestep_scale).flatten(), {"resolution": None, "aspect_ratio": None},
                                         batch_size=b, hidden_dtype=dtype)
        t_mod = t_mod.view(b, -1, t_mod.shape[-1])
        t_emb = t_emb.view(b, -1, t_emb.shape[-1])
        context = self.caption_projection(context).view(b, -1, self.inner_dim)
        return x, context, t_mod, t_emb, text_mask, sizes


class LTXVBlock(StageLayer):
    """One transformer block (self-attention with RoPE, text cross-attention, feed-forward)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.transformer_blocks[index], f"transformer_blocks.{index}")
        self.positions = _Positions(dm)
        self.last = last

    def forward(self, inputs):
        x, context, t_mod, t_emb, text_mask, sizes = inputs
        pe = self.positions.pe(sizes, x.shape[0], x.dtype, x.device)
        residual = x.clone()  # the block updates it in place (x.addcmul_): never the stage's input
        with OutOfPlaceResidualAdds(residual, private=True):
            x = self.block(residual, context=context, attention_mask=additive_text_mask(text_mask, x.dtype), timestep=t_mod,
                           pe=pe, transformer_options={})
        if self.last:
            return x, t_emb, sizes
        return x, context, t_mod, t_emb, text_mask, sizes


class LTXVHead(StageLayer):
    """Final modulation and projection, then ComfyUI's un-patchify to the latent's shape."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "norm_out", "proj_out")
        self.adopt_tensor("scale_shift_table", dm, "scale_shift_table")  # the model's own (frozen, no LoRA)
        self.patchifier = dm.patchifier
        self.out_channels = int(dm.out_channels)
        # Current ComfyUI's own output step (it modulates as x * (1 + scale) + shift); 0.3.75 has none.
        self._process_output = getattr(type(dm), "_process_output", None)

    def forward(self, inputs):
        x, t_emb, sizes = inputs
        f, h, w = (int(v) for v in sizes[:3])
        shape = [x.shape[0], self.out_channels, f, h, w]
        if self._process_output is not None:
            return self._process_output(self, x, t_emb, None, orig_shape=shape)
        table = self.scale_shift_table[None, None].to(device=x.device, dtype=x.dtype) + t_emb[:, :, None]
        shift, scale = table[:, :, 0], table[:, :, 1]
        x = self.norm_out(x)
        x = torch.addcmul(x, x, scale).add_(shift)  # 0.3.75's LTXVModel._forward, written the same way
        x = self.proj_out(x)
        return self.patchifier.unpatchify(latents=x, output_height=h, output_width=w, output_num_frames=f,
                                          out_channels=self.out_channels)


def frame_rate_bits(frame_rate: float) -> torch.Tensor:
    """``[1]`` int64: the float64 frame rate's bit pattern (integer tensors may cross stage boundaries)."""
    return torch.tensor([float(frame_rate)], dtype=torch.float64).view(torch.int64)


def clean_first_frame_tokens(noisy: torch.Tensor, clean: torch.Tensor,
                             timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(network input, per-token timestep [B, N, 1])`` with the first latent frame clean.

    What ComfyUI samples with ``LTXVImgToVideo``'s noise mask (0 on the first latent frame): the clean
    latent in that frame, and ``LTXV.process_timestep``'s per-token timestep (the timestep times the
    mask, patchified), so 0 on the first frame's tokens."""
    b, _, f, h, w = noisy.shape
    x = torch.cat([clean[:, :, :1].to(noisy.dtype), noisy[:, :, 1:]], dim=2)
    per_frame = timestep.float().view(b, 1).expand(b, f).clone()
    per_frame[:, 0] = 0.0
    t = per_frame[:, :, None, None].expand(b, f, h, w).reshape(b, f * h * w, 1)
    return x, t


class LTXVAdapter:
    name = "LTXV"
    options_type = LTXVOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.transformer_blocks)
        if n == 0:
            raise ValueError("This LTX-Video model has no transformer blocks; nothing to train.")
        return [LTXVEmbed(dm), *(LTXVBlock(dm, i, last=i == n - 1) for i in range(n)), LTXVHead(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([LTXVBlock.swappable] * len(diffusion_model.transformer_blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"transformer_blocks\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        pt, ph, pw = (int(p) for p in diffusion_model.patchifier.patch_size)
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=FRAME_STEP)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(text width, 0)``: T5-XXL's 4096 (the caption projection's input); no pooled vector."""
        dm = diffusion_model
        width = getattr(dm, "caption_channels", None)  # current ComfyUI; 0.3.75 keeps only the Linear
        return int(width if width is not None else dm.caption_projection.linear_1.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {TEXT_MASK: ExtraSpec(shape=("T",), source="text", required=False, follows_text=True,
                                     description="the text attention mask of the T5 encoder")}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        patch = diffusion_model.patchifier.patch_size
        return math.prod(-(-s // int(p)) for s, p in zip(sizes, patch, strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        options = batch.options if isinstance(batch.options, LTXVOptions) else LTXVOptions()
        x, t = batch.noisy, batch.timestep
        if options.first_frame_clean and x.shape[2] > 1:
            if batch.clean is None:
                raise ValueError("first_frame_clean needs the clean latent in the batch.")
            x, t = clean_first_frame_tokens(x, batch.clean, t)
        mask = batch.extras.get(TEXT_MASK)
        mask = mask.to(torch.int64) if mask is not None else torch.zeros(x.shape[0], 0, dtype=torch.int64)
        return x, t, batch.cond, mask, frame_rate_bits(options.frame_rate)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        """With ``first_frame_clean``, 0 on the first latent frame (it is given, not predicted)."""
        if not (isinstance(options, LTXVOptions) and options.first_frame_clean):
            return None
        if len(latent_shape) != 4 or latent_shape[1] < 2:
            return None  # an image: trains as text-to-image
        mask = torch.ones(1, latent_shape[1], 1, 1)
        mask[:, 0] = 0.0
        return mask

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, masked when a mask is cached.

        ComfyUI's LTX-Video T5 tokenizer pads every caption to at least 128 tokens, and its encoder
        returns the attention mask with the cond, which ComfyUI hands to the model: with the mask
        cached (extra ``attention_mask``) the padding is masked as in sampling; without it the padded
        tokens take part in the attention."""
        return max(lengths)

    def run_metadata(self, diffusion_model: nn.Module, options: object) -> dict[str, str]:
        """LoRA file metadata of this run's options (the frame rate trained at, a clean first frame)."""
        if not isinstance(options, LTXVOptions):
            return {}
        out = {"ltxv.frame_rate": repr(options.frame_rate)}
        if options.first_frame_clean:
            out["ltxv.first_frame_clean"] = "true"
        return out


# LTXAV (LTX-2, a subclass of LTXV) is its own family: training/pipelines/ltx2.py registers it.
ADAPTER = register(LTXVAdapter(), model_classes=("LTXV",))
