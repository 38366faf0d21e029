"""Wan 2.2 S2V (ComfyUI ``model_base.WAN22_S2V``, ``comfy.ldm.wan.model.WanModel_S2V``) as pipeline stage layers.

S2V is a Wan text-to-video model (16 latent channels) that also reads a soundtrack and a reference image:

- ``audio_embed`` ``[B, layers, audio_dim, 4 * frames]``: every hidden layer of ComfyUI's wav2vec2 audio
  encoder (``AudioEncoderEncode``), resampled by ``WanSoundImageToVideo`` to 4 audio slots per latent frame
  at 16 fps video. ``casual_audio_encoder`` weights the layers and shrinks them causally to one group of
  tokens per latent frame; after each block listed in ``audio_injector.injected_block_id`` an
  ``AudioInjector_WAN`` cross-attention adds, frame by frame, what the video tokens of that frame read
  from its audio tokens (adaptive-norm conditioned on the frame's global audio token).
- ``reference_latent`` ``[B, 16, 1, H, W]``: ``WanSoundImageToVideo``'s ``ref_image`` encoded by the VAE
  (``WAN22_S2V.extra_conds`` applies ``process_latent_in``). Patch-embedded like the video, marked with
  ``trainable_cond_mask[1]`` (the video tokens get ``[0]``), it is appended after the video tokens with
  timestep 0 and a rotary position starting at frame ``max(30, frames + 9)``; the head's output for it
  is dropped by the un-patchify.
- ``control_video``: ``WanSoundImageToVideo`` always passes one; without a control video it is the
  latent of nothing (``process_out`` of zeros, which ``extra_conds`` brings back to zeros), so the model
  always adds ``cond_encoder`` of zeros (its bias) to the patch embedding. That is what is trained.

Trained as ``WanSoundImageToVideo`` samples a first chunk: with the soundtrack and the reference image,
no control (pose) video and no motion frames (``ref_motion``, which only ``WanSoundImageToVideoExtend``
and a given ``ref_motion`` set: the frame packer then appends the previous chunk's latents). A LoRA
trained here learns the first chunk of a generation; the model class itself is unchanged for the rest.

Stage tuples (``B`` batch, ``L`` tokens: video then reference; ``a``/``g`` the causal audio encoder's
per-frame tokens ``[B, F, n, dim]`` and global tokens ``[B, F, 1, dim]``):

- embed: ``(x, timestep [B], context, audio_embed, reference_latent)`` -> ``(x, e, e0, context, sizes, a, g)``
- a block while an audio injection follows (ComfyUI's block, then its injection if it has one): the same
  tuple; the block of the last injection drops ``a`` and ``g``, the last block also ``e0`` and ``context``
- head: Wan's (``x, e, sizes``); ``e`` covers the reference frame too, as in ``forward_orig``.

``sizes`` is int64 ``(frames, height, width, ref frames, ref height, ref width, video tokens)``: each
block recomputes the rotary embedding from it with ComfyUI's own ``WanModel.rope_encode``, as
``forward_orig`` builds it once. The injection is ComfyUI's ``AudioInjector_WAN.forward``, run on a private copy of the residual stream
under :mod:`.out_of_place` (the method assigns into a slice of the stream, which autograd cannot differentiate
through after its own layer norm saved that slice); the staged forward equals
``BaseModel.apply_model`` (tests/family_rows/wan_s2v.py).

LoRA targets: the blocks' attention and FFN Linears (as Wan) plus the audio injectors' cross-attention
Linears (``audio_injector.injector.<k>.q/k/v/o``), which carry what the sound does to the picture.

Extras (built per clip by the Cache node with an audio encoder connected: training/cache/s2v_sound.py):
``audio_embed`` (required) and ``s2v_reference`` (the processed reference latent, required). A clip
without sound trains on ComfyUI's encoding of digital silence of its span, which is what
``AudioEncoderEncode`` gives for the clip's own (silent) track; ComfyUI's other no-audio path (no
``audio_embed`` at all: no injection) is a graph without any soundtrack and is not trained.

Refused before a run: models that are not ``WanModel_S2V``, Wan's ``first_frame_clean`` and ``expert``
options (S2V is one model for every noise level), and (in the cache) a frame rate other than 16 fps,
the one ``WanSoundImageToVideo`` aligns the audio to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ..cache.s2v_sound import AUDIO_EMBED, S2V_REFERENCE, S2V_SOUND_FIX
from .base import ExtraSpec, StageLayer, refuse_unsupported, register
from .out_of_place import OutOfPlaceResidualAdds
from .wan import _ATTENTION, _MLP, StartImageExtra, WanAdapter, WanHead, WanOptions, single_model_expert_problems

_INJECTOR = r"audio_injector\.injector\.\d+\.(q|k|v|o)"
_TARGETS = {"attention": _ATTENTION, "attention_mlp": rf"{_ATTENTION}|{_MLP}", "all_linear": rf"{_ATTENTION}|{_MLP}"}
AUDIO_SLOTS = 4  # audio_embed entries per latent frame (forward_orig: num_embeds = frames * 4)
REF_T_START = 30  # forward_orig: the reference frame's rotary time is max(30, frames + 9)
REF_T_GAP = 9


def injections(dm: nn.Module) -> dict[int, int]:
    """``{block index: injector index}`` for the blocks the model has, ComfyUI's ``injected_block_id``."""
    return {i: k for i, k in dm.audio_injector.injected_block_id.items() if i < len(dm.blocks)}


