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

Reference videos and audio among an item's references (MiniMax-H3's) are read by reference_media.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from ..pipelines.base import reference_extra
from .buckets import Bucket, crop_fraction
from .keys import prompt_signature
from .media import load_image
from .reference_media import ReferenceMedia, is_media
from .reference_prompt import AudioInPrompt, PromptStyle, VideoInPrompt, load_reference


class ReferenceImages:
    """The references of one cache run, read for ``style`` (the Cache node's reference_in_prompt; None: off)."""

    def __init__(self, style: PromptStyle | None, fps: float = 24.0):
        self.style = style
        self.sized = style is not None and style.size is not None
        self.media = ReferenceMedia(style, fps)  # the reference videos and audio among them

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
            if is_media(path):
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

    def prompt_items(self, paths: Sequence[str], bucket: Bucket) -> list[torch.Tensor | VideoInPrompt | AudioInPrompt]:
        """What the style's node puts in the prompt for the references ``paths``: each picture's pixels
        (:meth:`prompt_pixels`), each video's frames, each audio's label."""
        return [self.media.prompt_item(p, bucket) if is_media(p) else self.prompt_pixels(p, bucket) for p in paths]

    def key_part(self, paths: Sequence[str]) -> dict[str, object]:
        """What joins an item's latent key for its reference videos and audio (how they are read; none without)."""
        return self.media.key_part(paths)

    def encode(self, paths: Sequence[str], bucket: Bucket, encode_latent: Callable[[torch.Tensor], torch.Tensor],
               encode_audio: Callable[[str], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Each reference picture's latent (one frame), each reference video's and each sound's (``encode_audio``),
        an error naming the reference that failed."""
        size = Bucket(bucket.width, bucket.height)
        out = self.media.encode(paths, bucket, encode_latent, encode_audio)
        for i, path in enumerate(p for p in paths if not is_media(p)):
            try:
                pixels = self.prompt_pixels(path, size) if self.sized else load_image(path, size)
            except Exception as exc:  # noqa: BLE001 - named in the skip reason instead of the item's own file
                raise ValueError(f"reference {os.path.basename(path)}: {type(exc).__name__}: {exc}") from exc
            latent = encode_latent(pixels)
            out[reference_extra(i)] = latent[:, 0] if latent.ndim == 4 and latent.shape[1] == 1 else latent
        return out
