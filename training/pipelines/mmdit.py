"""SD3-family MMDiT (``comfy.ldm.modules.diffusionmodules.mmdit``) as pipeline stage layers.

Stage tuples: embed -> ``(x, c, context, hw)``; each joint block -> same (the last block is
``pre_only`` for the text stream and drops ``context``); final layer -> the image-shaped prediction.
``hw`` is an integer tensor so it crosses stages without a gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .distillation import Distillation
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds
from .presets import ai_toolkit

_TARGETS = {
    "attention": r"attn2?\.(qkv|proj)",
    "attention_mlp": r"(attn2?\.(qkv|proj)|mlp\.fc[12])",
    "all_linear": r"(attn2?\.(qkv|proj)|mlp\.fc[12]|adaLN_modulation\.1)",
}


class MMDiTEmbed(StageLayer):
    """Patch, position, timestep, pooled-vector and context embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "x_embedder", "t_embedder")
        if dm.y_embedder is not None:
            self.adopt("y_embedder", dm.y_embedder, "y_embedder")
        else:
            self.y_embedder = None
        self.adopt("context_embedder", dm.context_embedder, "context_embedder")
        if dm.pos_embed is not None:  # a buffer of the model itself, which loading fills: the same tensor
            self.adopt_tensor("pos_embed", dm, "pos_embed")
        else:
            self.pos_embed = None
        # Attributes read by ComfyUI's own MMDiT.cropped_pos_embed, which is reused below.
        self.hidden_size = dm.hidden_size
        self.pos_embed_max_size = dm.pos_embed_max_size
        self._cropped_pos_embed = type(dm).cropped_pos_embed

    def forward(self, inputs):
        import comfy.ops

        x, t, context, y = inputs
        hw = x.shape[-2:]
        pos = self._cropped_pos_embed(self, hw, device=x.device)
        x = self.x_embedder(x) + comfy.ops.cast_to_input(pos, x)
        c = self.t_embedder(t, dtype=x.dtype)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y)
        context = self.context_embedder(context)
        return x, c, context, torch.tensor(list(hw), dtype=torch.int64, device=x.device)


class MMDiTJointBlock(StageLayer):
    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__()
        self.adopt("block", dm.joint_blocks[index], f"joint_blocks.{index}")

    def forward(self, inputs):
        x, c, context, hw = inputs
        # ComfyUI's joint blocks add residuals out of place today; the guard every family's blocks run
        # under keeps a future ``x += ...`` from corrupting autograd (see out_of_place.py).
        with OutOfPlaceResidualAdds(x, context):
            context, x = self.block(context, x, c=c, use_checkpoint=False, transformer_options={})
        if context is None:  # pre_only last block: the text stream ends here
            return x, c, hw
        return x, c, context, hw


class MMDiTFinal(StageLayer):
    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("final_layer", dm.final_layer, "final_layer")
        self.patch_size = dm.x_embedder.patch_size[0]
        self.out_channels = dm.out_channels

    def forward(self, inputs):
        x, c, hw = inputs[0], inputs[1], inputs[-1]
        x = self.final_layer(x, c)
        h, w = int(hw[0]), int(hw[1])
        p, ch = self.patch_size, self.out_channels
        gh, gw = (h + 1) // p, (w + 1) // p
        x = x.reshape(x.shape[0], gh, gw, p, p, ch)
        x = torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], ch, gh * p, gw * p)
        return x[:, :, :h, :w]


class MMDiTAdapter:
    name = "SD3"
    options_type = NoOptions
    presets = (ai_toolkit("SD3.5 Large, 24 GB", "train_lora_sd35_large_24gb", 16, resolutions=(1024,)),)
    distillation = Distillation(checkpoints="SD3.5 Large Turbo")

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        dm = diffusion_model
        if getattr(dm, "register_length", 0) or getattr(dm, "context_processor", None) is not None:
            return ["MMDiT variants with register tokens or a context processor are not supported yet; "
                    "SD3 / SD3.5 models are."]
        return []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        blocks = [MMDiTJointBlock(dm, i) for i in range(len(dm.joint_blocks))]
        return [MMDiTEmbed(dm), *blocks, MMDiTFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([MMDiTJointBlock.swappable] * len(diffusion_model.joint_blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"joint_blocks\.\d+\.(x_block|context_block)\.{_TARGETS[preset]}"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        p = int(diffusion_model.x_embedder.patch_size[0])
        return Geometry(patch=(1, p, p))

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the (padded) latent, as ``x_embedder`` cuts it."""
        p = diffusion_model.x_embedder.patch_size[0]
        h, w = latent_shape[-2:]
        return -(-h // p) * -(-w // p)

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        pooled = batch.pooled
        if pooled is None:
            pooled = torch.zeros(batch.noisy.shape[0], 0, dtype=batch.noisy.dtype)
        return batch.noisy, batch.timestep, batch.cond, pooled

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width or 0)`` the embedders take, so preflight can catch a wrong text encoder."""
        dm = diffusion_model
        context = getattr(dm.context_embedder, "in_features", dm.hidden_size)  # Identity: context is hidden-wide
        pooled = dm.y_embedder.mlp[0].in_features if dm.y_embedder is not None else 0
        return int(context), int(pooled)

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI's SD3 encoders already give most captions one length: CLIP-L/G pad to 77-token chunks
        with their end token and T5 pads to 77 tokens with its pad token (both in the cache), so only a
        caption past 75 CLIP or 77 T5 tokens makes the others of its batch see zero tokens. ComfyUI's
        MMDiT takes no text attention mask, so the zero tokens take part in the joint attention (as the
        zero columns ComfyUI pads CLIP-L/G to T5's width with do); cutting instead would train on less
        of a caption than sampling encodes."""
        return max(lengths)


ADAPTER = register(MMDiTAdapter(), model_classes=("SD3",))
