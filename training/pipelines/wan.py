"""Wan 2.1 / 2.2 text-to-video (``comfy.ldm.wan.model.WanModel``, model_type ``t2v``) as pipeline stage layers.

Stage tuples (``B`` batch, ``L`` video tokens, ``T`` text tokens):

- embed: ``(x [B, C, F, H, W], timestep [B], context [B, T, text_dim])`` -> ``(x, e, e0, context, fhw)``
- each attention block but the last: the same tuple in and out; the last drops ``e0`` and ``context``
- head: ``(x, e, fhw)`` -> the prediction, shaped like the input latent

``e`` ``[B, 1, dim]`` is the time embedding the head modulates with, ``e0`` ``[B, 1, 6, dim]`` its
projection that every block modulates with (ComfyUI's ``forward_orig``); ``e`` passes through the
blocks unchanged to the head. ``fhw`` is the unpadded latent frames, height and width as int64: the
rotary embedding has no gradient, so it may not cross a stage boundary as a float tensor; each block
recomputes it with ComfyUI's own ``WanModel.rope_encode`` from those sizes, exactly as ``_forward``
does once (the rotary embedder has no parameters). The head un-patchifies with ComfyUI's own
``unpatchify`` and crops the patch padding like ``_forward``. ComfyUI's Wan blocks add residuals out of
place today; they run under the same out-of-place guard as every family's blocks.

Images train as 1-frame videos (the data pipeline gives image latents a frame axis, :class:`Geometry`
``video``). Clips have 1 or 4k+1 frames (the Wan VAE's temporal rule: 4 pixel frames per latent frame
after the first). The TI2V-5B layout (Wan 2.2, 48 channels, model class WAN22) trains here as
text-to-video; image-to-video (Wan 2.1 I2V, clip-vision features and a concatenated first frame) and
the Wan relatives ComfyUI builds from subclasses (VACE, camera, S2V, HuMo, Animate) are refused by name.

Fixture tier (devkit/fixtures.py ``build_tiny_wan_t2v``): detected by ComfyUI's own detection from the
file's keys and shapes on 0.3.75 and on current ComfyUI (dim 128 gives 1 head, ffn 256, 2 layers,
1.1 M parameters, no config in the file's metadata). Detection pins ``text_dim`` to UMT5-XXL's 4096
(it reads no text width from the weights), so the tiny CLIP-L fixture (768) cannot condition it: the
tests feed seeded 4096-wide conds, and an end-to-end graph needs a 4096-wide text encoder (none is
small enough for the fixtures yet).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

_ATTENTION = r"(self_attn|cross_attn)\.(q|k|v|o)"
_MLP = r"ffn\.(0|2)"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    # A Wan block has no other Linear (its modulation is a plain parameter): all_linear = attention_mlp.
    "all_linear": rf"{_ATTENTION}|{_MLP}",
}

_RELATIVES = {
    "VaceWanModel": "Wan VACE", "CameraWanModel": "Wan camera control", "WanModel_S2V": "Wan S2V",
    "HumoWanModel": "Wan HuMo", "AnimateWanModel": "Wan Animate",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.wan.model import WanModel

    if not isinstance(dm, WanModel):
        return f"{type(dm).__name__} is not a Wan model; the Wan adapter cannot train it."
    if type(dm) is not WanModel:
        name = _RELATIVES.get(type(dm).__name__, type(dm).__name__)
        return (f"{name} models are not supported yet: their blocks take extra streams the Wan adapter does not "
                "feed. Wan 2.1 / 2.2 text-to-video models are supported.")
    if dm.model_type != "t2v" or dm.img_emb is not None:
        return ("Wan image-to-video models (clip-vision features and a concatenated first frame) are not "
                "supported yet; Wan 2.1 / 2.2 text-to-video models (incl. the TI2V-5B layout) are.")
    if dm.in_dim != dm.out_dim:
        return (f"This Wan model takes {dm.in_dim} input channels for {dm.out_dim} output channels (image or "
                "control latents concatenated to the noise), which the text-to-video adapter does not build.")
    return None


class WanEmbed(StageLayer):
    """Patch embedding, time embedding and its projection, text embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("patch_embedding", dm.patch_embedding, "patch_embedding")
        self.adopt("time_embedding", dm.time_embedding, "time_embedding")
        self.adopt("time_projection", dm.time_projection, "time_projection")
        self.adopt("text_embedding", dm.text_embedding, "text_embedding")
        self.patch_size = tuple(dm.patch_size)
        self.freq_dim = dm.freq_dim
        self.dim = dm.dim

    def forward(self, inputs):
        import comfy.ldm.common_dit
        from comfy.ldm.wan.model import sinusoidal_embedding_1d

        x, t, context = inputs
        fhw = torch.tensor(list(x.shape[-3:]), dtype=torch.int64, device=x.device)
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch_size)
        x = self.patch_embedding(x.float()).to(x.dtype)
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype))
        e = e.reshape(t.shape[0], -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))
        context = self.text_embedding(context)
        return x, e, e0, context, fhw


