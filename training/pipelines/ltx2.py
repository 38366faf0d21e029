"""LTX-2 (``comfy.ldm.lightricks.av_model.LTXAVModel``, ComfyUI model class ``LTXAV``) as pipeline stage layers.

LTX-2 generates video and sound together: every block updates a video token stream and an audio token
stream, each attending to its text, to itself and to the other. ComfyUI samples it on one joint latent,
the video latent ``[B, 128, F, H, W]`` and the audio VAE's latent ``[B, 8, T, 16]`` packed by
``comfy.utils.pack_latents`` into ``[B, 1, n]`` (``LTXVConcatAVLatent``); one sigma noises both, and
``BaseModel.apply_model`` unpacks it for the network and packs the prediction again. Training uses that
same packed latent: the family declares the cached audio latent as an extra that joins the training
latent (``ExtraSpec.joins_latent``, training/data/joint_latent.py), so noise, target and loss over both
streams are the shared objective's, exactly as ComfyUI's sampling defines them.

Stage tuples (``B`` batch; ``Nv``/``Na`` video/audio tokens):

- embed: ``(packed latent [B, 1, n], video timestep [B] or [B, Nv, 1], audio timestep [B], context,
  each caption's token count [B, 1] int64, sizes)`` -> the block tuple
- each block: ``(vx, ax, v_context, a_context, text_mask, v_t, a_t, ca_audio_ss, ca_video_ss,
  ca_a2v_gate, ca_v2a_gate, v_prompt_t, a_prompt_t, v_emb, a_emb, sizes)`` in and out; the last gives
  ``(vx, ax, v_emb, a_emb, sizes)``
- head: that -> the packed prediction ``[B, 1, n]``

The embed runs ComfyUI's own steps of ``LTXBaseModel._forward`` (``_process_input``, ``_prepare_timestep``,
``_prepare_context``) and the head its ``_process_output``, as bound methods of the model whose modules the
layers adopt (LoRA targets only the blocks, whose modules are shared objects). ComfyUI keeps video
timestep tables per latent frame (``CompressedTimestep``); they cross stage boundaries as their data,
with the patches per frame in ``sizes``, and each block rebuilds the object. ``sizes`` (int64: the two
streams' shapes, those counts, the frame rate's float64 bits) lets each block recompute the rotary
embeddings with ComfyUI's ``_prepare_positional_embeddings`` (they have no gradient, so they may not
cross a boundary as float tensors). A prompt timestep of a layout without cross-attention AdaLN is an int64
empty tensor. Blocks update both residual streams in place (``addcmul_``): each runs on private copies
under :mod:`.out_of_place`.

Image-to-video (option ``first_frame_clean``): as ComfyUI samples after ``LTXVImgToVideo``, the first
video latent frame is clean with timestep 0 on its tokens and left out of the loss; the audio is all
noised (its timestep the sigma's). Text: the cached cond is the text encoder's output; the embed runs the
model's embeddings connectors on it (``preprocess_text_embeds``), as ``LTXAV.extra_conds`` does before the
model, each caption at its own token count (the micro-batch's zeros after a shorter caption never reach
them: they append learnable registers there). The connectors bring the text to their own length, so no text
mask is handed on (ComfyUI hands on none either); ``text_mask`` stays in the block tuple as an empty int64 tensor.

Refused by name: layouts with a keyframe position embedding. Reference-audio (ID-LoRA) and keyframe-guide
conditioning are not fed. Only current ComfyUI has ``LTXAV``; ComfyUI 0.3.75 lacks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..data.joint_latent import pack_streams, unpack_streams
from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .ltxv import DEFAULT_FRAME_RATE, FRAME_STEP, clean_first_frame_tokens, frame_rate_bits
from .out_of_place import OutOfPlaceResidualAdds

AUDIO_LATENT = "audio_latent"
_ATTN = r"(to_q|to_k|to_v|to_out\.0)"
_VIDEO_ATTENTION = rf"(attn1|attn2)\.{_ATTN}"
_AUDIO_ATTENTION = rf"(audio_attn1|audio_attn2)\.{_ATTN}"
_CROSS_MODAL = rf"(audio_to_video_attn|video_to_audio_attn)\.{_ATTN}"
_VIDEO_MLP = r"ff\.net\.(0\.proj|2)"
_AUDIO_MLP = r"audio_ff\.net\.(0\.proj|2)"
_TARGETS = {
    # the shared presets: both streams and the attention between them
    "attention": rf"{_VIDEO_ATTENTION}|{_AUDIO_ATTENTION}|{_CROSS_MODAL}",
    "attention_mlp": rf"{_VIDEO_ATTENTION}|{_AUDIO_ATTENTION}|{_CROSS_MODAL}|{_VIDEO_MLP}|{_AUDIO_MLP}",
    "all_linear": rf"{_VIDEO_ATTENTION}|{_AUDIO_ATTENTION}|{_CROSS_MODAL}|{_VIDEO_MLP}|{_AUDIO_MLP}",
    # one stream: its own attention and MLP, plus the cross-modal attention that writes into it
    "video": rf"{_VIDEO_ATTENTION}|audio_to_video_attn\.{_ATTN}|{_VIDEO_MLP}",
    "audio": rf"{_AUDIO_ATTENTION}|video_to_audio_attn\.{_ATTN}|{_AUDIO_MLP}",
}
STREAM_PRESETS = ("video", "audio")  # LoRA presets of one stream, besides the shared ones (both streams)
_EMBED_MODULES = ("patchify_proj", "adaln_single", "caption_projection", "prompt_adaln_single", "audio_patchify_proj",
                  "video_embeddings_connector", "audio_embeddings_connector",
                  "audio_adaln_single", "audio_prompt_adaln_single", "av_ca_video_scale_shift_adaln_single",
                  "av_ca_a2v_gate_adaln_single", "av_ca_audio_scale_shift_adaln_single",
                  "av_ca_v2a_gate_adaln_single", "audio_caption_projection")


@dataclass(frozen=True)
class LTX2Options:
    """LTX-2 training options: ``frame_rate`` as ``LTXVConditioning`` sets it at sampling (the video's
    temporal rotary positions; ComfyUI's default 25), ``first_frame_clean`` image-to-video."""

    frame_rate: float = DEFAULT_FRAME_RATE
    first_frame_clean: bool = False

    def problems(self) -> list[str]:
        if not 0.0 < self.frame_rate <= 1000.0:
            return [f"frame_rate must be between 0 and 1000 frames per second (got {self.frame_rate})."]
        return []


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.lightricks.av_model import LTXAVModel

    if not isinstance(dm, LTXAVModel):
        return f"{type(dm).__name__} is not an LTX-2 model; the LTX-2 adapter cannot train it."
    if getattr(dm, "use_keyframes_abs_pos_embedding", False):
        return ("LTX-2 models with a keyframe position embedding are not supported yet: their keyframe guides "
                "are not fed by the trainer. Plain LTX-2 text/image-to-video-with-audio models are.")
    return None


def _empty(batch: int) -> torch.Tensor:
    """The stand-in of an absent prompt timestep: int64, since DeepSpeed expects a gradient for every float
    tensor a stage receives, and nothing can flow into a tensor that is never used."""
    return torch.zeros(batch, 0, dtype=torch.int64)


def _data(t) -> tuple[torch.Tensor, int]:
    """``(tensor, patches per frame)`` of a ComfyUI timestep table (a ``CompressedTimestep`` or a tensor)."""
    if hasattr(t, "expand_for_computation"):
        return t.data, int(t.patches_per_frame)
    return t, 0


def _compressed(data: torch.Tensor, per_frame: int):
    """The ``CompressedTimestep`` ComfyUI's blocks read (0: a plain tensor)."""
    from comfy.ldm.lightricks.av_model import CompressedTimestep

    return CompressedTimestep(data, per_frame, per_frame=True) if per_frame else data


class _Sizes:
    """``sizes`` int64: video ``(C, F, H, W)``, audio ``(C, T, Q)``, 3 patches-per-frame counts, rate bits."""

    @staticmethod
    def make(v_shape, a_shape, counts: Sequence[int], rate: torch.Tensor) -> torch.Tensor:
        head = torch.tensor([*v_shape[1:], *a_shape[1:], *counts], dtype=torch.int64)
        return torch.cat([head, rate.to(torch.int64).view(1)])

    @staticmethod
    def read(sizes: torch.Tensor, batch: int):
        v = [batch, *(int(s) for s in sizes[0:4])]
        a = [batch, *(int(s) for s in sizes[4:7])]
        counts = [int(s) for s in sizes[7:10]]
        rate = float(sizes[10:11].view(torch.float64).item())
        return v, a, counts, rate


class _Positions:
    """Both streams' rotary embeddings of one latent pair, by ComfyUI's own code (no parameters)."""

    def __init__(self, dm: nn.Module):
        self.patchifier = dm.patchifier
        self.a_patchifier = dm.a_patchifier
        self.vae_scale_factors = dm.vae_scale_factors
        self.causal = bool(dm.causal_temporal_positioning)
        self._prepare = dm._prepare_positional_embeddings  # a bound method of the model

    def pe(self, v_shape, a_shape, rate: float, dtype: torch.dtype, device):
        from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

        b, _, f, h, w = v_shape
        coords = self.patchifier.get_latent_coords(f, h, w, b, device)
        v_coords = latent_to_pixel_coords(coords, self.vae_scale_factors, causal_fix=self.causal)
        a_coords = self.a_patchifier.patchify(torch.zeros(b, 1, a_shape[2], 1, device=device))[1]
        return self._prepare([v_coords, a_coords], rate, dtype)


class LTX2Embed(StageLayer):
    """Both streams' token projections, timestep tables, text projections: ComfyUI's own steps."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, *(n for n in _EMBED_MODULES if isinstance(getattr(dm, n, None), nn.Module)))
        self._preprocess_text = dm.preprocess_text_embeds
        self.raw_text_flag = bool(dm.caption_proj_before_connector)  # see LTX2Adapter.conditioning_dims
        self._process_input = dm._process_input
        self._prepare_timestep = dm._prepare_timestep
        self._prepare_context = dm._prepare_context

    def _connected_text(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The connectors' output of each caption at its own token count (``tokens`` ``[B, 1]``), as
        ``LTXAV.extra_conds`` runs them on one prompt at sampling: they append their learnable registers after
        the caption, so the zeros a shorter caption got in the micro-batch must not reach them. Outputs of
        different lengths (only captions over the connectors' 1024 positions) are followed by zeros."""
        lengths = [int(n) for n in tokens.view(-1)] if tokens.numel() else []
        if not lengths or all(n == context.shape[1] for n in lengths):
            return self._preprocess_text(context, unprocessed=self.raw_text_flag)
        rows = [self._preprocess_text(context[i:i + 1, :n], unprocessed=self.raw_text_flag)[0]
                for i, n in enumerate(lengths)]
        out = rows[0].new_zeros(len(rows), max(r.shape[0] for r in rows), rows[0].shape[-1])
        for i, row in enumerate(rows):
            out[i, :row.shape[0]] = row
        return out

    def forward(self, inputs):
        packed, v_t, a_t, context, tokens, sizes = inputs
        b = packed.shape[0]
        context = self._connected_text(context, tokens)  # LTXAV.extra_conds' step
        text_mask = _empty(b)  # the connectors bring every caption to their own length: no mask, as in ComfyUI
        v_shape, a_shape, _, _ = _Sizes.read(sizes, b)
        vx, ax = unpack_streams(packed, (v_shape, a_shape))
        dtype = vx.dtype
        x, _, args = self._process_input([vx, ax], None, None, a_timestep=a_t)
        tables, counts = self._timesteps(v_t, a_t, b, dtype, args)
        (v_ctx, a_ctx), _ = self._prepare_context(context, b, x, None)
        v_data, a_tab, ca_a_ss, ca_v_ss, ca_gate, ca_v2a, v_prompt, a_prompt, v_emb, a_emb = tables
        sizes = _Sizes.make(v_shape, a_shape, counts, sizes[10:11])
        return (x[0], x[1], v_ctx, a_ctx, text_mask, v_data, a_tab, ca_a_ss, ca_v_ss, ca_gate, ca_v2a,
                v_prompt, a_prompt, v_emb, a_emb, sizes)

    def _timesteps(self, v_t, a_t, b: int, dtype, args) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        """ComfyUI's timestep tables as tensors (the 10 the blocks take) and their patches per frame.

        ComfyUI's LTX-2 takes the cross-modal gates' timestep as the maximum over the whole batch, which is each
        example's own only when the batch shares one sigma (as at sampling). A micro-batch of different sigmas is
        therefore prepared one example at a time, so that each trains as it is sampled alone."""
        same = all(torch.equal(t[:1].expand_as(t), t) for t in (v_t, a_t))
        if b == 1 or same:
            return self._tables(v_t, a_t, b, dtype, args)
        parts = [self._tables(v_t[i:i + 1], a_t[i:i + 1], 1, dtype, args) for i in range(b)]
        tables = [torch.cat([p[0][k] for p in parts]) for k in range(len(parts[0][0]))]
        return tables, parts[0][1]

    def _tables(self, v_t, a_t, b: int, dtype, args) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        t, emb, _ = self._prepare_timestep(v_t, b, dtype, **args, a_timestep=a_t)
        v_tab, a_tab, cross, v_prompt, a_prompt = t
        v_data, v_pf = _data(v_tab)
        ca_v_ss, ss_pf = _data(cross[1])
        ca_gate, gate_pf = _data(cross[2])
        v_emb, emb_pf = _data(emb[0])
        if len({v_pf, ss_pf, gate_pf, emb_pf}) != 1:
            raise ValueError("ComfyUI's LTX-2 timestep tables disagree on their frame compression; update the adapter.")
        v_prompt = v_prompt if v_prompt is not None else _empty(b)
        a_prompt = a_prompt if a_prompt is not None else _empty(b)
        return [v_data, a_tab, cross[0], ca_v_ss, ca_gate, cross[3], v_prompt, a_prompt, v_emb, emb[1]], (v_pf, ss_pf, gate_pf)


class LTX2Block(StageLayer):
    """One audio-video block (self, text and cross-modal attention and MLP of both streams)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, last: bool):
        super().__init__()
        self.adopt("block", dm.transformer_blocks[index], f"transformer_blocks.{index}")
        self.positions = _Positions(dm)
        self._attention_mask = dm._prepare_attention_mask
        self.last = last

    def forward(self, inputs):
        (vx, ax, v_ctx, a_ctx, text_mask, v_t, a_t, ca_a_ss, ca_v_ss, ca_gate, ca_v2a, v_prompt, a_prompt,
         v_emb, a_emb, sizes) = inputs
        b = vx.shape[0]
        v_shape, a_shape, (v_pf, ss_pf, gate_pf), rate = _Sizes.read(sizes, b)
        v_pe, a_pe = self.positions.pe(v_shape, a_shape, rate, vx.dtype, vx.device)
        mask = self._attention_mask(text_mask, vx.dtype) if text_mask.numel() else None
        v_res, a_res = vx.clone(), ax.clone()  # the block updates them in place: never the stage's inputs
        with OutOfPlaceResidualAdds(v_res, a_res, private=True):
            out_v, out_a = self.block(
                (v_res, a_res), v_context=v_ctx, a_context=a_ctx, attention_mask=mask,
                v_timestep=_compressed(v_t, v_pf), a_timestep=a_t, v_pe=v_pe[0], a_pe=a_pe[0],
                v_cross_pe=v_pe[1], a_cross_pe=a_pe[1], v_cross_scale_shift_timestep=_compressed(ca_v_ss, ss_pf),
                a_cross_scale_shift_timestep=ca_a_ss, v_cross_gate_timestep=_compressed(ca_gate, gate_pf),
                a_cross_gate_timestep=ca_v2a, transformer_options={}, self_attention_mask=None,
                v_prompt_timestep=v_prompt if v_prompt.numel() else None,
                a_prompt_timestep=a_prompt if a_prompt.numel() else None)
        if self.last:
            return out_v, out_a, v_emb, a_emb, sizes
        return (out_v, out_a, v_ctx, a_ctx, text_mask, v_t, a_t, ca_a_ss, ca_v_ss, ca_gate, ca_v2a, v_prompt,
                a_prompt, v_emb, a_emb, sizes)


class LTX2Head(StageLayer):
    """Both streams' output modulation and projection (ComfyUI's ``_process_output``), packed again."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "norm_out", "proj_out", "audio_norm_out", "audio_proj_out")
        self.adopt_tensor("scale_shift_table", dm, "scale_shift_table")
        self.adopt_tensor("audio_scale_shift_table", dm, "audio_scale_shift_table")
        self._process_output = dm._process_output

    def forward(self, inputs):
        vx, ax, v_emb, a_emb, sizes = inputs
        v_shape, a_shape, (v_pf, _, _), _ = _Sizes.read(sizes, vx.shape[0])
        out = self._process_output([vx, ax], [_compressed(v_emb, v_pf), a_emb], None, orig_shape=v_shape)
        streams = out if isinstance(out, list) else [out, ax.new_zeros(a_shape)]
        return pack_streams(streams)[0]


