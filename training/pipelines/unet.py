"""ComfyUI's LDM UNet (``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel``) as pipeline stage layers.

SD 1.x, SD 2.x and SDXL run the same network class; they differ only in what the time embedding is
added to (SDXL adds a label embedding of its ``y`` vector; SD 1.x / 2.x have none) and in their
sizes. This module holds what they share: the stage layers, the LoRA presets, the geometry and the
rules every UNet family keeps. It registers no family: ``sdxl`` and ``sd1_sd2`` do, each with a
small :class:`UNetAdapter` subclass that says how its first stage is fed.

Stage tuples (``B`` batch, ``T`` text tokens; ``hs`` the UNet's skip stack, newest last):

- embed: ``(x, timestep, context[, y])`` -> ``(emb, context, h0)``: time embedding (plus the ``y``
  vector's label embedding where the family has one, ComfyUI's ``_forward``), then ``input_blocks.0``
  (the input conv), whose output is the first skip;
- input block ``k``: ``(emb, context, *hs)`` -> ``(emb, context, *hs, h_k)``: the running activation
  is always the newest skip, so no tensor appears twice in a tuple (a stage boundary would otherwise
  send it twice and split its gradient);
- middle block: ``(emb, context, *hs)`` -> ``(h, emb, context, *hs)``;
- output block ``j``: ``(h, emb, context, *hs)`` -> ``(h, emb, context, *hs[:-1])``: it pops the newest
  skip, concatenates it to ``h`` and upsamples to the next skip's size (``output_shape``, as ComfyUI
  does, so odd latent sizes come back exactly). Once no later layer has a transformer, ``context`` is
  dropped from the tuple (SDXL: after its level-2 blocks; SD 1.x / 2.x keep it to the last block), and
  the last output block drops ``emb`` too: a tensor that crosses a stage boundary must be used by the
  receiving side (training/loop/engine.py);
- out: ``(h,)`` -> the prediction, shaped like ``x``.

So the skip tensors cross every boundary inside the UNet. LoRA presets: the SpatialTransformers'
attention (``attn1`` self, ``attn2`` cross) and feed-forward Linears; ``all_linear`` adds their linear
``proj_in`` / ``proj_out`` (SD 2.x, SDXL; SD 1.x has 1x1 convolutions there, which are not Linears and
get no LoRA) and every ResBlock's time-embedding projection ``emb_layers.1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .base import Geometry, StageLayer, refuse_unsupported
from .out_of_place import OutOfPlaceResidualAdds

_BLOCKS = r"(input_blocks\.\d+|middle_block|output_blocks\.\d+)"
_ATTENTION = r"\d+\.transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)"
_MLP = r"\d+\.transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)"
# all_linear adds the SpatialTransformer's linear projections and every ResBlock's time-embedding
# projection (the UNet's analogue of a transformer's modulation): every Linear inside the blocks.
_REST = r"\d+\.(proj_in|proj_out|emb_layers\.1)"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_REST}",
}


def unet_problem(dm: nn.Module, family: str) -> str | None:
    """Why ``dm`` is not a UNet the shared stage layers can run (whatever the family), or None."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    if not isinstance(dm, UNetModel):
        return f"{type(dm).__name__} is not an LDM UNet; the {family} adapter cannot train it."
    if dm.middle_block is None:
        return f"This {family}-class UNet has no middle block; PipeTrainer's UNet stage layers need one."
    if getattr(dm, "predict_codebook_ids", False) or getattr(dm, "heatmap_head", None) is not None:
        return f"This UNet has a different output head (codebook ids or a heatmap head); it cannot be trained as {family}."
    if context_dim(dm) == 0 or last_output_with_transformer(dm) < 0:
        return (f"This UNet has no transformer in its output blocks, which the {family} adapter's stage tuples (and "
                f"its LoRA presets) need; standard {family} layouts have them.")
    return None


def last_output_with_transformer(dm: nn.Module) -> int:
    """Index of the last output block with a transformer (-1: none): ``context`` is dropped after it."""
    from comfy.ldm.modules.attention import SpatialTransformer

    with_transformer = [j for j, block in enumerate(dm.output_blocks)
                        if any(isinstance(m, SpatialTransformer) for m in block.modules())]
    return max(with_transformer, default=-1)


def context_dim(dm: nn.Module) -> int:
    """Text width of the cross-attention (read from the first transformer; 0 without one). ``in_features``: an
    ``nn.Linear``, ComfyUI's per-layer-quantized Linear and a PEFT-wrapped one all have it."""
    for name, module in dm.named_modules():
        if name.endswith("transformer_blocks.0.attn2.to_k"):
            width = getattr(module, "in_features", None)
            if isinstance(width, int):
                return width
    return 0


