"""Kandinsky 5 Image (``comfy.ldm.kandinsky5.model.Kandinsky5``, ``model_base.Kandinsky5Image``) as pipeline stage layers.

Why a family of its own: Kandinsky 5 keeps text and image apart. The Qwen2.5-VL states run through their own
text transformer blocks (self-attention with 1-D RoPE, modulated by the time embedding), then the image
patches run through decoder blocks that self-attend (3-D RoPE), cross-attend to those text states and
feed forward, each modulated by ``time embedding + pooled CLIP-L embedding``. No other family has that
data flow (PixArt cross-attends to raw T5 states, Flux joins the streams).

Stage tuples (``B`` batch; ``T`` text tokens; ``N`` image patches; ``D`` model width; ``E`` time width):

- embed: ``(x [B, 16, H, W], timestep [B], context [B, T, 3584], y [B, 768])`` ->
  ``(context [B, T, D], visual [B, N, D], time_embed [B, E], meta)``: ComfyUI's ``text_embeddings``,
  ``time_embeddings`` + ``pooled_text_embeddings`` (as ``forward_orig`` adds them), ``pad_to_patch_size``
  and ``visual_embeddings`` of the latent as a one-frame video (as ``_forward`` unsqueezes it);
- each text block: the same tuple; its 1-D rotary table recomputed from ``T`` with the model's own
  ``rope_encode_1d`` (parameter-free, as ComfyUI computes it once);
- each visual block: ``(visual, context, time_embed, meta)``; its 3-D rotary table from the model's own
  ``rope_encode_3d`` (its rope scale, the Pro model's rule included); the last drops the text:
  ``(visual, time_embed, meta)``;
- final: ComfyUI's ``out_layer`` (modulated norm, Linear, un-patchify), the frame axis dropped.

``meta`` (int64) holds the latent's frames, height and width and the patch grid. This is
``Kandinsky5._forward`` / ``forward_orig`` on current ComfyUI (v0.33) cut at its block boundaries, without a
sampling-time ``rope_options`` patch or block replacement. Its blocks add residuals with ``addcmul`` out of
place; they still run under the out-of-place guard like every family's blocks.

Loss. ``model_base.Kandinsky5Image`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the
config's shift 3 and multiplier 1000 (the model embeds ``sigma * 1000``) and the CONST target ``noise - x0``;
training/objective takes both from the model (a ModelSamplingSD3 / AuraFlow node before Train LoRA is
replayed as on the other flow families).

Text: ComfyUI's Kandinsky 5 text encoder (DualCLIPLoader type ``kandinsky5_image``: Qwen2.5-VL 7B + CLIP-L) gives
the Qwen states after its image template (3584 wide) and CLIP-L's pooled vector (768), which
``model_base.Kandinsky5.encode_adm`` hands the model as ``y``: the cache's cond and pooled vector. The encoder
drops its attention mask when a caption has no padding (one caption per encode) and ComfyUI's forward reads
no mask, so nothing else is cached; shorter captions of a micro-batch get zero tokens appended
(:meth:`Kandinsky5ImageAdapter.text_length`), which take part in the text blocks' attention as ComfyUI's
unmasked batched conds do. ``time_dim_replace`` (image-to-video's clean frames) is a video input (the video family).

Latents are Flux VAE latents (16 channels, 4-D). ComfyUI pads odd sides but never crops its output, so an
odd side fails in ComfyUI itself; the geometry's patch 2 makes preflight refuse it first.

Only ``Kandinsky5Image`` is registered here, exactly: ComfyUI's video class ``Kandinsky5`` is the
``Kandinsky5Video`` family (training/pipelines/kandinsky5_video.py, which reuses these layers), so a video model
is never trained as images. Refused by name: a diffusion model that is not ComfyUI's ``Kandinsky5``, one whose
patch input is wider than the latent (the video models' concatenated image and mask channels), and one without
visual blocks.

Fixture tier: detection pins model width 2560 and Qwen 3584-wide text (billions of parameters), so the tests
build a tiny model in memory from ComfyUI's own ``Kandinsky5Image`` config class
(tests/family_rows/kandinsky5_image.py); the 1-vs-2-stage gloo check (tests/test_stage_split.py) picks the row up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "Kandinsky5Image"
_BLOCKS = r"(text|visual)_transformer_blocks\.\d+\."
_ATTENTION = r"(self_attention|cross_attention)\.(to_query|to_key|to_value|out_layer)"
_MLP = r"feed_forward\.(in_layer|out_layer)"
_MODULATION = r"(text|visual)_modulation\.out_layer"
_TARGETS = {
    "attention": rf"{_BLOCKS}{_ATTENTION}",
    "attention_mlp": rf"{_BLOCKS}({_ATTENTION}|{_MLP})",
    "all_linear": rf"{_BLOCKS}({_ATTENTION}|{_MLP}|{_MODULATION})",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.kandinsky5.model import Kandinsky5

    if not isinstance(dm, Kandinsky5):
        return (f"{type(dm).__name__} is not ComfyUI's Kandinsky5 model; the {FAMILY} adapter cannot train it. "
                "Kandinsky 5 Image models are supported.")
    patch = math.prod(dm.patch_size)
    if dm.visual_embeddings.in_layer.in_features != dm.in_visual_dim * patch:
        return (f"This Kandinsky 5 model takes {dm.visual_embeddings.in_layer.in_features // patch} input channels per "
                f"pixel for {dm.in_visual_dim} latent channels (a video model's image and mask channels concatenated "
                "to the latent): load it as a video model (ComfyUI's Kandinsky5 class, the Kandinsky5Video family); "
                "Kandinsky 5 Image models are supported here.")
    if len(dm.visual_transformer_blocks) == 0:
        return "This Kandinsky 5 model has no visual transformer blocks; nothing to train."
    return None


class _Rope(StageLayer):
    """What ComfyUI's own ``rope_encode_1d`` / ``rope_encode_3d`` read from the model (all parameter-free)."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.patch_size, self.rope_scale_factor, self.model_dim = dm.patch_size, dm.rope_scale_factor, dm.model_dim
        self.rope_embedder_1d, self.rope_embedder_3d = dm.rope_embedder_1d, dm.rope_embedder_3d
        self._rope_1d, self._rope_3d = type(dm).rope_encode_1d, type(dm).rope_encode_3d


