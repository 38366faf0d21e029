"""Which entries the cache holds for each dataset item, decided before anything is encoded.

Two places need that answer: the cache itself (store.py), which keys and encodes the entries, and the
Cache node's disk estimate (nodes/checks/preflight.py), which counts them before the first encode.
Both ask this module, so the estimate cannot count other captions, variants or masks than the cache
writes. It is pure Python (no torch): the node layer imports it in ComfyUI's process.

Caption options (the Dataset node's, training/data/captions.py): each tag-shuffle variant of a caption
is a text entry of its own, keyed by its text like any caption (the first is the item's ``text_key``),
every text behind the dataset's prompt prefix; with caption dropout the empty caption is encoded once,
as ``CLIPTextEncode`` encodes ``""``. With the options off the plan is what it was, so the keys are too.

The Cache node's ``reference_in_prompt`` (reference_prompt.py) encodes each caption of an item with
references together with its reference images, as the edit model's ComfyUI text-encode node does; the
style and the references' digests then join the text key, so equal captions of items with other
references are entries of their own, and a changed reference re-encodes its item's text as well as
its latent.

An item's latent entry holds its latent, one image latent per reference image (edit datasets), and
the Dataset node's variants (masks.py): with flip the latent of the mirrored pixels, with a mask the
loss mask (one channel on the latent grid). The variants join the latent key only when they are on.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..data.captions import CaptionOptions
from ..data.dataset import ImageEntry, is_picture, is_video
from .buckets import Bucket
from .keys import text_key

KeyedTexts = tuple[tuple[str, str], ...]  # (key, text) of each text entry


# ---- text entries ------------------------------------------------------------------------------
def caption_texts(captions: CaptionOptions, caption: str) -> tuple[str, ...]:
    """The texts cached for one caption, one text entry each: the caption behind the prompt prefix, or
    its distinct tag-shuffled variants (training/data/captions.py)."""
    return captions.variants(caption)


def empty_caption(captions: CaptionOptions) -> str | None:
    """The text of the empty-caption entry caption dropout trains on (the prompt prefix, else ``""``),
    or None without dropout: no such entry is cached."""
    return captions.empty_text() if captions.dropout > 0 else None


def prompt_references(references: tuple[str, ...], in_prompt: bool) -> tuple[str, ...]:
    """The references a text is encoded with, which then tell its entry apart from an equal text of
    another item: the item's own with ``reference_in_prompt`` on, none when captions are encoded alone."""
    return tuple(references) if in_prompt else ()


def keyed_texts(texts: Iterable[str], text_sig: str, text_dtype: str, prompt_sig: str = "",
                references: tuple[str, ...] = ()) -> KeyedTexts:
    """(key, text) of each text, as keys.text_key keys them: with the reference-in-prompt style
    (``prompt_sig``, keys.prompt_signature) and the references' digests only when both are present."""
    refs = prompt_references(references, bool(prompt_sig))
    prompted = (prompt_sig, refs) if refs else ()
    return tuple((text_key(text, text_sig, text_dtype, *prompted), text) for text in texts)


def text_entries(entries: Iterable[ImageEntry], captions: CaptionOptions, references_in_prompt: bool) -> list[str]:
    """The text of every distinct text entry a cache of ``entries`` holds: each caption text (each
    tag-shuffled variant its own), and with caption dropout the empty caption; an item's references
    tell its texts apart when ``references_in_prompt`` (by path here: at most as many as by content)."""
    seen: dict[tuple[str, tuple[str, ...]], None] = {}
    empty = empty_caption(captions)
    for entry in entries:
        refs = prompt_references(tuple(getattr(entry, "references", ())), references_in_prompt)
        seen.update(((text, refs), None) for text in caption_texts(captions, entry.caption))
        if empty is not None:
            seen[(empty, refs)] = None
    return [text for text, _ in seen]


# ---- latent entries ----------------------------------------------------------------------------
def caches_flip(flip: str) -> bool:
    """Whether the Dataset node's ``flip`` option caches a mirrored latent per item."""
    return flip != "none"


def caches_mask(mask: str) -> bool:
    """Whether the Dataset node's ``mask`` option caches a loss mask per item."""
    return mask != "none"


def latent_variants(flip: str, mask: str, mask_digest: str = "") -> dict:
    """What the latent key records of an item's variants (empty with both options off: old keys).

    ``mask_digest``: content digest of the item's mask file (``mask="folder"``); an alpha mask comes
    from the source's own bytes, already in the key."""
    out: dict = {}
    if caches_flip(flip):
        out["flip"] = "horizontal"
    if mask == "folder":
        out["mask"] = {"mode": "folder", "file": mask_digest}
    elif mask == "alpha":
        out["mask"] = {"mode": "alpha"}
    return out


VACE_CONTEXT_CHANNELS = 96  # vace_control.py: 2 x 16 Wan 2.1 latent channels + 8 x 8 mask cells


