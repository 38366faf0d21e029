"""Cosmos Predict2 text-to-image, text-to-video and Video2World image-to-video
(``comfy.ldm.cosmos.predict2.MiniTrainDIT``, ``model_base.CosmosPredict2``) as pipeline stage layers; Anima
(training/pipelines/anima.py) reuses them.

Why a family of its own: MiniTrainDIT is a video DiT over ``[B, T, H, W, D]`` token grids with 3-D RoPE, a
padding-mask channel concatenated to the latent, adaLN modulation per block (self-attention, cross-attention
to T5 text, MLP), optionally "AdaLN-LoRA" (a shared low-rank modulation from the time embedder added to every
block's), and a rectified-flow sampling of its own (below). No other family has that data flow.

Stage tuples (``B`` batch, ``T'``/``H'``/``W'`` patches, ``D`` width, ``N`` text tokens):

- embed: ``(x [B, 16, T, H, W], timestep [B], context [B, N, 1024], clean [B, T] int64)`` ->
  ``(x [B, T', H', W', D], t [B, 1, D], adaln [B, 1, 3D] or empty, context, rope, [extra_pos,] meta)`` (``T``
  for the 1 of ``t`` and ``adaln`` when a frame is clean: one timestep per latent frame, below):
  ComfyUI's ``pad_to_patch_size`` and ``prepare_embedded_sequence`` (its own method: padding-mask channel of
  zeros, as ComfyUI passes none, ``x_embedder``, the RoPE table, the learnable per-block position table where
  the model has one), the time embedding as ``_forward`` computes it (``t_embedder``, ``t_embedding_norm``),
  the residual stream in fp32 when the compute dtype is fp16 where ComfyUI keeps it so (current ComfyUI, not
  0.3.75: :func:`comfy_keeps_fp32_residual`); ``meta`` (int64) the
  latent's frames, height and width;
- each block: the same tuple (the last drops ``context``, ``rope`` and ``extra_pos``, which the final layer
  does not read: ``(x, t, adaln, meta)``);
- final: ``final_layer`` (in the compute dtype, as ComfyUI casts to the text's dtype), ComfyUI's own
  ``unpatchify``, crop to the latent's size.

This is ComfyUI's ``MiniTrainDIT._forward`` cut at its block boundaries, with ``fps`` None (what
``CosmosPredict2.extra_conds`` hands the model unless the conditioning sets a frame rate; current detection
turns the RoPE fps modulation off anyway). Blocks add residuals with ``torch.addcmul`` (out of place); they still
run under the out-of-place guard like every family's blocks.

Loss. ``model_base.CosmosPredict2`` is ``ModelType.FLOW_COSMOS``: ComfyUI's ``ModelSamplingCosmosRFlow`` with
``COSMOS_RFLOW``. Sigmas are EDM's (0.002 to 80, noised ``x0 + sigma * noise``); the network sees that scaled to
the rectified-flow point ``t = sigma / (sigma + 1)`` and gets ``t`` as its timestep, and ComfyUI denoises its
output as a velocity, so the target is ``noise - x0`` (training/objective/loss.py, kind ``rflow``). The default
noise levels are the model's own table (``sigmas``, log-spaced, the one ComfyUI's ``simple`` scheduler walks:
training/objective/timesteps.py). The flow-only Timestep Sampling settings (shift none / fixed / resolution,
sigma bounds in [0, 1], loss weightings) are refused by preflight, as on eps and v models.

Text: T5-XXL v1.1 states (1024 wide, CLIPLoader ``cosmos``), padded by ComfyUI's tokenizer to 512 tokens with
zeroed states (``zero_out_masked``); the model takes no text mask, so a longer caption gives the others of its
micro-batch zero tokens (:meth:`CosmosPredict2Adapter.text_length`), as ComfyUI's zeroed pads already are. The
cached attention mask is not read: ComfyUI's model does not read it either.

Video latents train as ComfyUI runs the model on them (it is a video DiT; images are 1-frame videos, as
ComfyUI's samplers make a 4-D latent 5-D for it).

Video2World / image-to-video (``CosmosI2VPredict2``: ``in_channels`` 17, ``model_base.CosmosPredict2`` with
``image_to_video``). ComfyUI's ``CosmosPredict2ImageToVideoLatent`` gives the sampler the start image's latent
in the first latent frame and a noise mask that is 0 there. The sampler then (``KSamplerX0Inpaint`` with
``CosmosPredict2.scale_latent_inpaint``, undone by ``calculate_input``) hands the network the clean latent in that
frame; ``concat_cond`` appends one channel, ``mask_inverted`` (1 on the clean frame); ``process_timestep`` makes
the timestep per latent frame, 0 on the clean frame; the clean frame of the output is replaced by the start
latent. The family option ``first_frame_clean`` trains exactly that: the embed's ``clean`` input is 1 on the
first latent frame, the embed writes the mask channel (models that take it) and the per-frame timestep, the
first stage puts the clean latent in that frame, and the loss leaves it out (:meth:`loss_mask`). The clip's
first latent frame is the start image's latent as the node encodes it (the Wan 2.1 VAE is causal: the node's
gray padding frames do not reach the first latent frame). A 1-frame example trains text-to-video (nothing left
to predict). Off, and on images: the mask channel is 0 and the timestep one per example, what ComfyUI gives the
model without a noise mask (the node without a start image: text-to-video, which the Video2World model runs
too). ``first_frame_clean`` on the 16-channel Text2Image model is what ComfyUI samples with that model after the
node (clean frame and per-frame timestep, no mask channel), so it trains too. Not covered: the node's
``end_image`` and start clips long enough to fill a second latent frame (9 pixel frames or more).

Backward: ComfyUI's self-attention normalises and ropes q and k through comfy_kitchen's fused
``rms_rope_split_half`` op even in training mode, and that op has no autograd formula;
:meth:`CosmosPredict2Adapter.stage_layers` registers one (patches/comfy_kitchen_rms_rope_backward.py, through
comfy_kitchen's own eager reference of the op).

ComfyUI 0.3.75 has this model class too, and it trains there: its ``_forward`` asserts latent sides divisible by
the patch size (current ComfyUI pads and crops them), which preflight requires on every ComfyUI anyway
(training/pipelines/checks.py's ``latent_size_problems``: crop or resize to even latent sides); its attention
ropes in plain torch (no comfy_kitchen op to patch).

Refused by name: a model of the class that is not a MiniTrainDIT; a MiniTrainDIT whose input channels are neither
its output channels (Text2Image) nor those plus ComfyUI's one ``mask_inverted`` channel (Video2World), which
ComfyUI's ``CosmosPredict2`` class cannot feed either.

Fixture tier: detection pins max sizes 240 x 240 x 128 and width 2048 (about 2 B parameters), so the tests
build a tiny model in memory from ComfyUI's own ``CosmosT2IPredict2`` config class
(tests/family_rows/cosmos_predict2.py, with AdaLN-LoRA as detection sets it; the Video2World row from
``CosmosI2VPredict2`` on 3 latent frames); tests/test_stage_split.py trains them 2 steps in 1 and 2 stages on
gloo ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "CosmosPredict2"
MASK_CHANNELS = 1  # model_base.CosmosPredict2(image_to_video=True).concat_keys: ("mask_inverted",)
BLOCKS = r"blocks\.\d+\."
_ATTENTION = r"(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|output_proj)"
_MLP = r"mlp\.layer[12]"
_MODULATION = r"adaln_modulation_(self_attn|cross_attn|mlp)\.[12]"
TARGETS = {
    "attention": rf"{BLOCKS}{_ATTENTION}",
    "attention_mlp": rf"{BLOCKS}({_ATTENTION}|{_MLP})",
    "all_linear": rf"{BLOCKS}({_ATTENTION}|{_MLP}|{_MODULATION})",
}


@dataclass(frozen=True)
class CosmosPredict2Options:
    """``first_frame_clean``: image-to-video as ComfyUI samples after ``CosmosPredict2ImageToVideoLatent`` with a
    start image (see the module docstring). Off: text-to-image / text-to-video."""

    first_frame_clean: bool = False

    def problems(self) -> list[str]:
        return []


def mask_channels(dm: nn.Module) -> int:
    """The conditioning channels ComfyUI concatenates to the latent: 1 on Video2World, 0 on Text2Image."""
    return int(dm.in_channels) - int(dm.out_channels)


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT

    if not isinstance(dm, MiniTrainDIT):
        return f"{type(dm).__name__} is not a Cosmos Predict2 MiniTrainDIT; the {FAMILY} adapter cannot train it."
    if mask_channels(dm) not in (0, MASK_CHANNELS):
        return (f"This Cosmos Predict2 model takes {dm.in_channels} input channels for {dm.out_channels} latent "
                f"channels; ComfyUI's CosmosPredict2 class feeds the latent alone (Text2Image) or the latent and "
                f"{MASK_CHANNELS} mask channel (Video2World), so neither ComfyUI nor PipeTrainer can run it. Load a "
                "Cosmos Predict2 Text2Image or Video2World model.")
    return None


def frame_conditioning(x: torch.Tensor, timestep: torch.Tensor, clean: torch.Tensor | None,
                       channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(network input, timestep)`` of ``x`` ``[B, C, T, H, W]`` given the clean-frame mask ``clean`` ``[B, T]``.

    As ComfyUI's ``CosmosPredict2`` builds them from a denoise mask that is 0 on the clean frames: ``channels``
    (0 or 1) ``mask_inverted`` channels appended (1 on clean frames), and with any clean frame the timestep per
    frame, 0 on the clean ones (``process_timestep``); without one the timestep stays one per example, as
    ComfyUI passes it when there is no denoise mask."""
    if channels:
        mask = clean if clean is not None else x.new_zeros(x.shape[0], x.shape[2])
        mask = mask.to(x.dtype)[:, None, :, None, None].expand(-1, channels, -1, *x.shape[-2:])
        x = torch.cat([x, mask], dim=1)
    if clean is None or not bool(clean.any()):
        return x, timestep
    keep = (1.0 - clean.float()).to(timestep.dtype)
    return x, timestep.reshape(-1, 1) * keep