class Kandinsky5Embed(StageLayer):
    """Text and time (+ pooled) embeddings, the latent padded and patch-embedded as a one-frame video."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "text_embeddings", "time_embeddings", "pooled_text_embeddings", "visual_embeddings")
        self.patch_size = dm.patch_size

    def forward(self, inputs):
        import comfy.ldm.common_dit

        x, timestep, context, y = inputs
        if x.ndim == 4:
            x = x.unsqueeze(2)
        t, h, w = x.shape[2:]
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch_size)
        context = self.text_embeddings(context)
        time_embed = self.time_embeddings(timestep, x.dtype) + self.pooled_text_embeddings(y)
        visual = self.visual_embeddings(x)
        grid = visual.shape[1:-1]
        meta = torch.tensor([t, h, w, *grid], dtype=torch.int64, device=x.device)
        return context, visual.flatten(1, -2), time_embed, meta


class Kandinsky5TextBlock(_Rope):
    """One text transformer block over the text states."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__(dm)
        self.adopt("block", dm.text_transformer_blocks[index], f"text_transformer_blocks.{index}")

    def forward(self, inputs):
        context, visual, time_embed, meta = inputs
        freqs_text = self._rope_1d(self, context.shape[1], device=context.device, dtype=visual.dtype)
        with OutOfPlaceResidualAdds(context):
            context = self.block(context, time_embed, freqs_text, transformer_options={})
        return context, visual, time_embed, meta


class Kandinsky5VisualBlock(_Rope):
    """One visual block: self-attention over the patches, cross-attention to the text, feed-forward."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, first: bool, last: bool):
        super().__init__(dm)
        self.adopt("block", dm.visual_transformer_blocks[index], f"visual_transformer_blocks.{index}")
        self.first, self.last = first, last

    def forward(self, inputs):
        if self.first:  # the text blocks' tuple
            context, visual, time_embed, meta = inputs
        else:
            visual, context, time_embed, meta = inputs
        t, h, w = (int(v) for v in meta[:3])
        freqs = self._rope_3d(self, t, h, w, device=visual.device, dtype=visual.dtype)
        with OutOfPlaceResidualAdds(visual):
            visual = self.block(visual, context, time_embed, freqs=freqs, transformer_options={})
        if self.last:
            return visual, time_embed, meta
        return visual, context, time_embed, meta


class Kandinsky5Final(StageLayer):
    """ComfyUI's ``out_layer`` over the patch grid; the frame axis of an image dropped (``keep_frames``: a
    video's kept, as ``_forward`` squeezes only a 4-D input; a 1-frame video stays 5-D)."""

    def __init__(self, dm: nn.Module, keep_frames: bool = False):
        super().__init__()
        self.adopt("out_layer", dm.out_layer, "out_layer")
        self.keep_frames = keep_frames

    def forward(self, inputs):
        visual, time_embed, meta = inputs
        grid = [int(v) for v in meta[3:]]
        out = self.out_layer(visual.reshape(visual.shape[0], *grid, -1), time_embed)
        return out if self.keep_frames else out.squeeze(2)


class Kandinsky5ImageAdapter:
    name = FAMILY
    options_type = NoOptions
    keep_frames = False  # the video family (kandinsky5_video.py) keeps the frame axis

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n_text, n = len(dm.text_transformer_blocks), len(dm.visual_transformer_blocks)
        return [Kandinsky5Embed(dm), *(Kandinsky5TextBlock(dm, i) for i in range(n_text)),
                *(Kandinsky5VisualBlock(dm, i, first=i == 0, last=i == n - 1) for i in range(n)),
                Kandinsky5Final(dm, keep_frames=self.keep_frames)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        dm = diffusion_model
        return [False, *([Kandinsky5TextBlock.swappable] * len(dm.text_transformer_blocks)),
                *([Kandinsky5VisualBlock.swappable] * len(dm.visual_transformer_blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return _TARGETS[preset]

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        return Geometry(patch=tuple(int(p) for p in diffusion_model.patch_size))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(3584, 768)`` on Kandinsky 5 Image: Qwen2.5-VL 7B's states and CLIP-L's pooled vector."""
        dm = diffusion_model
        return int(dm.text_embeddings.in_layer.in_features), int(dm.pooled_text_embeddings.in_layer.in_features)

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        _, ph, pw = (int(p) for p in diffusion_model.patch_size)
        h, w = (int(s) for s in latent_shape[-2:])
        return math.ceil(h / ph) * math.ceil(w / pw)

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None or batch.pooled is None:
            raise ValueError("Kandinsky 5 needs the text encoder's Qwen2.5-VL states and CLIP-L pooled vector, and the "
                             "cache lacks them: cache the dataset with Kandinsky 5's text encoders (DualCLIPLoader "
                             "type kandinsky5_image with the Qwen2.5-VL 7B and CLIP-L files).")
        return batch.noisy, batch.timestep, batch.cond, batch.pooled

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut (see the module
        docstring: ComfyUI's forward reads no text mask)."""
        return max(lengths)


ADAPTER = register(Kandinsky5ImageAdapter(), model_classes=(), exact_classes=("Kandinsky5Image",))