class LTX2Adapter:
    name = "LTX2"
    options_type = LTX2Options
    stream_presets = STREAM_PRESETS  # besides the shared presets (see training/spec/choices.py)

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.transformer_blocks)
        if n == 0:
            raise ValueError("This LTX-2 model has no transformer blocks; nothing to train.")
        return [LTX2Embed(dm), *(LTX2Block(dm, i, last=i == n - 1) for i in range(n)), LTX2Head(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([LTX2Block.swappable] * len(diffusion_model.transformer_blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        """The shared presets cover both streams; ``video`` / ``audio`` one stream (see ``_TARGETS``)."""
        if preset not in _TARGETS:
            raise ValueError(f"Unknown LoRA target preset {preset!r} for LTX-2; choose one of {', '.join(_TARGETS)}.")
        return rf"transformer_blocks\.\d+\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        pt, ph, pw = (int(p) for p in diffusion_model.patchifier.patch_size)
        return Geometry(patch=(pt, ph, pw), video=True, frame_step=FRAME_STEP)

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(text encoder width, 0)``: the cache holds the text encoder's output; the embed stage runs the model's
        embeddings connectors on it (``preprocess_text_embeds``), as ``LTXAV.extra_conds`` does at sampling.

        LTX-2 (no projection before the connectors): Gemma's ``caption_channels`` features, which ComfyUI tells
        from processed ones (twice as wide) by width. Layouts projecting before the connectors: the text encoder
        gives the video and audio widths side by side and flags them unprocessed, which the embed says too."""
        dm = diffusion_model
        if dm.caption_proj_before_connector:
            return int(dm.cross_attention_dim + dm.audio_cross_attention_dim), 0
        return int(dm.caption_channels), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        dm = diffusion_model
        return {  # no text mask: the connectors bring the text to their own length, and ComfyUI hands on none
            AUDIO_LATENT: ExtraSpec(shape=(int(dm.num_audio_channels), "*", int(dm.audio_frequency_bins)),
                                    source="latent", joins_latent=True,
                                    description="the clip's audio VAE latent, packed with the video latent"),
        }

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Video tokens of the video latent (the joint latent's first stream)."""
        sizes = latent_shape[-3:] if len(latent_shape) == 4 else (1, *latent_shape[-2:])
        patch = diffusion_model.patchifier.patch_size
        out = 1
        for s, p in zip(sizes, patch, strict=True):
            out *= -(-s // int(p))
        return out

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        options = batch.options if isinstance(batch.options, LTX2Options) else LTX2Options()
        if len(batch.latent_shapes) != 2:
            raise ValueError("LTX-2 trains on the video and audio latents together; the batch has no audio latent.")
        v_shape, a_shape = batch.latent_shapes
        x, v_t = batch.noisy, batch.timestep
        a_t = batch.timestep
        if options.first_frame_clean and v_shape[2] > 1:
            if batch.clean is None:
                raise ValueError("first_frame_clean needs the clean latent in the batch.")
            vx, ax = unpack_streams(x, batch.latent_shapes)
            clean = unpack_streams(batch.clean, batch.latent_shapes)[0]
            vx, v_t = clean_first_frame_tokens(vx, clean, v_t)
            x = pack_streams([vx, ax])[0]
        tokens = torch.tensor(batch.text_lengths or [batch.cond.shape[1]] * x.shape[0], dtype=torch.int64)
        sizes = _Sizes.make(v_shape, a_shape, (0, 0, 0), frame_rate_bits(options.frame_rate))
        return x, v_t, a_t, batch.cond, tokens.view(-1, 1), sizes

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        """On the video stream: with ``first_frame_clean``, 0 on the first latent frame (the audio weighs 1)."""
        if not (isinstance(options, LTX2Options) and options.first_frame_clean):
            return None
        if len(latent_shape) != 4 or latent_shape[1] < 2:
            return None
        mask = torch.ones(1, latent_shape[1], 1, 1)
        mask[:, 0] = 0.0
        return mask

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the embed gives the connectors each caption at its own length
        (``Batch.text_lengths``), so captions of any token counts train as sampled."""
        return max(lengths)

    def run_metadata(self, diffusion_model: nn.Module, options: object) -> dict[str, str]:
        if not isinstance(options, LTX2Options):
            return {}
        out = {"ltx2.frame_rate": repr(options.frame_rate)}
        if options.first_frame_clean:
            out["ltx2.first_frame_clean"] = "true"
        return out


ADAPTER = register(LTX2Adapter(), model_classes=("LTXAV",))