def _s2v_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.wan.model import WanModel_S2V

    if type(dm) is not WanModel_S2V:
        return f"{type(dm).__name__} is not ComfyUI's WanModel_S2V; the Wan S2V adapter trains only that class."
    used = injections(dm)
    if not used:
        return "This S2V model injects its audio after none of its blocks; check the file."
    if sorted(used.values()) != list(range(len(dm.audio_injector.injector))):
        return (f"This S2V model has {len(dm.audio_injector.injector)} audio injectors and ComfyUI's mapping uses "
                f"{sorted(used.values())} for its {len(dm.blocks)} blocks: ComfyUI would never run the others. "
                "Check the file.")
    if int(dm.in_dim) != int(dm.out_dim) or dm.img_emb is not None:
        return "This S2V model has an image-to-video input; Wan 2.2 S2V is a text-to-video layout."
    if not hasattr(dm, "cond_encoder"):
        return "This S2V model has no cond_encoder (cond_dim 0); Wan 2.2 S2V releases have one."
    if tuple(int(p) for p in dm.patch_size)[0] != 1:
        return "This S2V model has a temporal patch size other than 1; Wan 2.2 S2V patches frames one by one."
    return None


def _freqs(layer, sizes: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of the video tokens and then the reference tokens, as ``forward_orig`` builds it."""
    f, h, w, rf, rh, rw, _ = (int(v) for v in sizes)
    video = layer._rope_encode(layer, f, h, w, device=like.device, dtype=like.dtype, transformer_options={})
    ref = layer._rope_encode(layer, rf, rh, rw, t_start=max(REF_T_START, f + REF_T_GAP), device=like.device,
                             dtype=like.dtype)
    return torch.cat([video, ref], dim=1)


class S2VEmbed(StageLayer):
    """Audio encoder, patch embedding (+ the empty control video's), reference tokens, time and text embedding."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "patch_embedding", "time_embedding", "time_projection", "text_embedding",
                        "casual_audio_encoder", "cond_encoder", "trainable_cond_mask")
        self.patch_size = tuple(int(p) for p in dm.patch_size)
        self.freq_dim, self.dim = dm.freq_dim, dm.dim

    def forward(self, inputs):
        import comfy.ldm.common_dit
        import comfy.model_management
        from comfy.ldm.wan.model import sinusoidal_embedding_1d

        x, t, context, audio_embed, ref = inputs
        f, h, w = x.shape[-3:]
        slots = f * AUDIO_SLOTS
        if audio_embed.shape[-1] < slots:
            raise ValueError(f"audio_embed {list(audio_embed.shape)} has {audio_embed.shape[-1]} audio frames for "
                             f"{f} latent frames (needs {slots}): cache the clips again with the audio encoder.")
        g_audio, a_audio = self.casual_audio_encoder(audio_embed[:, :, :, :slots])
        control = torch.zeros((x.shape[0], self.cond_encoder.in_channels, f, h, w), dtype=x.dtype, device=x.device)
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch_size)
        x = self.patch_embedding(x.float()).to(x.dtype)
        x = x + self.cond_encoder(control)
        frames = x.shape[2]
        x = x.flatten(2).transpose(1, 2)
        seq_len = x.shape[1]
        mark = comfy.model_management.cast_to(self.trainable_cond_mask.weight, dtype=x.dtype, device=x.device)
        mark = mark.unsqueeze(1).unsqueeze(1)
        r = self.patch_embedding(ref.float()).to(x.dtype).flatten(2).transpose(1, 2)
        x = torch.cat([x + mark[0], r + mark[1]], dim=1)
        t = t.unsqueeze(1).repeat(1, frames) if t.ndim == 1 else t
        t = torch.cat([t, torch.zeros((t.shape[0], ref.shape[-3]), device=t.device, dtype=t.dtype)], dim=1)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype))
        e = e.reshape(t.shape[0], -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))
        context = self.text_embedding(context)
        sizes = torch.tensor([f, h, w, *ref.shape[-3:], seq_len], dtype=torch.int64, device=x.device)
        return x, e, e0, context, sizes, a_audio, g_audio


