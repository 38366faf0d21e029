"""SD3-family MMDiT (``comfy.ldm.modules.diffusionmodules.mmdit``) as pipeline stage layers.

Stage tuples: embed -> ``(x, c, context, hw)``; each joint block -> same (the last block is
``pre_only`` for the text stream and drops ``context``); final layer -> the image-shaped prediction.
``hw`` is an integer tensor so it crosses stages without a gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import StageLayer

_TARGETS = {
    "attention": r"attn2?\.(qkv|proj)",
    "attention_mlp": r"(attn2?\.(qkv|proj)|mlp\.fc[12])",
    "all_linear": r"(attn2?\.(qkv|proj)|mlp\.fc[12]|adaLN_modulation\.1)",
}


class MMDiTEmbed(StageLayer):
    """Patch, position, timestep, pooled-vector and context embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        if getattr(dm, "register_length", 0) or getattr(dm, "context_processor", None) is not None:
            raise NotImplementedError("MMDiT variants with register tokens or a context processor are not supported yet.")
        self.adopt("x_embedder", dm.x_embedder, "x_embedder")
        self.adopt("t_embedder", dm.t_embedder, "t_embedder")
        if dm.y_embedder is not None:
            self.adopt("y_embedder", dm.y_embedder, "y_embedder")
        else:
            self.y_embedder = None
        self.adopt("context_embedder", dm.context_embedder, "context_embedder")
        if dm.pos_embed is not None:
            self.register_buffer("pos_embed", dm.pos_embed, persistent=False)
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

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        blocks = [MMDiTJointBlock(dm, i) for i in range(len(dm.joint_blocks))]
        return [MMDiTEmbed(dm), *blocks, MMDiTFinal(dm)]

    def lora_target_regex(self, preset: str) -> str:
        return rf"(.*\.)?block\.(x_block|context_block)\.{_TARGETS[preset]}"

    def first_stage_inputs(self, noisy, timestep, cond, pooled):
        if pooled is None:
            pooled = torch.zeros(noisy.shape[0], 0, dtype=noisy.dtype)
        return noisy, timestep, cond, pooled

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width or 0)`` the embedders take, so preflight can catch a wrong text encoder."""
        dm = diffusion_model
        context = getattr(dm.context_embedder, "in_features", dm.hidden_size)  # Identity: context is hidden-wide
        pooled = dm.y_embedder.mlp[0].in_features if dm.y_embedder is not None else 0
        return int(context), int(pooled)


ADAPTER = MMDiTAdapter()