def _forward_source() -> str:
    import inspect

    from comfy.ldm.cosmos.predict2 import MiniTrainDIT

    return inspect.getsource(MiniTrainDIT._forward)


def comfy_keeps_fp32_residual() -> bool:
    """Whether this ComfyUI's ``MiniTrainDIT._forward`` keeps the residual stream in fp32 under fp16 compute
    (current ComfyUI; 0.3.75 does not, and neither pads odd latent sides: preflight refuses those anyway)."""
    return "torch.float16" in _forward_source()


def _optional(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


class CosmosEmbed(StageLayer):
    """Padding, ``prepare_embedded_sequence`` (patch embedding, RoPE table), time embedding."""

    def __init__(self, dm: nn.Module):
        from comfy.ldm.cosmos.predict2 import MiniTrainDIT

        super().__init__()
        self.adopt_same(dm, "x_embedder", "pos_embedder", "t_embedder", "t_embedding_norm")
        if dm.extra_per_block_abs_pos_emb:
            self.adopt_same(dm, "extra_pos_embedder")
        # read by ComfyUI's own prepare_embedded_sequence, called on this layer below
        self.concat_padding_mask, self.pos_emb_cls = dm.concat_padding_mask, dm.pos_emb_cls
        self.extra_per_block_abs_pos_emb = dm.extra_per_block_abs_pos_emb
        self.patch = (dm.patch_temporal, dm.patch_spatial, dm.patch_spatial)
        self._prepare = MiniTrainDIT.prepare_embedded_sequence
        self.fp32_residual = comfy_keeps_fp32_residual()
        self.mask_channels = mask_channels(dm)

    def text_context(self, inputs) -> torch.Tensor:
        """The cross-attention context of the first stage's inputs (Anima adapts it first)."""
        return inputs[2]

    def clean_frames(self, inputs) -> torch.Tensor | None:
        """``[B, T]``, 1 on the latent frames given clean (Cosmos Predict2's fourth input; Anima has none)."""
        return None

    def forward(self, inputs):
        import comfy.ldm.common_dit

        context = self.text_context(inputs)
        frames, h, w = inputs[0].shape[-3:]
        x, timestep = frame_conditioning(inputs[0], inputs[1], self.clean_frames(inputs), self.mask_channels)
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch)
        tokens, rope, extra = self._prepare(self, x, fps=None, padding_mask=None)
        t = timestep.unsqueeze(1) if timestep.ndim == 1 else timestep
        t_emb, adaln = self.t_embedder[1](self.t_embedder[0](t).to(tokens.dtype))
        t_emb = self.t_embedding_norm(t_emb)
        if tokens.dtype == torch.float16 and self.fp32_residual:  # as this ComfyUI's _forward does
            tokens = tokens.float()
        adaln = adaln if adaln is not None else tokens.new_zeros(0)
        meta = torch.tensor([frames, h, w], dtype=torch.int64, device=x.device)
        # The RoPE table (and the per-block position table, from frozen weights) have no grad path, yet a float
        # tensor one stage sends another must have one for the sender's backward: leaves that take the gradient
        # sent back (no other gradient changes; the blocks read the same values).
        rope = rope.unsqueeze(1).unsqueeze(0).detach().requires_grad_()
        extra = extra.detach().requires_grad_() if extra is not None else None
        return (tokens, t_emb, adaln, context, rope, *((extra,) if extra is not None else ()), meta)


