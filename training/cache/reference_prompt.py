"""Reference images in the text encoder's prompt, for edit models whose text encoder sees them.

Qwen-Image-Edit's text encoder (Qwen2.5-VL) reads the reference image(s) together with the instruction:
at sampling, ComfyUI's ``TextEncodeQwenImageEdit(Plus)`` nodes put each image into a templated prompt
(through ``clip.tokenize(text, images=...)``). An edit LoRA trained on text-only embeddings would learn
under other conditioning than it samples with. With the Cache node's ``reference_in_prompt`` on, each
caption of an edit dataset is encoded with its item's reference images by the same ComfyUI node the
user samples with (a *style*: the node, its template, its pixel budget), so the cached conditioning is
that node's output for the caption and the reference files as ``Load Image`` reads them.

Which text encoders take images, and through which nodes, is family policy: a family adapter may list
``reference_prompts`` (its :class:`PromptStyle` s, the first one being what ``auto`` picks) and say with
``takes_reference_prompt(clip)`` whether a ComfyUI ``CLIP`` is its image-reading text encoder. Nothing
here names a family.

Keys (keys.py): the style's identity and the reference images' content digests join the text key only
when a caption is encoded with its references, so a changed reference re-encodes that item's text (as
it re-encodes its latent), and caches made with the option off, or without references, keep their keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

AUTO = "auto"
OFF = "off"


@dataclass(frozen=True)
class PromptStyle:
    """How one ComfyUI text-encode node puts reference images into the prompt.

    ``conditioning(clip, caption, images)`` returns that node's CONDITIONING for the caption and the images
    (``[1, H, W, 3]`` each, in reference order) without a VAE (the cache encodes the reference latents
    itself). ``version`` is part of the text key: bump it when ``conditioning`` changes what it encodes.

    ``size(image, width, height)``, where the node sizes each reference against the target it generates
    (``width`` x ``height``, the item's bucket) before it both prompts with it and VAE-encodes it: the
    pixels it prompts with and encodes. The cache then encodes each reference latent at that size, and the
    bucket joins the text key and the latent key. Without it a reference latent covers the item's bucket
    and the node is given the reference whole."""

    name: str  # the Cache node's option value
    node: str  # the ComfyUI node whose conditioning it is
    max_images: int
    version: int
    conditioning: Callable[[object, str, list[torch.Tensor]], list]
    size: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    max_audio: int = 0  # reference audio files the node takes (their labels join the prompt, after the pictures)
    max_videos: int = 0  # reference videos the node takes, after the pictures and before the audio
    size_video: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # (frames, target frames): as the node
    # sizes and cuts a reference video for a clip of that many frames; what it prompts with and encodes

    def identity(self) -> dict[str, object]:
        return {"style": self.name, "node": self.node, "v": self.version}

    def identity_at(self, width: int, height: int) -> dict[str, object]:
        """The identity of captions and references encoded for a ``width`` x ``height`` target: the bucket
        counts only for a style that sizes its references against it."""
        return {**self.identity(), "target": [width, height]} if self.size else self.identity()


@dataclass(frozen=True)
class AudioInPrompt:
    """A reference audio's place among the items a style's ``conditioning`` gets: its node labels it in the prompt
    (MiniMax-H3: ``<Audio j>: ``) and its text encoder hears none of it."""


@dataclass(frozen=True, eq=False)
class VideoInPrompt:
    """A reference video among the items a style's ``conditioning`` gets: its frames as the node sized and cut them
    (``PromptStyle.size_video``) and whether its sound track goes with it (the node labels the track first)."""

    frames: torch.Tensor
    with_sound: bool


def _adapters() -> list:
    from ..pipelines.base import adapter_for, known_families

    return [adapter_for(family) for family in known_families()]


def all_styles() -> list[PromptStyle]:
    """Every style a registered family offers, in family order."""
    return [style for adapter in _adapters() for style in getattr(adapter, "reference_prompts", ())]


def modes() -> list[str]:
    """The Cache node's ``reference_in_prompt`` choices: auto, off and each style by name."""
    return [AUTO, OFF, *(s.name for s in all_styles())]


def styles_for(clip) -> list[PromptStyle]:
    """The styles of the family whose image-reading text encoder ``clip`` is (none for a text-only one)."""
    return [style for adapter in _adapters()
            if getattr(adapter, "takes_reference_prompt", None) is not None and adapter.takes_reference_prompt(clip)
            for style in getattr(adapter, "reference_prompts", ())]


def choose(mode: str, clip, references: Sequence[tuple[str, int]], audio: Sequence[tuple[str, int]] = (),
           videos: Sequence[tuple[str, int]] = ()) -> tuple[PromptStyle | None, list[str]]:
    """The style the Cache encodes captions with (``None``: text only), or the problems, phrased as the fix.

    ``references``: ``(file name, reference image count)`` of each dataset item, ``audio`` and ``videos`` its
    reference audio and video counts. ``auto`` is the family's first style for an image-reading text encoder and a
    dataset with references, otherwise off. Reference audio and videos need a style whose node takes them."""
    known = modes()
    if mode not in known:
        return None, [f"reference_in_prompt must be one of {', '.join(known)} (got {mode!r})."]
    media = {"audio": ([(n, k) for n, k in audio if k], "max_audio"),
             "videos": ([(n, k) for n, k in videos if k], "max_videos")}
    with_media = media["audio"][0] + media["videos"][0]
    unheard = [_media_problem(kind, items) for kind, (items, _) in media.items() if items]
    if mode == OFF:
        return None, unheard
    offered = styles_for(clip)
    with_refs = [(name, n) for name, n in references if n]
    if mode == AUTO:
        if not offered or not (with_refs or with_media):
            return None, unheard
        style = offered[0]
    else:
        style = next((s for s in offered if s.name == mode), None)
        if style is None:
            node = next(s.node for s in all_styles() if s.name == mode)
            return None, [f"reference_in_prompt {mode} encodes captions as ComfyUI's {node} does, which needs that "
                          f"node's text encoder; the connected CLIP ({type(clip.cond_stage_model).__name__}) takes no "
                          "images: connect the edit model's text encoder, or set reference_in_prompt to auto or off."]
        if not (with_refs or with_media):
            return None, [f"reference_in_prompt {mode} puts each item's reference images into its prompt, but the "
                          "dataset has none: set the Dataset node's control_folder, or set reference_in_prompt to "
                          "auto or off."]
    over = [f"{name} ({n})" for name, n in with_refs if n > style.max_images]
    if over:
        shown = ", ".join(over[:10]) + (f" and {len(over) - 10} more" if len(over) > 10 else "")
        wider = [s.name for s in offered if s.max_images >= max(n for _, n in with_refs)]
        fix = f"set reference_in_prompt to {' or '.join(wider)}, " if wider else ""
        return None, [f"ComfyUI's {style.node} (reference_in_prompt {style.name}) takes at most {style.max_images} "
                      f"reference image(s), and these items have more: {shown}. Fix: {fix}remove their extra "
                      "references, or set reference_in_prompt to off."]
    for kind, (items, limit) in media.items():
        most = getattr(style, limit)
        if items and not most:
            return None, [_media_problem(kind, items)]
        over = [f"{name} ({n})" for name, n in items if n > most]
        if over:
            return None, [f"ComfyUI's {style.node} takes at most {most} reference {kind}, and these items have more: "
                          f"{', '.join(over[:10])}. Remove the extra ones from the control folder."]
    return style, []


def _media_problem(kind: str, items: Sequence[tuple[str, int]]) -> str:
    named = ", ".join(name for name, _ in items[:5]) + (" and more" if len(items) > 5 else "")
    return f"{named} have reference {kind} in the Dataset node's control folder: {media_fix(kind)}"


def load_reference(path: str) -> torch.Tensor:
    """A reference image as ComfyUI's ``Load Image`` hands it on: EXIF rotation applied, RGB, ``[1, H, W, 3]``
    floats in [0, 1] (the whole picture: the prompt node scales it to its own pixel budget).

    Decoded with Pillow, like every image the cache reads: the same pixels as ``Load Image`` on ComfyUI
    0.3.75, and for PNG files on current ComfyUI too (checked in the tests); current ComfyUI decodes
    JPEG files with PyAV, whose pixels differ a little from Pillow's."""
    with Image.open(path) as img:
        rgb = ImageOps.exif_transpose(img).convert("RGB")
        return torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0)[None]


def media_fix(kind: str) -> str:
    """What makes reference ``kind`` ("audio" or "videos") usable: the styles whose nodes take it."""
    takers = [s for s in all_styles() if (s.max_audio if kind == "audio" else s.max_videos)]
    if not takers:
        return f"no model here takes reference {kind}; remove those files from the control folder."
    nodes = " or ".join(dict.fromkeys(s.node for s in takers))
    names = " or ".join(s.name for s in takers)
    return (f"only {nodes} takes reference {kind}: connect that model's text encoder to 'Cache Latents & Text' with "
            f"reference_in_prompt auto or {names}, or remove those files from the control folder.")
