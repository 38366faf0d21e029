"""MiniMax-H3's per-example structure as it crosses pipeline stage boundaries.

ComfyUI's ``MiniMaxH3Model._forward`` keeps Python-side structure across its blocks: the packed sequence's
``PackedLayout`` (its segments and rotary positions), the table of distinct timesteps and each segment's row in it,
the text encoder's token tags. A pipeline stage may only send tensors, and every float tensor it sends needs a
gradient path, so that structure crosses as int64 here: the streams' shapes, the keyframes and the rotary
frequencies' bits (:class:`Sizes`), per example the caption length, the sigma's bits and the timestep rows
(:class:`Meta`). Each stage rebuilds ComfyUI's layout from them (:func:`packed_layout`, cached) and so runs exactly
the structure ComfyUI builds for the example alone. training/pipelines/minimax_h3.py uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..cache.clip_sound import GUIDE_AUDIO
from ..cache.start_image import KEYFRAME_FIRST, KEYFRAME_LAST

KEYFRAMES = (KEYFRAME_FIRST, KEYFRAME_LAST)  # first_frame at pixel frame 0, last_frame at the last: ComfyUI's order
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2  # ComfyUI's modality tags of the AdaLN rows (``seg_tag``)


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 (their exact bits), to cross a stage boundary without asking for a gradient."""
    return values.detach().float().cpu().contiguous().view(torch.int32).to(torch.int64)


def from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


class Sizes:
    """``sizes`` int64: video ``(C, T, H, W)``, audio ``(C, ch, Ta)``, the condition rows (:class:`Conditions`: which
    of :data:`KEYFRAMES` as bits, their latent frames and the audio guide's, the reference count and each one's
    block), then the rotary ``inv_freq`` bits."""

    @staticmethod
    def make(v_shape: Sequence[int], a_shape: Sequence[int], conditions: Conditions,
             inv_freq_bits: torch.Tensor | None = None) -> torch.Tensor:
        refs = conditions.references.blocks
        kf = conditions.keyframes
        head = torch.tensor([*v_shape[1:], *a_shape[1:], kf.which, kf.frames, kf.audio,
                             len(refs), *(s for block in refs for s in block)], dtype=torch.int64)
        return head if inv_freq_bits is None else torch.cat([head, inv_freq_bits.view(-1)])

    @staticmethod
    def read(sizes: torch.Tensor, batch: int):
        v = [batch, *(int(s) for s in sizes[0:4])]
        a = [batch, *(int(s) for s in sizes[4:7])]
        n, w = int(sizes[10]), References.WIDTH
        refs = References(tuple(tuple(int(s) for s in sizes[11 + w * i:11 + w * (i + 1)]) for i in range(n)))
        return v, a, Conditions(Keyframes(*(int(s) for s in sizes[7:10])), refs), sizes[11 + w * n:]


@dataclass(frozen=True)
class Keyframes:
    """Which keyframes condition the clip (bit ``i``: ``KEYFRAMES[i]``) and their latent frames (each is one image
    encoded alone, as ``MiniMaxH3ImageToVideo`` encodes ``first_frame`` and ``last_frame``), then the audio guide's
    latent frames (``MiniMaxH3AddGuide`` with the clip's sound at frame 0; 0: none)."""

    which: int = 0
    frames: int = 0
    audio: int = 0

    @staticmethod
    def of(extras: Mapping[str, torch.Tensor]) -> Keyframes:
        which = sum(1 << i for i, name in enumerate(KEYFRAMES) if name in extras)
        frames = {int(extras[name].shape[2]) for name in KEYFRAMES if name in extras}
        if len(frames) > 1:
            raise ValueError(f"MiniMax-H3 keyframe latents of {sorted(frames)} frames in one example: each keyframe is "
                             "one image encoded alone; cache again.")
        audio = int(extras[GUIDE_AUDIO].shape[-1]) if GUIDE_AUDIO in extras else 0
        return Keyframes(which, frames.pop() if frames else 0, audio)

    def names(self) -> list[str]:
        return [name for i, name in enumerate(KEYFRAMES) if self.which >> i & 1]

    def anchors(self, latent_t: int) -> list[dict]:
        """ComfyUI's ``minimax_keyframes`` entries for :class:`PackedLayout` (it reads each latent's frame count
        only): ``first_frame`` at pixel frame 0, ``last_frame`` at the clip's last (``frame_count - 1``, the pixel
        frames of ``latent_t`` latent frames, as ``MiniMaxH3AddGuide`` counts them)."""
        from comfy.ldm.minimax.model import FRAME_PER_TOKEN

        frame_count = sum(FRAME_PER_TOKEN[k % 5] for k in range(latent_t))
        index = {KEYFRAME_FIRST: 0, KEYFRAME_LAST: frame_count - 1}
        shape = torch.empty((1, 1, self.frames, 1, 1), device="meta")
        out = [{"resolved_frame_index": index[name], "latent": shape} for name in self.names()]
        if self.audio:  # MiniMaxH3AddGuide appends its guide after the node's keyframes
            out.append({"resolved_frame_index": 0, "audio_latent": torch.empty((1, 1, 1, self.audio), device="meta")})
        return out