class WanBlock(StageLayer):
    """One attention block (self-attention with RoPE, text cross-attention, FFN)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        # Attributes read by ComfyUI's own WanModel.rope_encode, which is reused below (no parameters).
        self.rope_embedder = dm.rope_embedder
        self.patch_size = tuple(dm.patch_size)
        self.dim, self.num_heads = dm.dim, dm.num_heads
        self._rope_encode = type(dm).rope_encode
        self.last = last

    def forward(self, inputs):
        x, e, e0, context, fhw = inputs
        f, h, w = (int(v) for v in fhw)
        freqs = self._rope_encode(self, f, h, w, device=x.device, dtype=x.dtype, transformer_options={})
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, e=e0, freqs=freqs, context=context, context_img_len=None, transformer_options={})
        if self.last:
            return x, e, fhw
        return x, e, e0, context, fhw


class WanHead(StageLayer):
    """Final modulated projection, then un-patchify and crop to the input latent size."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("head", dm.head, "head")
        # Attributes read by ComfyUI's own WanModel.unpatchify, which is reused below.
        self.out_dim = dm.out_dim
        self.patch_size = tuple(dm.patch_size)
        self._unpatchify = type(dm).unpatchify

    def forward(self, inputs):
        x, e, fhw = inputs
        f, h, w = (int(v) for v in fhw)
        x = self.head(x, e)
        grid = [-(-size // p) for size, p in zip((f, h, w), self.patch_size, strict=True)]
        return self._unpatchify(self, x, grid)[:, :, :f, :h, :w]


class WanAdapter:
    name = "Wan"
    options_type = NoOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        problems = self.support_problems(dm)
        if problems:
            raise NotImplementedError(" ".join(problems))
        n = len(dm.blocks)
        if n == 0:
            raise ValueError("This Wan model has no attention blocks; nothing to train.")
        return [WanEmbed(dm), *(WanBlock(dm, i, last=i == n - 1) for i in range(n)), WanHead(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([WanBlock.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"blocks\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        pt, ph, pw = (int(p) for p in diffusion_model.patch_size)
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=4)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(text width, 0)``: UMT5-XXL's 4096 for every Wan model; Wan takes no pooled vector."""
        return int(diffusion_model.text_dim), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Patches of the (padded) latent, as ``patch_embedding`` cuts it; an image is one frame."""
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        return math.prod(-(-s // int(p)) for s, p in zip(sizes, diffusion_model.patch_size, strict=True))

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        return batch.noisy, batch.timestep, batch.cond

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI's UMT5 tokenizer pads every caption to at least 512 tokens and its encoder zeroes the
        padded positions (``zero_out_masked``), so the cached conds already end in zero tokens and
        appending more zeros is what a longer caption's batch mate would see at inference; ComfyUI
        gives Wan no text attention mask."""
        return max(lengths)


ADAPTER = register(WanAdapter(), model_classes=("WAN21",))
