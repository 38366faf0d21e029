"""MiniMax-H3 (``comfy.ldm.minimax.model.MiniMaxH3Model``, ComfyUI model class ``MiniMaxH3``) as pipeline stage layers.

H3 is a 33 B-parameter audio-video DiT (50 blocks of 0.65 B at the config ComfyUI builds, hidden 5376): the model
pipeline stages and block swap exist for (bench/minimax_h3_plan.py plans its real layout on the meta device). It is
single-stream: every block attends over one packed sequence ``[text | audio | video]`` (text-to-video-and-audio),
with per-segment AdaLN rows (text and video at the video timestep, audio at its own).

How ComfyUI samples it, and so how it trains here. The sampler holds the video latent ``[B, 24, T, H, W]`` and the
audio VAE's stereo latent ``[B, 32, 2, Ta]`` packed into one (``comfy.utils.pack_latents``); ``process_latent_in``
carries the audio scaled by ``audio_scale`` (``ModelSamplingAV``: video shift / audio shift, 12 / 3), which makes the
pack one ordinary flow latent on the video's sigma schedule. ``MiniMaxH3Model.forward`` undoes that carry (the audio
runs on its own shifted sigma, ``time_shift_sigma``) and converts the audio velocity back. The trainer packs the
cached audio latent with the video latent (``ExtraSpec.joins_latent``) and processes the pack with ComfyUI's own
``process_latent_in`` (training/data/joint_latent.py), so noise, target and loss over both streams are the shared
flow objective's, exactly as ComfyUI's sampling defines them; the stages run ComfyUI's own pieces of ``forward`` /
``_forward`` (the carry, ``PackedLayout``, ``patchify_video``, ``pack_audio``, the refiner, the blocks, the final
layer) on each example.

ComfyUI's ``_forward`` takes batch size 1 and keeps Python-side structure across its blocks (the layout's segments,
per-segment modulation rows, the table of distinct timesteps). Here every layer runs each example of a micro-batch
alone, as ComfyUI would, and that structure crosses stage boundaries as integers (training/pipelines/minimax_h3_layout.py): per example its caption's token
count, its sigma's float32 bits and the rows of its two timesteps (``meta``); the streams' shapes and the rotary
frequencies' bits (``sizes``; rotary tables have no gradient, so they may not cross as float tensors). Examples whose
captions differ in length have packed sequences of different lengths: each is zero-padded to the longest in the
micro-batch and cut back to its own before every block, so each trains exactly as sampled alone.

Stage tuples (``B`` batch, ``S`` the longest packed sequence, ``D`` hidden, ``L`` the longest caption):

- embed: ``(packed latent [B, 1, n], timestep [B], Qwen3-VL states [B, L, text_dim], token counts [B, 1] int64,
  sizes, token tags [B, L] int64, keyframe latents...)`` -> ``(h [B, S, D], t_emb [B, 3, t_dim], audio
  [B, 32, 2, Ta] as the network reads it, meta, sizes, token tags)``
- each block: that tuple in and out;
- final: -> the packed prediction ``[B, 1, n]``.

The embed runs the text through ``condition_proj`` and the token refiner (``preprocess_text_embeds``, as
``MiniMaxH3.extra_conds`` does); the cache holds the text encoder's states.

First/last-frame mode (``MiniMaxH3ImageToVideo`` with ``first_frame`` and ``last_frame``; the Cache node's
``start_image = first_last_frames``, training/cache/start_image.py) adds what ComfyUI's ``PackedLayout`` calls
keyframe condition rows: each frame's own VAE latent (``keyframe_first``, ``keyframe_last``), patchified with the
condition noise augmentation of ``_cond_video_rows`` and packed between the text and the audio, at timestep
``max(t_v, VISUAL_COND_TIMESTEP)``; the keyframes are never noised and predict nothing, so they are outside the
loss. Their rotary positions anchor them at pixel frame 0 and at the clip's last frame (``Keyframes.anchors``). Both
frames are in the prompt too, and the blocks modulate their vision tokens with the video row, as ComfyUI does with
``minimax_token_tags``, which cross the stages with the hidden states.

Reference mode (``MiniMaxH3ReferenceToVideo`` with ``ref_images``; a Dataset control folder of reference pictures
and the Cache node's ``reference_in_prompt``, training/pipelines/minimax_h3_prompt.py) adds ``ref_img`` condition
rows the same way: each picture's latent at its own size (``reference_0``...), after the keyframe rows, each one
shifting the targets' rotary timeline by one, as ``PackedLayout`` packs ``minimax_refs`` of kind ``image``; the
pictures are in the prompt too. Standalone reference audio (``ref_audios``: the control folder's audio files) adds
``ref_audio`` rows after the pictures' rows: each file's audio latent through ``_cond_audio_rows``, projected with the
target audio, at ``max(t_a, AUDIO_COND_TIMESTEP)``, each one shifting the targets' timeline by its length; the prompt
labels it ``<Audio j>``. Reference videos (``ref_videos``) add ``ref_img`` rows of their latent frames, each after its
sound track's ``ref_audio`` rows (``ref_video_audios``), between the pictures' rows and the audio's, as
``PackedLayout`` packs kinds ``video`` and ``video_audio`` (training/pipelines/minimax_h3_conditions.py lists every
condition extra). ``MiniMaxH3AddGuide``'s audio guide at frame 0 (the Cache node's ``audio_guide``) adds
``cond_audio`` rows after the keyframes' rows at the same clean audio timestep; its image and clip guides, and guides at
other frames, are not fed yet. A LoRA trained in any mode is sampled by every mode. Blocks update the residual stream in place
(``addcmul_`` on segment views), so each runs on a private copy under :mod:`.out_of_place`. Only current ComfyUI has
``MiniMaxH3``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from ..cache.start_image_prompt import IMAGE_TOKEN_TAGS
from ..data.joint_latent import pack_streams, unpack_streams
from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .minimax_h3_conditions import condition_extras, condition_problem, five_d
from .minimax_h3_layout import (
    TEXT_TAG,
    Conditions,
    ExampleStructure,
    Sizes,
    float_bits,
    from_bits,
    packed_layout,
    padded_spatial,
)
from .minimax_h3_prompt import (
    MINIMAX_H3_FIRST_FRAME_PROMPT,
    MINIMAX_H3_FRAMES_PROMPT,
    MINIMAX_H3_LAST_FRAME_PROMPT,
    MINIMAX_H3_REFERENCES,
    reads_images,
)
from .out_of_place import OutOfPlaceResidualAdds

FAMILY = "MiniMaxH3"
AUDIO_LATENT = "audio_latent"
_BLOCKS = r"blocks\.\d+\."
_ATTENTION = r"attn\.(qkv_proj|out_proj)"
_MLP = r"mlp\.(fc1|fc2)"
_TARGETS = {
    "attention": rf"{_BLOCKS}{_ATTENTION}",
    "attention_mlp": rf"{_BLOCKS}({_ATTENTION}|{_MLP})",
    "all_linear": rf"{_BLOCKS}({_ATTENTION}|{_MLP}|adaln_proj\.linear)",
}
TEXT_TOKENS = 256  # a stated caption length for the plan (the Qwen3-VL states' token count varies per caption)
COND_SEED = 0  # the condition noise augmentation's seed: ``MiniMaxH3.extra_conds``' default (see ``_cond_rows``)
_T_ROWS = 4  # distinct timesteps at most: video, audio, video condition rows, audio condition rows


@dataclass(frozen=True)
class MiniMaxH3Options:
    """MiniMax-H3 has no training options of its own (text-to-video-and-audio at ComfyUI's sigma shifts)."""

    def problems(self) -> list[str]:
        return []


def support_problem(dm: nn.Module) -> str | None:
    """Why ``dm`` cannot train as MiniMax-H3 here (None: it can)."""
    try:
        from comfy.ldm.minimax.model import MiniMaxH3Model
    except ImportError:
        return "This ComfyUI has no MiniMax-H3 model (comfy.ldm.minimax); update ComfyUI to v0.33 or later."
    if not isinstance(dm, MiniMaxH3Model):
        return f"{type(dm).__name__} is not ComfyUI's MiniMaxH3Model."
    if len(dm.blocks) == 0:
        return "This MiniMax-H3 model has no DiT blocks; nothing to train."
    return None


def _shifts(dm: nn.Module) -> tuple[float, float]:
    return float(dm.sigma_shift_video), float(dm.sigma_shift_audio)


def audio_scale(dm: nn.Module) -> float:
    """The scale ``ModelSamplingAV`` carries the audio at for this model's shifts (its ``audio_scale``)."""
    video, audio = _shifts(dm)
    return video / audio


class MiniMaxH3Embed(StageLayer):
    """The audio carry, both streams' patch projections, the text refiner, the timestep table: ComfyUI's steps."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "video_patch_proj", "audio_patch_proj", "condition_proj", "token_refiner", "rope")
        self.curves = bool(dm.use_adaln_curves)
        if self.curves:
            self.adopt_tensor("adaln_t_table", dm, "adaln_t_table")
        else:
            self.adopt_same(dm, "time_embedder")
        self.patch = tuple(dm.patch_size)
        self.shifts = _shifts(dm)
        self.scale = audio_scale(dm)
        self._preprocess_text = dm.preprocess_text_embeds
        self._video_cond_rows = dm._cond_video_rows  # ComfyUI's, reading only the model's patch size
        self._audio_cond_rows = dm._cond_audio_rows

    def _t_emb(self, t_vals: torch.Tensor, dtype) -> torch.Tensor:
        """ComfyUI's table of the distinct timesteps' embeddings (time embedder, or the curve-form lerp)."""
        if not self.curves:
            return self.time_embedder(t_vals).to(dtype)
        import comfy.model_management

        table = comfy.model_management.cast_to(self.adaln_t_table, device=t_vals.device)
        pos = t_vals.clamp(0.0, 1.0) * (table.shape[0] - 1)
        i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))

    def _cond_rows(self, latents: Sequence[torch.Tensor], device) -> torch.Tensor | None:
        """The keyframe and reference latents as ComfyUI's ``_cond_video_rows`` makes them: patchified, with the
        condition noise augmentation at ``VISUAL_COND_TIMESTEP`` (0.999 of the latent, 0.001 of seeded noise). At
        sampling its seed is the sampler's noise seed, the same for every step; here it is ``MiniMaxH3.extra_conds``'
        default, 0, so a condition trains on one fixed draw of that 0.1% noise, as one sampling run conditions on one."""
        if not latents:
            return None
        return self._video_cond_rows({"cond_video_latents": list(latents), "seed": COND_SEED}, device)

    def _audio_rows(self, ax: torch.Tensor, latents: Sequence[torch.Tensor], update: torch.Tensor) -> torch.Tensor:
        """The target audio's rows and the reference audio's (``_cond_audio_rows``: its noise augmentation at
        ``AUDIO_COND_TIMESTEP``, seed + 1) placed as ``_forward`` places them, for one projection of them all."""
        from comfy.ldm.minimax.model import pack_audio

        rows = pack_audio(ax.to(torch.float32))
        if not latents:
            return rows
        cond = self._audio_cond_rows({"cond_audio_latents": list(latents), "seed": COND_SEED}, rows.device)
        out = torch.empty(update.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
        out[~update] = cond
        out[update] = rows
        return out

    def _example(self, vx, ax, timestep, context, conditions: Conditions, latents: Sequence[torch.Tensor],
                 audio_latents: Sequence[torch.Tensor] = ()):
        """One example as ``MiniMaxH3Model.forward`` and ``_forward`` embed it: ``(h, t_emb, carried audio, meta)``."""
        import comfy.ldm.common_dit
        from comfy.ldm.minimax.model import AUDIO_COND_TIMESTEP, VISUAL_COND_TIMESTEP, patchify_video, time_shift_sigma

        shift_v, shift_a = self.shifts
        sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        sigma_a = time_shift_sigma(sigma_v, shift_v, shift_a)
        if self.scale != 1.0:
            ax = ax * (sigma_a / sigma_v).to(ax.dtype)  # forward's undoing of the sampler's carry
        video_x = comfy.ldm.common_dit.pad_to_patch_size(vx, self.patch)
        dtype, device = context.dtype, context.device
        layout = packed_layout(context.shape[1], *video_x.shape[2:], int(ax.shape[-1]), conditions)
        # ComfyUI takes the timesteps as Python floats and builds the table of the distinct ones from them; these are
        # the same float32 values, kept as tensors so that the table has the timestep's gradient path (a pipeline
        # stage's every float output needs one). Keyframe and reference rows run at max(t_v, VISUAL_COND_TIMESTEP).
        times = {"v": (1.0 - sigma_v).view(1), "a": (1.0 - sigma_a).view(1)}
        t_v, t_a = (float(times[k].detach()) for k in ("v", "a"))
        by_value = {t_a: times["a"], t_v: times["v"]}
        t_c = t_ca = None
        if latents:
            t_c = max(t_v, VISUAL_COND_TIMESTEP)
            by_value.setdefault(t_c, times["v"].clamp(min=VISUAL_COND_TIMESTEP))
        if audio_latents:  # reference audio rows run at max(t_a, AUDIO_COND_TIMESTEP)
            t_ca = max(t_a, AUDIO_COND_TIMESTEP)
            by_value.setdefault(t_ca, times["a"].clamp(min=AUDIO_COND_TIMESTEP))
        unique_t = sorted(by_value)
        video_rows = patchify_video(video_x.to(torch.float32), self.patch)
        cond_rows = self._cond_rows(latents, device)
        if cond_rows is not None:  # ComfyUI's placement of condition and target rows, then one projection of them all
            update = layout.img_update.to(device)
            rows = torch.empty(update.shape[0], video_rows.shape[1], dtype=torch.float32, device=device)
            rows[~update] = cond_rows
            rows[update] = video_rows
            video_rows = rows
        video_embed = self.video_patch_proj(video_rows).to(dtype)
        audio_embed = self.audio_patch_proj(self._audio_rows(ax, audio_latents, layout.audio_update.to(device)))
        audio_embed = audio_embed.to(dtype)
        pieces, v_off, a_off = [], 0, 0
        for start, stop, kind in layout.segments:  # in order: text | keyframe rows | reference rows | audio | video
            n = stop - start
            if kind == "text":
                pieces.append(context[0])
            elif kind in ("cond", "ref_img", "video"):
                pieces.append(video_embed[v_off:v_off + n])
                v_off += n
            else:
                pieces.append(audio_embed[a_off:a_off + n])
                a_off += n
        h = torch.cat(pieces)
        t_emb = self._t_emb(torch.cat([by_value[t] for t in unique_t]).to(device=h.device), dtype)
        row_c, row_ca = (unique_t.index(t) if t is not None else -1 for t in (t_c, t_ca))
        meta = torch.cat([torch.tensor([context.shape[1]], dtype=torch.int64), float_bits(sigma_v.view(1).detach()),
                          torch.tensor([unique_t.index(t_v), unique_t.index(t_a), len(unique_t), row_c, row_ca],
                                       dtype=torch.int64)])
        return h, t_emb, ax, meta

    def forward(self, inputs):
        packed, timestep, context, tokens, sizes, tags, *latents = inputs
        b = packed.shape[0]
        v_shape, a_shape, conditions, _ = Sizes.read(sizes, b)
        vx, ax = unpack_streams(packed, (v_shape, a_shape))
        videos = len(latents) - conditions.sound_latents  # video condition latents first, then the audio ones
        rows = []
        for i in range(b):
            n = int(tokens[i, 0])
            text = self._preprocess_text(context[i:i + 1, :n])  # MiniMaxH3.extra_conds' step, at the caption's length
            own = [k[i:i + 1] for k in latents]
            rows.append(self._example(vx[i:i + 1], ax[i:i + 1], timestep[i:i + 1], text, conditions, own[:videos],
                                      own[videos:]))
        longest = max(r[0].shape[0] for r in rows)
        h = torch.stack([nn.functional.pad(r[0], (0, 0, 0, longest - r[0].shape[0])) for r in rows])
        t_emb = torch.stack([nn.functional.pad(r[1], (0, 0, 0, _T_ROWS - r[1].shape[0])) for r in rows])
        carried = torch.cat([r[2] for r in rows])
        meta = torch.stack([r[3] for r in rows])
        inv_freq = self.rope.inv_freq
        return h, t_emb, carried, meta, Sizes.make(v_shape, a_shape, conditions, float_bits(inv_freq)), tags


class MiniMaxH3Block(StageLayer):
    """One DiT block over each example's packed sequence (text, audio and video tokens alike)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        self.patch = tuple(dm.patch_size)
        self._rope_freqs = type(dm).rope_freqs  # ComfyUI's, over the frequencies that crossed as bits

    def _rope(self, layout, inv_freq: torch.Tensor, dtype, device) -> torch.Tensor:
        from comfy.ldm.minimax.model import rope_rotation_table

        holder = SimpleNamespace(rope=SimpleNamespace(inv_freq=inv_freq))
        return rope_rotation_table(self._rope_freqs(holder, layout.position_ids, device), dtype)

    def forward(self, inputs):
        h, t_emb, carried, meta, sizes, tags = inputs
        b = h.shape[0]
        v_shape, a_shape, conditions, bits = Sizes.read(sizes, b)
        inv_freq = from_bits(bits)
        outs = []
        for i in range(b):
            ex = ExampleStructure(meta, i, v_shape, a_shape, conditions, self.patch)
            x = h[i, :ex.length].clone()  # the block updates it in place: never the stage's input
            rope = self._rope(ex.layout, inv_freq, h.dtype, h.device)
            with OutOfPlaceResidualAdds(x, private=True, slices=True):
                y = self.block(x, t_emb[i, :ex.distinct], ex.mod_segments(tags[i]), rope, transformer_options={})
            outs.append(nn.functional.pad(y, (0, 0, 0, h.shape[1] - ex.length)))
        return torch.stack(outs), t_emb, carried, meta, sizes, tags


class MiniMaxH3Final(StageLayer):
    """The modulated final norm, the video and audio heads, and forward's audio velocity conversion: packed again."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "final_layer")
        self.patch = tuple(dm.patch_size)
        self.channels = int(dm.latents_dim)
        self.shifts = _shifts(dm)
        self.scale = audio_scale(dm)

    def forward(self, inputs):
        from comfy.ldm.minimax.model import time_shift_sigma, unpack_audio, unpatchify_video

        h, t_emb, carried, meta, sizes, _ = inputs
        b = h.shape[0]
        v_shape, a_shape, conditions, _ = Sizes.read(sizes, b)
        t, lat_h, lat_w = padded_spatial(v_shape, self.patch)
        videos, audios = [], []
        for i in range(b):
            ex = ExampleStructure(meta, i, v_shape, a_shape, conditions, self.patch)
            va, vb, _ = ex.layout.segments[-1]
            aa, ab, _ = ex.layout.segments[-2]
            v, a = self.final_layer(h[i, :ex.length], t_emb[i, :ex.distinct], (va, vb, ex.row_v), (aa, ab, ex.row_a))
            video = unpatchify_video(v, t, lat_h // 2, lat_w // 2, self.channels, self.patch)
            video = -video[:, :, :v_shape[2], :v_shape[3], :v_shape[4]].to(h.dtype)
            audio = -unpack_audio(a).to(h.dtype)
            if self.scale != 1.0:  # forward's d/d(sigma_v) of the carried audio
                sigma_a = time_shift_sigma(ex.sigma_v, *self.shifts)
                audio = ((1.0 - self.scale) * carried[i:i + 1]
                         + (1.0 + (self.scale - 1.0) * sigma_a).to(audio.dtype) * audio)
            videos.append(video)
            audios.append(audio)
        return pack_streams([torch.cat(videos), torch.cat(audios)])[0]


class MiniMaxH3Adapter:
    """MiniMax-H3 text-to-video-and-audio (and first/last-frame) on the joint latent ComfyUI samples."""

    name = FAMILY
    options_type = MiniMaxH3Options
    text_extras = {IMAGE_TOKEN_TAGS: False}  # ComfyUI's encoder output, one tag per token (no batch axis)
    # first/last-frame, first-frame, last-frame captions (training/cache/start_image_prompt.py)
    start_image_prompts = (MINIMAX_H3_FRAMES_PROMPT, MINIMAX_H3_FIRST_FRAME_PROMPT, MINIMAX_H3_LAST_FRAME_PROMPT)
    reference_prompts = (MINIMAX_H3_REFERENCES,)  # reference images in the prompt (training/cache/reference_prompt.py)

    def takes_reference_prompt(self, clip: object) -> bool:
        """Whether the Cache's ``clip`` is MiniMax-H3's text encoder, which reads the reference pictures."""
        return reads_images(clip)

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        from ...patches.comfy_kitchen_rms_rope_backward import enable_rms_rope_backward

        refuse_unsupported(self, diffusion_model)
        enable_rms_rope_backward()  # ComfyUI's H3 attention ropes with comfy_kitchen's fused op, which has no backward
        dm = diffusion_model
        return [MiniMaxH3Embed(dm), *(MiniMaxH3Block(dm, i) for i in range(len(dm.blocks))), MiniMaxH3Final(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([MiniMaxH3Block.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        if preset not in _TARGETS:
            raise ValueError(f"Unknown LoRA target preset {preset!r} for MiniMax-H3; choose one of {', '.join(_TARGETS)}.")
        return _TARGETS[preset]

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        """Patches 1 x 2 x 2. ``frame_step`` is the H3 VAE's index formula (4); the frame counts it encodes whole are
        17k + 5 (``nodes_minimax_h3.align_frame_count``), which the Cache node reads from the VAE's own functions
        (training/cache/encoders.py ``vae_usable_frames``)."""
        pt, ph, pw = (int(p) for p in diffusion_model.patch_size)
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=4)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(Qwen3-VL width, 0)``: the cache holds the text encoder's states; the embed runs ``condition_proj`` and
        the token refiner on them, as ``MiniMaxH3.extra_conds`` does at sampling."""
        return int(diffusion_model.condition_proj.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """The audio latent; optionally the first/last-frame mode's keyframe latents and the text encoder's token tags
        (an image in the prompt makes vision tokens, which the blocks modulate as video)."""
        dm = diffusion_model
        out = {AUDIO_LATENT: ExtraSpec(shape=(int(dm.audio_latents_dim), 2, "*"), source="latent", joins_latent=True,
                                       description="the clip's stereo audio VAE latent, packed with the video latent"),
               IMAGE_TOKEN_TAGS: ExtraSpec(shape=("T",), source="text", required=False, follows_text=True,
                                     description="the text encoder's modality tag of each token (0: an image's)")}
        out.update(condition_extras(dm))
        return out

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Video tokens of the video latent (the joint latent's first stream)."""
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        out = 1
        for s, p in zip(sizes, diffusion_model.patch_size, strict=True):
            out *= -(-int(s) // int(p))
        return out

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if len(batch.latent_shapes) != 2:
            raise ValueError("MiniMax-H3 trains on the video and audio latents together; the batch has no audio latent.")
        v_shape, a_shape = batch.latent_shapes
        b = batch.noisy.shape[0]
        tokens = torch.tensor(batch.text_lengths or [batch.cond.shape[1]] * b, dtype=torch.int64)
        tags = batch.extras.get(IMAGE_TOKEN_TAGS)
        if tags is None:  # a caption encoded alone: every token is text
            tags = torch.full((b, batch.cond.shape[1]), TEXT_TAG, dtype=torch.int64)
        conditions = Conditions.of(batch.extras)
        problem = condition_problem(conditions, batch.extras, tags, tokens)
        if problem:
            raise ValueError(problem)
        latents = [five_d(batch.extras[name]) for name in conditions.names(batch.extras)]
        latents += [batch.extras[name] for name in conditions.audio_names(batch.extras)]
        return (batch.noisy, batch.timestep, batch.cond, tokens.view(-1, 1), Sizes.make(v_shape, a_shape, conditions),
                tags.to(torch.int64), *latents)

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; each example's sequence holds its caption at its own length."""
        return max(lengths)

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


ADAPTER = register(MiniMaxH3Adapter(), model_classes=("MiniMaxH3",))