def _run(block: nn.Module, h: torch.Tensor, emb: torch.Tensor, context: torch.Tensor | None,
         output_shape=None) -> torch.Tensor:
    """One of ComfyUI's ``TimestepEmbedSequential`` blocks, called as ``UNetModel._forward`` calls it."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed

    with OutOfPlaceResidualAdds(h):
        return forward_timestep_embed(block, h, emb, context, {}, output_shape)


class UNetEmbed(StageLayer):
    """Time embedding (plus the label embedding of ``y`` when ``with_label``), then the input convolution
    (``input_blocks.0``): the first skip."""

    def __init__(self, dm: nn.Module, with_label: bool):
        super().__init__()
        self.adopt_same(dm, "time_embed", *(("label_emb",) if with_label else ()))
        self.adopt("conv_in", dm.input_blocks[0], "input_blocks.0")
        self.model_channels = dm.model_channels
        self.with_label = with_label

    def forward(self, inputs):
        from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

        if self.with_label:
            x, timestep, context, y = inputs
        else:
            x, timestep, context = inputs
        t_emb = timestep_embedding(timestep, self.model_channels, repeat_only=False).to(x.dtype)
        emb = self.time_embed(t_emb)
        if self.with_label:
            emb = emb + self.label_emb(y)
        return emb, context, _run(self.conv_in, x, emb, context)


class UNetInputBlock(StageLayer):
    """One down-path block: runs on the newest skip and pushes its output as the next one."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__()
        self.adopt("block", dm.input_blocks[index], f"input_blocks.{index}")

    def forward(self, inputs):
        emb, context, *hs = inputs
        return (emb, context, *hs, _run(self.block, hs[-1], emb, context))


class UNetMiddle(StageLayer):
    swappable = True

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("block", dm.middle_block, "middle_block")

    def forward(self, inputs):
        emb, context, *hs = inputs
        return (_run(self.block, hs[-1], emb, context), emb, context, *hs)


class UNetOutputBlock(StageLayer):
    """One up-path block: concatenates the newest skip, upsamples to the next skip's size.

    ``gets_context``: the tuple it receives still holds ``context`` (some block from here on has a
    transformer); ``keeps_context``: a later block needs it, so it is passed on.
    """

    swappable = True

    def __init__(self, dm: nn.Module, index: int, gets_context: bool, keeps_context: bool, last: bool):
        super().__init__()
        self.adopt("block", dm.output_blocks[index], f"output_blocks.{index}")
        self.gets_context, self.keeps_context, self.last = gets_context, keeps_context, last

    def forward(self, inputs):
        if self.gets_context:
            h, emb, context, *hs = inputs
        else:
            (h, emb, *hs), context = inputs, None
        skip = hs.pop()
        output_shape = hs[-1].shape if hs else None
        h = _run(self.block, torch.cat([h, skip], dim=1), emb, context, output_shape)
        if self.last:
            return (h,)
        if self.keeps_context:
            return (h, emb, context, *hs)
        return (h, emb, *hs)


class UNetOut(StageLayer):
    """Final GroupNorm, SiLU and convolution (``out``)."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("out", dm.out, "out")

    def forward(self, inputs):
        (h,) = inputs
        return self.out(h)


class UNetAdapter:
    """What every UNet family shares. A subclass sets ``name``, ``options_type`` and ``with_label`` (its first
    stage passes a ``y`` vector to the label embedding) and implements ``support_problems``,
    ``conditioning_dims``, ``extras`` and ``first_stage_inputs``."""

    name: str
    options_type: type
    with_label: bool

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n_out = len(dm.output_blocks)
        last_context = last_output_with_transformer(dm)
        outputs = [UNetOutputBlock(dm, j, gets_context=j <= last_context, keeps_context=j < last_context,
                                   last=j == n_out - 1) for j in range(n_out)]
        inputs = [UNetInputBlock(dm, k) for k in range(1, len(dm.input_blocks))]
        return [UNetEmbed(dm, self.with_label), *inputs, UNetMiddle(dm), *outputs, UNetOut(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.input_blocks) - 1 + 1 + len(diffusion_model.output_blocks)
        return [False, *([True] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"{_BLOCKS}\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        """No patches: the UNet takes any latent size (its down-sampling rounds up and ComfyUI's up-sampling
        matches each skip's size). Below 2 latent pixels per side at the deepest level nothing is left."""
        levels = len(diffusion_model.channel_mult) if hasattr(diffusion_model, "channel_mult") else 3
        return Geometry(patch=(1, 1, 1), min_patches=2 * 2 ** (levels - 1))

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Latent pixels (the UNet has no tokens; only the resolution-dependent shift reads this)."""
        h, w = latent_shape[-2:]
        return int(h) * int(w)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI's SD CLIPs encode captions in 77-token chunks (padded with the end token, in the cache),
        so only a caption past 75 tokens makes the others of its batch longer. ComfyUI's UNet takes no text
        attention mask, so those zero tokens take part in the cross-attention. (ComfyUI itself repeats the
        shorter cond to a common multiple when it batches conds, which leaves attention unchanged; the
        shared batching appends zeros.)"""
        return max(lengths)