class S2VBlock(StageLayer):
    """One Wan attention block, then its audio injection if ComfyUI maps one to it.

    ``carry``: the audio tokens continue after this layer (an injection follows)."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int, injector: int | None, carry: bool, last: bool):
        super().__init__()
        self.adopt("block", dm.blocks[index], f"blocks.{index}")
        self.rope_embedder = dm.rope_embedder  # read by ComfyUI's WanModel.rope_encode (no parameters)
        self.patch_size = tuple(dm.patch_size)
        self.dim, self.num_heads = dm.dim, dm.num_heads
        self._rope_encode = type(dm).rope_encode
        self.carry, self.last = carry, last
        self.injects = injector is not None
        if injector is not None:
            inj = dm.audio_injector
            self.index = index
            self._inject_forward = inj.forward  # ComfyUI's AudioInjector_WAN.forward, over the modules adopted here
            self.adopt("inject_attn", inj.injector[injector], f"audio_injector.injector.{injector}")
            if inj.enable_adain and inj.adain_mode == "attn_norm":
                self.adopt("inject_norm", inj.injector_adain_layers[injector],
                           f"audio_injector.injector_adain_layers.{injector}")
            else:
                self.adopt("inject_norm", inj.injector_pre_norm_feat[injector],
                           f"audio_injector.injector_pre_norm_feat.{injector}")

    def _inject(self, x: torch.Tensor, audio: torch.Tensor, audio_global: torch.Tensor, seq_len: int) -> torch.Tensor:
        """ComfyUI's injection, which assigns into a slice of the residual stream: on a private copy (every other
        use of the copy reads a snapshot, so nothing autograd saved is overwritten)."""
        x = x.clone()
        with OutOfPlaceResidualAdds(x, private=True):
            return self._inject_forward(x, self.index, audio, audio_global, seq_len)

    def forward(self, inputs):
        x, e, e0, context, sizes, *audio = inputs
        freqs = _freqs(self, sizes, x)
        with OutOfPlaceResidualAdds(x):
            x = self.block(x, e=e0, freqs=freqs, context=context, context_img_len=None, transformer_options={})
        if self.injects:
            x = self._inject(x, audio[0], audio[1], int(sizes[6]))
        if self.last:
            return x, e, sizes
        return (x, e, e0, context, sizes, *audio) if self.carry else (x, e, e0, context, sizes)


class WanS2VAdapter(WanAdapter):
    """Wan 2.2 S2V: Wan's geometry, text conditioning and schedule, plus the soundtrack and the reference image."""

    name = "WanS2V"
    options_type = WanOptions
    presets = ()

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _s2v_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        mapping = injections(dm)
        last_injection, n = max(mapping), len(dm.blocks)
        blocks = [S2VBlock(dm, i, mapping.get(i), carry=i < last_injection, last=i == n - 1) for i in range(n)]
        return [S2VEmbed(dm), *blocks, WanHead(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        return [False, *([S2VBlock.swappable] * len(diffusion_model.blocks)), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"blocks\.\d+\.({_TARGETS[preset]})|{_INJECTOR}"

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        dm = diffusion_model
        width = int(dm.casual_audio_encoder.encoder.conv1_local.conv.in_channels)
        return {
            AUDIO_EMBED: StartImageExtra(
                shape=("*", width, "*"),
                description="the soundtrack's audio-encoder features (AudioEncoderEncode, then WanSoundImageToVideo's "
                            "audio_embed)",
                fix=S2V_SOUND_FIX),
            S2V_REFERENCE: StartImageExtra(
                shape=("C", 1, "H", "W"),
                description="the reference image latent (the clip's first frame, WanSoundImageToVideo's ref_image "
                            "after WAN22_S2V.extra_conds)",
                fix=S2V_SOUND_FIX),
        }

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """The video's patches plus the reference frame's."""
        video = super().image_tokens(diffusion_model, latent_shape)
        return video + math.prod(-(-s // int(p)) for s, p in zip(latent_shape[-2:], diffusion_model.patch_size[1:],
                                                                 strict=True))

    def first_stage_inputs(self, batch) -> tuple[torch.Tensor, ...]:
        options = batch.options if isinstance(batch.options, WanOptions) else WanOptions()
        if options.first_frame_clean:
            raise ValueError("first_frame_clean is for Wan 2.2 TI2V-5B; an S2V model takes its image through the "
                             "reference latent: leave first_frame_clean off.")
        missing = [n for n in (AUDIO_EMBED, S2V_REFERENCE) if batch.extras.get(n) is None]
        if missing:
            raise ValueError(f"A Wan S2V model needs {' and '.join(missing)} for every example: {S2V_SOUND_FIX}.")
        dtype = batch.noisy.dtype
        return (batch.noisy, batch.timestep, batch.cond, batch.extras[AUDIO_EMBED].to(dtype),
                batch.extras[S2V_REFERENCE].to(dtype))

    def preflight_problems(self, diffusion_model: nn.Module, facts) -> list[str]:
        """Wan's option checks, plus: S2V is one model for every noise level."""
        return super().preflight_problems(diffusion_model, facts) + single_model_expert_problems(facts.options,
                                                                                                  "Wan 2.2 S2V")


ADAPTER = register(WanS2VAdapter(), model_classes=("WAN22_S2V",))