REF_IMAGE, REF_AUDIO, REF_VIDEO = 0, 1, 2  # a reference block's kind: ComfyUI's minimax_refs kinds


@dataclass(frozen=True)
class References:
    """The references of ``MiniMaxH3ReferenceToVideo`` in its order: ``ref_images`` (each one image at its own size,
    encoded alone), ``ref_videos`` (each with its sound track's latent when it has one), then standalone
    ``ref_audios`` (each a whole file's audio latent). A block is ``(kind, latent frames, latent height, latent width,
    audio latent frames)``: ``(REF_IMAGE, 1, h, w, 0)``, ``(REF_VIDEO, T, h, w, Ta or 0)`` or ``(REF_AUDIO, 0, 0, 0,
    Ta)``."""

    blocks: tuple[tuple[int, int, int, int, int], ...] = ()
    WIDTH = 5  # numbers a block takes in :class:`Sizes`

    @staticmethod
    def of(extras: Mapping[str, torch.Tensor]) -> References:
        from .base import reference_video_audio_extra

        pictures = tuple((REF_IMAGE, 1, *(int(s) for s in extras[n].shape[-2:]), 0) for n in reference_names(extras))
        videos = tuple((REF_VIDEO, *(int(s) for s in extras[n].shape[-3:]),
                        int(extras[track].shape[-1]) if (track := reference_video_audio_extra(k)) in extras else 0)
                       for k, n in enumerate(reference_video_names(extras)))
        sounds = tuple((REF_AUDIO, 0, 0, 0, int(extras[n].shape[-1])) for n in reference_audio_names(extras))
        return References(pictures + videos + sounds)

    def count(self, kind: int) -> int:
        return sum(block[0] == kind for block in self.blocks)

    @property
    def sound_latents(self) -> int:
        """Audio latents among them: the videos' sound tracks and the reference audio."""
        return sum(block[0] != REF_IMAGE and block[4] > 0 for block in self.blocks)

    def comfy_blocks(self) -> list[dict]:
        """ComfyUI's ``minimax_refs`` entries for :class:`PackedLayout` (it reads the kind and the sizes)."""
        out = []
        for kind, t, h, w, rt in self.blocks:
            if kind == REF_IMAGE:
                out.append({"kind": "image", "latent_h": h, "latent_w": w})
            elif kind == REF_VIDEO:
                out.append({"kind": "video_audio" if rt else "video", "latent_t": t, "latent_h": h, "latent_w": w,
                            "ref_audio_t": rt})
            else:
                out.append({"kind": "audio", "ref_audio_t": rt})
        return out


def _numbered(extras: Mapping[str, torch.Tensor], name_of) -> list[str]:
    names = []
    while name_of(len(names)) in extras:
        names.append(name_of(len(names)))
    return names


def reference_names(extras: Mapping[str, torch.Tensor]) -> list[str]:
    """The reference picture extras present, ``reference_0`` onwards without a gap (the Dataset's numbering)."""
    from .base import reference_extra

    return _numbered(extras, reference_extra)


def reference_video_names(extras: Mapping[str, torch.Tensor]) -> list[str]:
    """The reference video extras present, ``ref_video_0`` onwards without a gap."""
    from .base import reference_video_extra

    return _numbered(extras, reference_video_extra)


def reference_audio_names(extras: Mapping[str, torch.Tensor]) -> list[str]:
    """The reference audio extras present, ``ref_audio_0`` onwards without a gap (the Dataset's numbering)."""
    from .base import reference_audio_extra

    return _numbered(extras, reference_audio_extra)