@dataclass(frozen=True)
class LatentLayout:
    """What one item's latent entry holds at one resolution, besides its family's extras."""

    latents: int  # latents of the item's pixels: its own, and the mirrored one with flip
    references: int  # single-frame image latents, one per reference image
    mask_channels: int  # the loss mask: one channel on the latent grid, for a clip too
    control_channels: int = 0  # VACE vace_context per latent frame: 2 latents and the 64-channel folded mask, per stream
    reference_frames: int = 0  # a VACE reference image: one more latent and control frame, a per-frame loss mask

    def elements(self, channels: int, frames: int, cells: int) -> int:
        """Elements of the entry for a latent of ``channels`` x ``frames`` over ``cells`` grid cells."""
        per_frame = channels * self.latents + self.control_channels
        grown = frames + self.reference_frames
        mask = grown if self.reference_frames else self.mask_channels
        return (per_frame * grown + channels * self.references + mask) * cells


def latent_layout(entry: ImageEntry, flip: str, mask: str) -> LatentLayout:
    """The latent entry of ``entry`` under the Dataset node's flip and mask options."""
    refs = getattr(entry, "references", ())
    videos = sum(map(is_video, refs))  # about a clip's latent each; reference audio is small: not counted
    return LatentLayout(latents=(2 if caches_flip(flip) else 1) + videos, references=sum(map(is_picture, refs)),
                        mask_channels=1 if caches_mask(mask) else 0,
                        **_control_layout(entry))


def _control_layout(entry: ImageEntry) -> dict[str, int]:
    """The VACE part of the layout: one context per control stream, and the reference frame (vace_control.py)."""
    if not getattr(entry, "controls", ()):
        return {}
    from ..data.dataset_controls import control_set

    controls = control_set(entry.path, entry.controls)
    return {"control_channels": VACE_CONTEXT_CHANNELS * len(controls.streams),
            "reference_frames": 1 if controls.reference else 0}


# ---- the plan of one item ----------------------------------------------------------------------
@dataclass(frozen=True)
class ItemPlan:
    """The entries of one item at one resolution, as keyed before encoding."""

    entry: ImageEntry
    slot: int  # resolution index
    bucket: Bucket
    digest: str  # the source's content digest
    prep: dict
    latent_key: str
    text_key: str
    references: tuple[str, ...] = ()  # content digests of the entry's reference images
    texts: KeyedTexts = ()  # (key, text) of each tag-shuffle variant, text_key's first
    variant: int = 0  # which variant this plan encodes (its text slot); -1: the empty caption
    variants_sig: str = ""  # keys.variants_signature of its flip and mask latents ("" = none)
    prompt_sig: str = ""  # keys.prompt_signature its texts were keyed with when its references join them ("" = none)

    @property
    def text(self) -> str:
        """What this plan's text entry encodes."""
        return self.texts[0][1] if self.texts else self.entry.caption

    def text_plans(self) -> list[ItemPlan]:
        """One plan per text entry of the item (its tag-shuffle variants), each encoding its own text."""
        if len(self.texts) < 2:
            return [self]
        return [dataclasses.replace(self, text_key=k, texts=((k, t),), variant=i)
                for i, (k, t) in enumerate(self.texts)]

    @property
    def bucket_name(self) -> str:
        """Items of a bucket stack: with references, their count is part of the bucket."""
        refs = len(self.entry.references)
        return f"{self.bucket.name}+{refs}ref" if refs else self.bucket.name


def empty_caption_plans(planned: list[ItemPlan], captions: CaptionOptions, folder: str, text_sig: str,
                        text_dtype: str, prompt_sig: str = "") -> list[ItemPlan | None]:
    """With caption dropout, the plan of each item's empty-caption entry (None without dropout).

    Items whose captions are encoded alone share one entry, ``""`` (behind the dataset's prompt
    prefix, if any) as ``CLIPTextEncode`` encodes it. An item whose captions carry its reference
    images in the prompt (``reference_in_prompt``) gets that empty text with those images, as the edit
    model's text-encode node builds its unconditioned input: an edit model never sees its prompt
    without the images, dropped caption or not."""
    empty = empty_caption(captions)
    if empty is None or not planned:
        return [None] * len(planned)
    ((key, _),) = keyed_texts((empty,), text_sig, text_dtype)
    shared = dataclasses.replace(planned[0], entry=ImageEntry(os.path.join(folder, "(empty caption)"), ""),
                                 text_key=key, texts=((key, empty),), variant=-1, references=())
    out: list[ItemPlan | None] = []
    for p in planned:
        sig = p.prompt_sig or prompt_sig  # a style that sizes references against the bucket keys each bucket
        if prompt_references(p.references, bool(sig)):
            own = keyed_texts((empty,), text_sig, text_dtype, sig, p.references)
            out.append(dataclasses.replace(p, text_key=own[0][0], texts=own, variant=-1))
        else:
            out.append(shared)
    return out
