"""MiniMax-H3 (``comfy.ldm.minimax.model.MiniMaxH3Model``, ``model_base.MiniMaxH3``): its stage layout, not yet a family.

Why this module exists before the family does: H3 is a 33 B-parameter audio-video DiT (50 blocks of 0.65 B
at the config ComfyUI builds, hidden 5376), the model pipeline stages and block swap exist for, and the
memory plan must be shown on its real layout before anything trains it (bench/minimax_h3_plan.py builds
the model on the meta device from ComfyUI's own config class and plans 1, 2, 4 and 8 stages). The layers
here are where a family module would cut ComfyUI's forward:

- embed: ``video_patch_proj``, ``audio_patch_proj`` (fp32 in ComfyUI), ``condition_proj`` and the
  2-block ``token_refiner`` over the Qwen3-VL states, the time embedder (or the adaln curve table of the
  curve-form checkpoints) and the parameter-free rope frequencies; resident, never swapped;
- 50 ``DiTBlock`` s, single-stream over the packed ``[text | cond rows | audio | video]`` sequence:
  swappable;
- final: ``final_layer`` (modulated norm and the fp32 video and audio heads); resident.

Not registered (no ``register`` call), so no MiniMax-H3 model is offered for training: the layers carry no
forward yet, because H3 cannot be trained on its video stream alone as ComfyUI runs it. ``MiniMaxH3Model.forward``
takes ``x`` as the list ``[video, audio]`` (it reads ``x[1]`` as the audio), and ``model_base`` splits the packed
latent into that list only when the conds carry ``latent_shapes``: a plain video latent (``latent_shapes``
None, ``audio_scale`` 1) fails with an IndexError in ComfyUI itself. Every H3 latent ComfyUI makes has an audio
stream (``EmptyMiniMaxH3LatentAV``: ``round(frames / 24 x 40)`` stereo latent frames) and ``_forward`` always
packs a target audio segment that every video token attends to. A zero-length audio stream does run (checked
on a tiny model), but a LoRA trained so would learn on an attention context the model never sees when it
samples. Training the video needs the audio stream beside it (the clip's own audio latent, or noise at the
audio sigma ``time_shift_sigma(sigma, 12, 3)``, with the loss on the video), that is the joint audio+video
latent of the cache and objective. Also needed: ComfyUI's ``_forward`` keeps Python-side structure across its
blocks (the ``PackedLayout`` segments, per-segment modulation rows, the timestep table ``unique_t``), which
must cross stage boundaries as integer tensors, and it takes batch size 1 only. The memory plan needs none of
that.
"""

from __future__ import annotations

import math

from torch import nn

from .base import StageLayer, refuse_model_class

FAMILY = "MiniMaxH3"
_BLOCKS = r"blocks\.\d+\."
_ATTENTION = r"attn\.(qkv_proj|out_proj)"
_MLP = r"mlp\.(fc1|fc2)"
_TARGETS = {
    "attention": rf"{_BLOCKS}{_ATTENTION}",
    "attention_mlp": rf"{_BLOCKS}({_ATTENTION}|{_MLP})",
    "all_linear": rf"{_BLOCKS}({_ATTENTION}|{_MLP}|adaln_proj\.linear)",
}
TEXT_TOKENS = 256  # a stated caption length for the plan (the Qwen3-VL states' token count varies per caption)


def support_problem(dm: nn.Module) -> str | None:
    """Why ``dm`` has no MiniMax-H3 layout here (None: it has)."""
    try:
        from comfy.ldm.minimax.model import MiniMaxH3Model
    except ImportError:
        return "This ComfyUI has no MiniMax-H3 model (comfy.ldm.minimax); update ComfyUI to v0.33 or later."
    if not isinstance(dm, MiniMaxH3Model):
        return f"{type(dm).__name__} is not ComfyUI's MiniMaxH3Model."
    if len(dm.blocks) == 0:
        return "This MiniMax-H3 model has no DiT blocks; nothing to train."
    return None


class MiniMaxH3Embed(StageLayer):
    """Patch projections of both streams, the text projection and token refiner, the time embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "video_patch_proj", "audio_patch_proj", "condition_proj", "token_refiner", "rope")
        if dm.use_adaln_curves:
            self.adopt_tensor("adaln_t_table", dm, "adaln_t_table")
        else:
            self.adopt_same(dm, "time_embedder")


class MiniMaxH3Block(StageLayer):
    """One DiT block over the whole packed sequence (text, audio and video tokens alike)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")


class MiniMaxH3Final(StageLayer):
    """The modulated final norm and the video and audio output heads."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "final_layer")


class MiniMaxH3Layout:
    """The family-shaped description of H3's stages (layers, swappable flags, LoRA presets, tokens)."""

    name = FAMILY

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        problem = support_problem(diffusion_model)
        if problem:
            raise ValueError(problem)
        dm = diffusion_model
        return [MiniMaxH3Embed(dm), *(MiniMaxH3Block(dm, i) for i in range(len(dm.blocks))), MiniMaxH3Final(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([MiniMaxH3Block.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return _TARGETS[preset]

    def tokens(self, diffusion_model: nn.Module, width: int, height: int, length: int,
               text_tokens: int = TEXT_TOKENS) -> int:
        """Rows of the packed sequence every block attends over for a ``width`` x ``height`` clip of ``length``
        frames at 24 fps: text, audio (2 stereo rows per 40 Hz latent frame) and video patches, with the
        latent frames and audio length from ComfyUI's own H3 latent rule (``nodes_minimax_h3.temporal_shape``:
        frame counts snap up to 17k + 5)."""
        from comfy_extras.nodes_minimax_h3 import temporal_shape

        _, latent_t, audio_t = temporal_shape(length)
        _, ph, pw = diffusion_model.patch_size
        video = latent_t * math.ceil(height // 16 / ph) * math.ceil(width // 16 / pw)
        return text_tokens + 2 * audio_t + video


refuse_model_class("MiniMaxH3", "its video and audio streams are one packed latent that ComfyUI's forward always reads "
                   "together, and PipeTrainer cannot train the audio stream of this model yet. bench/minimax_h3_plan.py "
                   "shows its stage split and memory plan.")