@dataclass(frozen=True)
class Conditions:
    """An example's condition rows, in ComfyUI's payload order: the keyframes, then the references."""

    keyframes: Keyframes = Keyframes()
    references: References = References()

    @staticmethod
    def of(extras: Mapping[str, torch.Tensor]) -> Conditions:
        return Conditions(Keyframes.of(extras), References.of(extras))

    def names(self, extras: Mapping[str, torch.Tensor]) -> list[str]:
        """The extras whose latents become video condition rows, in the order ``_cond_video_rows`` takes them."""
        return self.keyframes.names() + reference_names(extras) + reference_video_names(extras)

    @property
    def sound_latents(self) -> int:
        """Audio condition latents: the audio guide's, the reference videos' tracks and the reference audio."""
        return int(self.keyframes.audio > 0) + self.references.sound_latents

    @staticmethod
    def audio_names(extras: Mapping[str, torch.Tensor]) -> list[str]:
        """The extras whose latents become audio condition rows, in the order ``_cond_audio_rows`` takes them: the
        reference videos' sound tracks, then the reference audio."""
        from .base import reference_video_audio_extra

        tracks = [reference_video_audio_extra(k) for k in range(len(reference_video_names(extras)))]
        guide = [GUIDE_AUDIO] if GUIDE_AUDIO in extras else []  # the keyframes' audio comes first
        return guide + [name for name in tracks if name in extras] + reference_audio_names(extras)


class Meta:
    """Per example, int64: caption tokens, float32 bits of the video sigma, the rows of the video, the audio, the
    table's length, then the video condition rows' timestep (keyframes and reference pictures alike) and the audio
    condition rows' (the audio guide, reference audio) in its table of distinct timesteps (-1: none)."""

    @staticmethod
    def read(meta: torch.Tensor, i: int) -> tuple[int, torch.Tensor, int, int, int, int, int]:
        row = meta[i]
        return (int(row[0]), from_bits(row[1:2])[0], int(row[2]), int(row[3]), int(row[5]), int(row[6]),
                int(row[4]))


@functools.lru_cache(maxsize=16)
def packed_layout(text_len: int, latent_t: int, lat_h: int, lat_w: int, audio_t: int,
                  conditions: Conditions = Conditions()):
    """ComfyUI's ``PackedLayout`` of one example: ``[text | keyframe rows | reference rows | audio | video]``."""
    from comfy.ldm.minimax.model import PackedLayout

    return PackedLayout(text_len, latent_t, lat_h, lat_w, audio_t,
                        keyframes=conditions.keyframes.anchors(latent_t) or None,
                        refs=conditions.references.comfy_blocks() or None)


def tag_runs(tags: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, tag)`` of each run of equal modality tags, as ``_forward`` splits the text span."""
    runs, start = [], 0
    for i in range(1, len(tags) + 1):
        if i == len(tags) or tags[i] != tags[start]:
            runs.append((start, i, int(tags[start])))
            start = i
    return runs


def padded_spatial(v_shape: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """Latent ``(T, H, W)`` after ComfyUI's ``pad_to_patch_size``."""
    return tuple(-(-int(s) // int(p)) * int(p) for s, p in zip(v_shape[2:], patch, strict=True))


class ExampleStructure:
    """One example's structure in a block or the final layer: its layout, sequence length and timestep rows."""

    def __init__(self, meta: torch.Tensor, i: int, v_shape, a_shape, conditions: Conditions, patch):
        self.text_len, self.sigma_v, self.row_v, self.row_a, self.row_c, self.row_ca, self.distinct = Meta.read(meta, i)
        t, h, w = padded_spatial(v_shape, patch)
        self.layout = packed_layout(self.text_len, t, h, w, int(a_shape[3]), conditions)
        self.length = self.layout.seq_len

    def mod_segments(self, tags: torch.Tensor) -> list[tuple[int, int, int]]:
        """ComfyUI's ``mod_segments``: row ``3 * timestep row + modality tag`` per segment, the text span split into
        runs of the text encoder's token tags (vision tokens carry the video tag)."""
        rows = {"audio": 3 * self.row_a + AUDIO_TAG, "video": 3 * self.row_v + VIDEO_TAG,
                "cond": 3 * self.row_c + VIDEO_TAG, "ref_img": 3 * self.row_c + VIDEO_TAG,
                "ref_audio": 3 * self.row_ca + AUDIO_TAG, "cond_audio": 3 * self.row_ca + AUDIO_TAG}
        out = []
        for a, b, kind in self.layout.segments:
            if kind == "text":
                out.extend((a + s, a + e, 3 * self.row_v + tag) for s, e, tag in tag_runs(tags[:b - a].tolist()))
            else:
                out.append((a, b, rows[kind]))
        return out
