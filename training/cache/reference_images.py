"""An item's reference images as one cache run reads them: their pixels, their latents, their part of the keys.

Reference images (the Dataset node's control folder) are encoded with the item's VAE into its latent entry as
``reference_0``, ``reference_1``, ... (raw latents ``[C, h, w]``). By default each is resized to cover the item's own
bucket and center-cropped like the item, so it has the target's latent size: the edit models (Kontext,
Qwen-Image-Edit) take a reference of the target's size, and the references of one bucket stack into a micro-batch
without padding. A reference-in-prompt style whose node sizes the references itself, against the target it generates
(``PromptStyle.size``: MiniMax-H3's ``MiniMaxH3ReferenceToVideo``), has them at that node's size instead, for the
latent and for the prompt alike; the style's identity then joins the item's preprocessing (the latent key) and the
bucket its prompt signature (the text key), since both depend on it. Items whose references differ in size stack
apart (the micro-batch groups by the latent entry's shapes).

The references' content digests are part of the latent key either way: a changed reference re-encodes exactly its
item (target and references, one entry).

Reference audio (audio files among an item's references, after its pictures; the Dataset node's control folder) is
for a style whose node takes it (``PromptStyle.max_audio``: MiniMax-H3's ``ref_audios``): each file whole, at the
audio VAE's rate, encoded with the Cache node's audio VAE as ``ref_audio_0``, ``ref_audio_1``... (clip_sound.py
``encode_reference``); in the prompt it is a label only (:class:`AudioInPrompt`). Its reading joins the latent key
(:meth:`ReferenceImages.key_part`) beside the audio VAE's identity, which the clip's own sound already puts there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from ..data.dataset import is_audio
from ..pipelines.base import reference_audio_extra, reference_extra
from .buckets import Bucket, crop_fraction
from .keys import prompt_signature
from .media import load_image
from .reference_prompt import AudioInPrompt, PromptStyle, audio_fix, load_reference

_AUDIO_READING = {"read": "whole file, the audio VAE's rate and channels", "v": 1}


def audio_problem(entries: Sequence[object], style: PromptStyle | None, sound_active: bool) -> str | None:
    """Why the items' reference audio cannot be cached as asked (None: there is none, or it can)."""
    with_audio = [os.path.basename(e.path) for e in entries if any(is_audio(r) for r in e.references)]
    if not with_audio:
        return None
    named = ", ".join(with_audio[:5]) + (f" and {len(with_audio) - 5} more" if len(with_audio) > 5 else "")
    if style is None or not style.max_audio:
        return f"{named} have reference audio in the control folder: {audio_fix()}"
    if not sound_active:
        return (f"{named} have reference audio, which is encoded with the model's audio VAE: connect it to the Cache "
                "node's audio_vae input.")
    return None



class ReferenceImages:
    """The references of one cache run, read for ``style`` (the Cache node's reference_in_prompt; None: off)."""

    def __init__(self, style: PromptStyle | None):
        self.style = style
        self.sized = style is not None and style.size is not None

    def prep(self) -> dict[str, object]:
        """What joins a bucket's preprocessing: how the references are sized, when a style's node sizes them."""
        return {"references": self.style.identity()} if self.sized else {}

    def prompt_signature(self, bucket: Bucket, signature: str) -> str:
        """The prompt signature of an item's texts at ``bucket`` (``signature``: the run's, bucket-free one)."""
        return prompt_signature(self.style.identity_at(bucket.width, bucket.height)) if self.sized else signature

    def crop_notes(self, item: str, paths: Sequence[str], probes: Sequence[object], bucket: Bucket,
                   threshold: float) -> list[str]:
        """References losing more than ``threshold`` of their area to the crop at ``bucket`` (sized ones lose none)."""
        if self.sized:
            return []
        notes = []
        for path, probe in zip(paths, probes, strict=True):
            if is_audio(path):
                continue
            lost = crop_fraction(probe.width, probe.height, bucket)
            if lost > threshold:
                notes.append(f"{os.path.basename(path)} (reference of {item}): {lost:.0%} is cropped away to fit its "
                             f"target's bucket {bucket.name}; give references the target's aspect ratio.")
        return notes

    def prompt_pixels(self, path: str, bucket: Bucket) -> torch.Tensor:
        """A reference ``[1, H, W, 3]`` as the style's node takes it for ``bucket``: whole (the node scales it
        itself), or sized against the target as the style's ``size`` says."""
        image = load_reference(path)
        return self.style.size(image, bucket.width, bucket.height) if self.sized else image

    def prompt_items(self, paths: Sequence[str], bucket: Bucket) -> list[torch.Tensor | AudioInPrompt]:
        """What the style's node puts in the prompt for the references ``paths``: each picture's pixels
        (:meth:`prompt_pixels`), each audio's label."""
        return [AudioInPrompt() if is_audio(path) else self.prompt_pixels(path, bucket) for path in paths]

    @staticmethod
    def key_part(paths: Sequence[str]) -> dict[str, object]:
        """What joins an item's latent key for its reference audio (how it is read; none without any)."""
        return {"reference_audio": _AUDIO_READING} if any(is_audio(p) for p in paths) else {}

    def encode(self, paths: Sequence[str], bucket: Bucket, encode_latent: Callable[[torch.Tensor], torch.Tensor],
               encode_audio: Callable[[str], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Each reference picture's latent (one frame) and each reference audio's (``encode_audio``), an error
        naming the reference that failed."""
        size = Bucket(bucket.width, bucket.height)
        out = {}
        sounds = [path for path in paths if is_audio(path)]
        for j, path in enumerate(sounds):
            out[reference_audio_extra(j)] = encode_audio(path)
        for i, path in enumerate(p for p in paths if not is_audio(p)):
            try:
                pixels = self.prompt_pixels(path, size) if self.sized else load_image(path, size)
            except Exception as exc:  # noqa: BLE001 - named in the skip reason instead of the item's own file
                raise ValueError(f"reference {os.path.basename(path)}: {type(exc).__name__}: {exc}") from exc
            latent = encode_latent(pixels)
            out[reference_extra(i)] = latent[:, 0] if latent.ndim == 4 and latent.shape[1] == 1 else latent
        return out
