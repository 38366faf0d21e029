"""MiniMax-H3's condition inputs besides its text and its clip's sound: the first/last-frame keyframes
(``MiniMaxH3ImageToVideo``) and the references of ``MiniMaxH3ReferenceToVideo`` (pictures, videos with their sound
tracks, audio), as the cache stores them, and the check that their captions were encoded as those nodes encode
them. training/pipelines/minimax_h3.py declares and feeds them; minimax_h3_layout.py packs them."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..cache.clip_sound import GUIDE_AUDIO
from ..cache.start_image_prompt import START_IMAGE_PROMPT
from .base import ExtraSpec, reference_audio_extra, reference_extra, reference_video_audio_extra, reference_video_extra
from .minimax_h3_layout import KEYFRAMES, REF_IMAGE, REF_VIDEO, VIDEO_TAG, Conditions
from .minimax_h3_prompt import REFERENCES_STYLE

MAX_REFERENCES = 9  # MiniMaxH3ReferenceToVideo's ref_images
MAX_REFERENCE_AUDIO = MAX_REFERENCE_VIDEOS = 3  # and its ref_audios, ref_videos


def condition_extras(dm) -> dict[str, ExtraSpec]:
    """The optional extras of the keyframes and the references, for the model ``dm``: its latents stay float32, as
    ``MiniMaxH3.extra_conds`` keeps them (its payload skips ``_apply_model``'s dtype cast)."""
    out = {}
    for name, frame in zip(KEYFRAMES, ("first", "last"), strict=True):
        out[name] = ExtraSpec(shape=("C", "*", "H", "W"), required=False, keeps_float32=True,
                              description=f"the clip's {frame} frame encoded alone (MiniMaxH3ImageToVideo's "
                                          f"{frame}_frame), a keyframe condition")
    out[GUIDE_AUDIO] = ExtraSpec(shape=(int(dm.audio_latents_dim), 2, "*"), required=False, keeps_float32=True,
                                 description="the clip's sound as MiniMaxH3AddGuide's audio guide at frame 0 (the "
                                             "Cache node's audio_guide clip_sound), a condition")
    out[START_IMAGE_PROMPT] = ExtraSpec(shape=(1,), source="text", required=False,
                                        description="the image tokens of the frames in the caption's prompt")
    for i in range(MAX_REFERENCES):
        out[reference_extra(i)] = ExtraSpec(
            shape=("C", "*", "*"), required=False, keeps_float32=True,
            description=f"reference image {i + 1} at its own size (MiniMaxH3ReferenceToVideo's ref_image_{i}, "
                        f"<Picture {i + 1}> in the prompt), a condition")
    for i in range(MAX_REFERENCE_VIDEOS):
        out[reference_video_extra(i)] = ExtraSpec(
            shape=("C", "*", "*", "*"), required=False, keeps_float32=True,
            description=f"reference video {i + 1} sized and cut as MiniMaxH3ReferenceToVideo does (its ref_video_"
                        f"{i}, <Video {i + 1}> in the prompt), a condition")
        out[reference_video_audio_extra(i)] = ExtraSpec(
            shape=(int(dm.audio_latents_dim), 2, "*"), required=False, keeps_float32=True,
            description=f"reference video {i + 1}'s sound track, whole (ref_video_audio_{i}), a condition")
    for i in range(MAX_REFERENCE_AUDIO):
        out[reference_audio_extra(i)] = ExtraSpec(
            shape=(int(dm.audio_latents_dim), 2, "*"), required=False, keeps_float32=True,
            description=f"reference audio {i + 1}, the whole file (MiniMaxH3ReferenceToVideo's ref_audio_{i}, "
                        f"<Audio {i + 1}> in the prompt), a condition")
    return out


def five_d(latent: torch.Tensor) -> torch.Tensor:
    """A condition latent as ``_cond_video_rows`` patchifies it: ``[B, C, T, H, W]`` (a cached reference image is
    ``[B, C, H, W]``, one frame)."""
    return latent.unsqueeze(2) if latent.ndim == 4 else latent


def condition_problem(conditions: Conditions, extras: Mapping[str, torch.Tensor], tags: torch.Tensor,
                      tokens: torch.Tensor) -> str | None:
    """Condition latents whose captions were not encoded as the node that makes those latents encodes them."""
    refs = conditions.references
    keyframes, references = bool(conditions.keyframes.which), bool(refs.count(REF_IMAGE) + refs.count(REF_VIDEO))
    if keyframes and conditions.references.blocks:
        return ("This MiniMax-H3 cache has first/last keyframes and reference images together, which no one ComfyUI "
                "node makes (MiniMaxH3ImageToVideo or MiniMaxH3ReferenceToVideo): set the Cache node's start_image "
                "off or clear the Dataset node's control_folder, and cache again.")
    if keyframes and START_IMAGE_PROMPT not in extras:
        return ("This MiniMax-H3 cache has keyframe latents but captions encoded without the frames in the prompt, "
                "which MiniMaxH3ImageToVideo always puts there: cache again with start_image first_last_frames (or "
                "first_keyframe, last_keyframe) and "
                "MiniMax-H3's text encoder on 'Cache Latents & Text'.")
    if references and not all(bool((row[:int(n)] == VIDEO_TAG).any())  # each caption has its pictures' tokens
                              for row, n in zip(tags, tokens.view(-1), strict=True)):
        return ("This MiniMax-H3 cache has reference images or videos but captions encoded without them in the "
                "prompt, which "
                "MiniMaxH3ReferenceToVideo always puts there: connect MiniMax-H3's text encoder (Load CLIP type "
                f"minimax) to 'Cache Latents & Text', set its reference_in_prompt to auto or {REFERENCES_STYLE}, and "
                "cache again.")
    return None