class CosmosPredict2Embed(CosmosEmbed):
    """The embed with the clean-frame mask of the first stage's inputs (always given; zeros without one)."""

    def clean_frames(self, inputs) -> torch.Tensor | None:
        return inputs[3]


class CosmosBlock(StageLayer):
    """One block (self-attention, cross-attention, MLP, each adaLN-modulated); the last keeps what the final reads."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        self.last = last

    def forward(self, inputs):
        x, t_emb, adaln, context, rope, *extra, meta = inputs
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, t_emb, context, rope_emb_L_1_1_D=rope, adaln_lora_B_T_3D=_optional(adaln),
                           extra_per_block_pos_emb=extra[0] if extra else None, transformer_options={})
        if self.last:
            return x, t_emb, adaln, meta
        return x, t_emb, adaln, context, rope, *extra, meta


class CosmosFinal(StageLayer):
    """``final_layer``, ComfyUI's own ``unpatchify``, crop to the latent's size."""

    def __init__(self, dm: nn.Module):
        from comfy.ldm.cosmos.predict2 import MiniTrainDIT

        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_spatial, self.patch_temporal = dm.patch_spatial, dm.patch_temporal
        self._unpatchify = MiniTrainDIT.unpatchify

    def forward(self, inputs):
        x, t_emb, adaln, meta = inputs
        # ComfyUI casts to the text's dtype, which is the compute dtype the time embedding is in
        x = self.final_layer(x.to(t_emb.dtype), t_emb, adaln_lora_B_T_3D=_optional(adaln))
        frames, h, w = (int(v) for v in meta)
        return self._unpatchify(self, x)[:, :, :frames, :h, :w]


def enable_backward() -> None:
    """ComfyUI's self-attention normalises and ropes through comfy_kitchen's fused op, which has no backward."""
    from ...patches.comfy_kitchen_rms_rope_backward import enable_rms_rope_backward

    enable_rms_rope_backward()


def block_layers(dm: nn.Module) -> list[StageLayer]:
    n = len(dm.blocks)
    if n == 0:
        raise ValueError("This Cosmos Predict2 model has no blocks; nothing to train.")
    return [CosmosBlock(dm, i, last=i == n - 1) for i in range(n)]


class CosmosPredict2Adapter:
    name = FAMILY
    options_type = CosmosPredict2Options
    text_encoder = "Cosmos Predict2's T5-XXL text encoder (CLIPLoader type cosmos)"

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        refuse_unsupported(self, diffusion_model)
        enable_backward()
        return [CosmosPredict2Embed(diffusion_model), *block_layers(diffusion_model), CosmosFinal(diffusion_model)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([CosmosBlock.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return TARGETS[preset]

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        dm = diffusion_model
        return Geometry(patch=(int(dm.patch_temporal), int(dm.patch_spatial), int(dm.patch_spatial)), video=True,
                        frame_step=4)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(1024, 0)`` on Cosmos Predict2: T5-XXL v1.1's states (read from the first block's cross-attention)."""
        return int(diffusion_model.blocks[0].cross_attn.k_proj.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        dm = diffusion_model
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        patches = (int(dm.patch_temporal), int(dm.patch_spatial), int(dm.patch_spatial))
        return math.prod(-(-int(s) // p) for s, p in zip(sizes, patches, strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError(f"{self.name} needs the text encoder's states, and the cache has none: cache the "
                             f"dataset with {self.text_encoder}.")
        x = batch.noisy  # [B, C, T, H, W]: a video family's latents are 5-D, an image's with T = 1
        clean = torch.zeros(x.shape[0], x.shape[2], dtype=torch.int64, device=x.device)  # no gradient to carry
        if _first_frame_clean(batch.options, x.shape[2]):
            if batch.clean is None:
                raise ValueError("first_frame_clean needs the clean latent in the batch.")
            x = torch.cat([batch.clean[:, :, :1].to(x.dtype), x[:, :, 1:]], dim=2)
            clean[:, 0] = 1
        return x, batch.timestep, batch.cond, clean

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        """With ``first_frame_clean``, 0 on the first latent frame (given, not predicted; ComfyUI's sampler puts
        the start latent back there)."""
        frames = latent_shape[1] if len(latent_shape) == 4 else 1
        if not _first_frame_clean(options, frames):
            return None
        mask = torch.ones(1, frames, 1, 1)
        mask[:, 0] = 0.0
        return mask

    def run_metadata(self, diffusion_model: nn.Module, options: object) -> dict[str, str]:
        """LoRA file metadata: whether it was trained image-to-video."""
        if isinstance(options, CosmosPredict2Options) and options.first_frame_clean:
            return {"cosmos_predict2.first_frame_clean": "true"}
        return {}

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut (ComfyUI pads
        captions to 512 tokens with zeroed states already, and the model takes no text mask)."""
        return max(lengths)


def _first_frame_clean(options: object, frames: int) -> bool:
    """Whether a clip of ``frames`` latent frames trains with a clean first frame (never a 1-frame one)."""
    return isinstance(options, CosmosPredict2Options) and options.first_frame_clean and frames > 1


ADAPTER = register(CosmosPredict2Adapter(), model_classes=("CosmosPredict2",))
