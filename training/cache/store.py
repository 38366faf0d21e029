"""Filling the cache: revalidate what is there, encode what is missing, report every decision.

Revalidation is cheap by design: a source whose size and mtime match the index keeps its recorded
content digest and probe (a changed mtime costs one hash of the file, and an unchanged hash means
nothing is re-encoded); keys are recomputed from their components (see keys.py) and looked up in the
index; only shards whose size or mtime changed since they were last known good are checksummed again.
Several processes may fill one cache: each key is claimed before encoding, so it is encoded once.

Reference images (the Dataset's control folder) are encoded with the same VAE into the item's latent entry
(reference_images.py: at the item's bucket, or at the size the reference-in-prompt style's node gives them).

Image-to-video items (the Cache node's ``start_image``, see start_image.py) get their start-image
conditioning (``concat_latent``, and ``clip_fea`` with a CLIP-vision model) in the same latent entry.
The Dataset node's flip and mask options add the item's variants (masks.py: the flipped latent, the
loss mask) to the same entry; a mask file is read and digested like a reference image.

Which text entries and latent variants each item needs (tag-shuffled captions, the empty caption of
caption dropout, the prompt prefix, references in the prompt, flip and mask) is plan.py's decision,
shared with the Cache node's disk estimate; this module keys, encodes and stores what it plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..data.dataset import DatasetSpec, ImageEntry, is_audio
from ..data.media_probe import Probe, probe_audio, probe_image, probe_video
from ..spec.options import CacheItem
from .buckets import Bucket, crop_fraction, frame_bucket, nearest_bucket, plan_buckets
from .clip_sound import ClipSound
from .encoders import IMAGE_VAE_FRAME_STEP, ComfyEncoders, Encoders, stored_text
from .index import CacheIndex, Entry, Source
from .keys import (
    change_reason,
    encoder_signature,
    latent_components,
    latent_key,
    prep_signature,
    prompt_signature,
    start_image_signature,
    text_components,
    variants_signature,
)
from .masks import encode_variants, mask_size_problem
from .media import load_image, load_video
from .plan import ItemPlan, caches_flip, caption_texts, empty_caption_plans, keyed_texts, latent_variants
from .prep_extras import extras_signature, item_crop, make_extras
from .reference_images import ReferenceImages
from .reference_media import VideoReader, media_problem
from .reference_prompt import PromptStyle
from .report import CacheReport
from .s2v_sound import S2VSound
from .shards import ShardWriter, checksum, pack
from .start_image import StartImage
from .start_image_prompt import start_image_prompt_for
from .vace_control import VaceControl

CROP_NOTE_THRESHOLD = 0.25  # report items losing more than this share of their area to the crop
_POLL_S = 0.1

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class CacheResult:
    items: tuple[CacheItem, ...]
    report: CacheReport
    latent_channels: int
    text_dim: int
    pooled_dim: int


def build_cache(dataset: DatasetSpec, vae, clip, cache_dir: str | Path, progress: Progress | None = None,
                text_dtype: str = "fp32", start_image: StartImage | None = None,
                reference_prompt: PromptStyle | None = None, vace: VaceControl | None = None,
                sound: ClipSound | None = None, s2v: S2VSound | None = None,
                read_video: VideoReader | None = None) -> CacheResult:
    """Cache ``dataset`` with ComfyUI's ``vae`` and ``clip``; see :func:`fill_cache`."""
    return fill_cache(dataset, ComfyEncoders(vae, clip), cache_dir, progress, text_dtype, start_image,
                      reference_prompt, vace, sound, s2v, read_video)


def fill_cache(dataset: DatasetSpec, encoders: Encoders, cache_dir: str | Path,
               progress: Progress | None = None, text_dtype: str = "fp32",
               start_image: StartImage | None = None, reference_prompt: PromptStyle | None = None,
               vace: VaceControl | None = None, sound: ClipSound | None = None,
               s2v: S2VSound | None = None, read_video: VideoReader | None = None) -> CacheResult:
    """Return one :class:`CacheItem` per file, resolution and repeat, encoding only what is missing.

    ``text_dtype`` (``keys.TEXT_STORE_DTYPES``): what text embeddings are stored as, the training dtype.
    ``start_image``: image-to-video start-image conditioning to cache with each latent (none by default).
    ``reference_prompt``: encode each caption of an item with references together with its reference
    images, in that style (reference_prompt.py; ``None``: captions alone). ``vace``: each item's VACE control
    conditioning (vace_control.py; off by default). ``sound``: each clip's audio latent (clip_sound.py; off by default).
    ``s2v``: each clip's Wan S2V audio features and reference latent (s2v_sound.py; off by default).
    ``read_video``: how reference videos are decoded (reference_media.py; the Cache node gives ComfyUI's Load Video)."""
    start = time.monotonic()
    filler = _Filler(Path(cache_dir), dataset, encoders, progress, text_dtype, start_image, reference_prompt)
    filler.vace, filler.sound = vace or VaceControl(), sound or ClipSound()
    filler.s2v = s2v or S2VSound()
    if read_video is not None:  # else PyAV's decode (reference_media.py)
        filler.references.media.read_video = read_video
    try:
        result = filler.run()
    finally:
        filler.close()
    result.report.seconds = time.monotonic() - start
    return result


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Filler:
    def __init__(self, root: Path, dataset: DatasetSpec, encoders: Encoders, progress: Progress | None,
                 text_dtype: str = "fp32", start_image: StartImage | None = None,
                 reference_prompt: PromptStyle | None = None):
        self.root = root
        self.reference_prompt = reference_prompt
        self.prompt_sig = prompt_signature(reference_prompt.identity() if reference_prompt else None)
        self.references = ReferenceImages(reference_prompt, dataset.bucket_settings.fps)
        self.start_image = start_image or StartImage()
        # HunyuanVideoI2V: the CLIP vision model goes into each caption's prompt, not the latent entry
        self.start_prompt, self.start_image = start_image_prompt_for(self.start_image, getattr(encoders, "clip", None))
        self.text_dtype = text_dtype
        self.dataset = dataset
        self.settings = dataset.bucket_settings
        self.encoders = encoders
        # The VAE's temporal rule (ComfyEncoders.frame_step); encoders without one keep 4k+1.
        self.frame_step = int(getattr(encoders, "frame_step", IMAGE_VAE_FRAME_STEP))
        self.usable_frames = getattr(encoders, "usable_frames", None)  # a VAE whose rule is no step rule
        self.progress = progress
        self.index = CacheIndex(root)
        self.writer = ShardWriter(root / "shards", self.index.shard_end)
        self.report = CacheReport()
        self.damaged: dict[str, str] = {}
        self.failed: dict[str, str] = {}  # key -> why encoding it failed

    def close(self) -> None:
        self.writer.close()
        self.index.close()

    # ---- phase 1: shards --------------------------------------------------------------------
    def check_shards(self, entries: dict[str, str]) -> None:
        """Checksum the records of every shard that changed since it was last known good."""
        known = self.index.shard_states()
        for shard in sorted(set(entries.values())):
            path = self.root / "shards" / shard
            try:
                st = path.stat()
            except FileNotFoundError:
                self._damage(entries, {k for k, s in entries.items() if s == shard}, f"shard {shard} is missing")
                continue
            if known.get(shard) == (st.st_size, st.st_mtime_ns):
                continue
            data = path.read_bytes()
            bad = {k for k, e in self.index.entries_of_shard(shard).items()
                   if checksum(data[e.offset:e.offset + e.length]) != e.checksum}
            self._damage(entries, bad, f"checksum mismatch in shard {shard}")
            self.index.put_shard_state(shard, st.st_size, st.st_mtime_ns)

    def _damage(self, entries: dict[str, str], keys: set[str], reason: str) -> None:
        if keys:
            self.index.drop_entries(sorted(keys))
            for k in keys:
                entries.pop(k, None)
                self.damaged[k] = f"damaged entry ({reason})"

    # ---- phase 2: plan ----------------------------------------------------------------------
    def reference_sources(self, entry: ImageEntry, known: dict[str, Source]) -> list[tuple[str, Probe]]:
        """Digest and probe of each reference image, or an error naming the reference that failed."""
        out = []
        for path in entry.references:
            try:
                out.append(self.source(ImageEntry(path, ""), known))
            except Exception as exc:  # noqa: BLE001 - reported by the caller as this item's skip reason
                raise ValueError(f"cannot read its reference {os.path.basename(path)} "
                                 f"({type(exc).__name__}: {exc})") from exc
        return out

    def source(self, entry: ImageEntry, known: dict[str, Source]) -> tuple[str, Probe]:
        st = os.stat(entry.path)
        old = known.get(entry.path)
        if old and old.unchanged(st):
            return old.digest, Probe(*json.loads(old.probe))
        digest = _file_digest(entry.path)
        if old:
            self.report.rehashed.append(os.path.basename(entry.path))
        if old and old.digest == digest:
            probe = Probe(*json.loads(old.probe))
        else:
            probe = (probe_video if entry.is_video else probe_audio if is_audio(entry.path) else probe_image)(entry.path)
        self.index.put_source(entry.path, Source.of(st, digest, json.dumps(dataclasses.astuple(probe))))
        return digest, probe

    def variants_of(self, entry: ImageEntry, probe: Probe, known: dict[str, Source]) -> str:
        """The item's flip and mask variants as keyed (plan.py), or an error naming its mask's problem."""
        d, digest = self.dataset, ""
        if d.mask == "folder":
            try:
                digest, mask_probe = self.source(ImageEntry(entry.mask, ""), known)
            except Exception as exc:  # noqa: BLE001 - reported by the caller as this item's skip reason
                raise ValueError(f"cannot read its mask {os.path.basename(entry.mask)} "
                                 f"({type(exc).__name__}: {exc})") from exc
            problem = mask_size_problem((probe.width, probe.height), (mask_probe.width, mask_probe.height))
            if problem:
                raise ValueError(problem)
        vace = self.vace.key_part(entry, lambda path: self.source(ImageEntry(path, ""), known)[0])
        return variants_signature({**latent_variants(d.flip, d.mask, digest), **vace, **self.sound.key_part(entry),
                                   **self.s2v.key_part(entry), **self.references.key_part(entry.references)})

    def plan(self) -> list[ItemPlan]:
        s = self.settings
        if caches_flip(self.dataset.flip) and self.start_image.identity():
            raise ValueError("flip cannot be combined with start-image conditioning (the start image would need "
                             "the same mirror): set the Dataset's flip to 'none' or the Cache's start_image off.")
        if self.start_prompt is not None and self.reference_prompt is not None:
            raise ValueError(f"start_image {self.start_image.mode} puts the start frames into the prompt as ComfyUI's "
                             f"{self.start_prompt.style.node} does, and reference_in_prompt {self.reference_prompt.name} the "
                             f"reference images as {self.reference_prompt.node} does; no node does both: set the Cache's "
                             "start_image off, or reference_in_prompt off, or clear the Dataset's control_folder.")
        unheard = media_problem(self.dataset.entries, self.reference_prompt, self.sound.active)
        if unheard:
            raise ValueError(unheard)
        plan = plan_buckets(s)
        self.report.notes.extend(plan.notes)
        if self.reference_prompt is not None:
            self.report.notes.append(f"captions of items with references are encoded with their reference images in "
                                     f"the prompt, as ComfyUI's {self.reference_prompt.node} does "
                                     f"(reference_in_prompt {self.reference_prompt.name})")
        vae_id, text_sig = self.encoders.latent_identity(), encoder_signature(self.encoders.text_identity())
        start_sig = start_image_signature(self.start_image.identity())
        known = self.index.sources()
        self.source_sizes: dict[str, tuple[int, int]] = {}  # path -> probed (width, height), for prep extras
        preps: dict[Bucket, tuple[dict, str]] = {}
        out = []
        # what the Dataset node's header check already skipped is a dropped item like any below (the Train
        # node refuses to train without it, naming it with its other problems)
        self.report.skipped.extend(f"{line.replace(': ', ': cannot read it (', 1)})"
                                   for line in getattr(self.dataset, "unreadable", ()))
        for entry in self.dataset.entries:
            name = os.path.basename(entry.path)
            try:
                digest, probe = self.source(entry, known)
                self.source_sizes[entry.path] = (probe.width, probe.height)
            except Exception as exc:  # noqa: BLE001 - one bad file never stops the cache
                self.report.skipped.append(f"{name}: cannot read it ({type(exc).__name__}: {exc})")
                continue
            try:
                refs = self.reference_sources(entry, known)
            except ValueError as exc:
                self.report.skipped.append(f"{name}: {exc}")
                continue
            ref_digests = tuple(d for d, _ in refs)
            try:
                variants_sig = self.variants_of(entry, probe, known)
            except ValueError as exc:
                self.report.skipped.append(f"{name}: {exc}")
                continue
            texts = keyed_texts(caption_texts(self.dataset.captions, entry.caption), text_sig, self.text_dtype,
                                self.prompt_sig, ref_digests)  # (caption,) with tag shuffle off
            tkey = texts[0][0]
            video = entry.is_video
            for i, res in enumerate(s.resolutions):
                spatial = nearest_bucket(probe.width, probe.height, plan.by_resolution[res])
                frames = frame_bucket(probe.frames_at(s.fps), s.max_frames, self.frame_step,
                                      self.usable_frames) if video else 1
                bucket = Bucket(spatial.width, spatial.height, frames)
                lost = crop_fraction(probe.width, probe.height, bucket)
                if lost > CROP_NOTE_THRESHOLD:
                    self.report.notes.append(f"{name}: {lost:.0%} of the picture is cropped away to fit bucket "
                                             f"{bucket.name}; widen min/max ratio or add buckets to keep it.")
                self.report.notes.extend(self.references.crop_notes(name, entry.references, [p for _, p in refs],
                                                                    bucket, CROP_NOTE_THRESHOLD))
                if bucket not in preps:
                    prep = {"width": bucket.width, "height": bucket.height, "frames": frames, "crop": "center",
                            "resize": "lanczos", "fps": s.fps if video else None}
                    if self.prep_extras:  # in the key only for the families that ask (prep_extras.py)
                        prep["extras"] = extras_signature(self.prep_extras)
                    prep.update(self.references.prep())  # how a style's node sizes the references, if it does
                    preps[bucket] = (prep, prep_signature(prep))
                prep, sig = preps[bucket]
                if self.start_prompt is not None:  # the start image at this bucket is in the prompt
                    texts = self.start_prompt.keyed(caption_texts(self.dataset.captions, entry.caption), text_sig,
                                                    self.text_dtype, (digest, sig))
                    tkey = texts[0][0]
                prompt_sig = self.references.prompt_signature(bucket, self.prompt_sig)
                if self.references.sized and ref_digests:  # the references in the prompt are sized for this bucket
                    texts = keyed_texts(caption_texts(self.dataset.captions, entry.caption), text_sig,
                                        self.text_dtype, prompt_sig, ref_digests)
                    tkey = texts[0][0]
                out.append(ItemPlan(entry, i, bucket, digest, prep,
                                    latent_key(digest, sig, vae_id, ref_digests, start_sig, variants_sig), tkey,
                                    ref_digests, texts, variants_sig=variants_sig, prompt_sig=prompt_sig))
        for silent in (self.sound.note(), self.s2v.note()):
            if silent:
                self.report.notes.append(silent)
        return out

    def empty_caption_plans(self, planned: list[ItemPlan]) -> list[ItemPlan | None]:
        """With caption dropout, the plan of each item's empty-caption entry (plan.py; None without)."""
        text_sig = encoder_signature(self.encoders.text_identity())
        plans = empty_caption_plans(planned, self.dataset.captions, self.dataset.folder, text_sig, self.text_dtype,
                                    self.prompt_sig)
        return self.start_prompt.empty_plans(planned, plans, text_sig, self.text_dtype) if self.start_prompt else plans

    def components(self, p: ItemPlan, kind: str) -> dict:
        """The named inputs behind ``p``'s key of ``kind`` (built only when a slot changed)."""
        if kind == "latent":
            return latent_components(p.digest, p.prep, self.encoders.latent_identity(), p.references,
                                     self.start_image.identity(), json.loads(p.variants_sig or "{}"))
        prompted = ((self.reference_prompt.identity_at(p.bucket.width, p.bucket.height), p.references)
                    if self.prompt_sig and p.references else ())
        if self.start_prompt is not None:
            prompted = (self.start_prompt.identity(), self.start_prompt.image_of(p))
        return text_components(p.text, self.encoders.text_identity(), self.text_dtype, *prompted)

    # ---- phase 3: encode --------------------------------------------------------------------
    def _encode(self, key: str, kind: str, planned: ItemPlan) -> None:
        if kind == "latent":
            b = planned.bucket
            if planned.entry.is_video:
                pixels = load_video(planned.entry.path, b, self.settings.fps)
            else:
                pixels = load_image(planned.entry.path, b)
            tensors = {"latent": self.encoders.encode_latent(pixels)}
            tensors.update(encode_variants(pixels, tensors["latent"], self.dataset.flip, self.dataset.mask,
                                           planned.entry.path, planned.entry.mask, b, self.encoders.encode_latent))
            tensors.update(self.references.encode(planned.entry.references, b, self.encoders.encode_latent,
                                                  self.sound.encode_reference))
            tensors.update(self._prep_extras_of(planned))
            tensors.update(self.start_image.encode(pixels, tensors["latent"], self.encoders.encode_latent))
            tensors.update(self.vace.encode(planned.entry, b, self.settings.fps, tensors))
            tensors.update(self.sound.encode(planned.entry, b, self.settings.fps))
            tensors.update(self.s2v.encode(planned.entry, b, self.settings.fps, pixels, self.encoders.encode_latent))
        else:
            tensors = stored_text(self._encode_caption(planned), self.text_dtype)
        data = pack(tensors)
        shard, offset = self.writer.append(data)
        st = os.stat(self.root / "shards" / shard)
        shapes = json.dumps({k: list(v.shape) for k, v in tensors.items()})
        self.index.put_entry(key, Entry(shard, offset, len(data), checksum(data), shapes), st.st_size, st.st_mtime_ns)

    def _encode_caption(self, planned: ItemPlan) -> dict[str, object]:
        """The plan's text alone, or with its item's reference images (reference_prompt.py) or start image
        (start_image_prompt.py) in the prompt."""
        if self.start_prompt is not None:
            return self.start_prompt.encode_item(self.encoders.clip, planned, self.settings.fps)
        if not (self.prompt_sig and planned.references):
            return self.encoders.encode_text(planned.text)
        images = self.references.prompt_items(planned.entry.references, planned.bucket)
        return self.encoders.encode_text_with_references(planned.text, images, self.reference_prompt)

    @property
    def prep_extras(self) -> dict:
        """Extras the text encoder's family asks the cache to compute per item (prep_extras.py)."""
        return getattr(self.encoders, "prep_extras", None) or {}

    def _prep_extras_of(self, planned: ItemPlan) -> dict[str, object]:
        """The item's preprocessing extras (e.g. SDXL's size and crop), from its probed size and bucket."""
        if not self.prep_extras:
            return {}
        width, height = self.source_sizes[planned.entry.path]
        return make_extras(self.prep_extras, item_crop(width, height, planned.bucket.width, planned.bucket.height))

    def ensure(self, key: str, kind: str, planned: ItemPlan, entries: dict[str, str],
               slots: dict[str, tuple[str, str]], deferred: dict[str, tuple[str, ItemPlan]]) -> None:
        """Reuse, encode (when this process wins the claim) or defer ``key`` to whoever holds it."""
        if key in entries:
            self.report.reused[kind] += 1
            return
        if key in self.failed or key in deferred:
            return
        if not self.index.claim(key):
            deferred[key] = (kind, planned)
            return
        try:
            if self.index.entry(key) is not None:  # finished by another process since we looked
                self.report.by_other_process[kind] += 1
            else:
                self._encode(key, kind, planned)
                self._count_encode(key, kind, planned, slots)
            entries[key] = self.index.entry(key).shard
        except Exception as exc:  # noqa: BLE001 - one bad file never stops the cache
            self.failed[key] = f"cannot encode its {kind} ({type(exc).__name__}: {exc})"
        finally:
            self.index.release(key)

    def _count_encode(self, key: str, kind: str, planned: ItemPlan, slots: dict[str, tuple[str, str]]) -> None:
        name = Path(planned.entry.path).name
        old = slots.get(_slot(planned, kind))
        if key in self.damaged:
            why = self.damaged[key]
        elif old is not None:
            why = change_reason(json.loads(old[1]), self.components(planned, kind))
        else:
            self.report.cached[kind] += 1
            return
        self.report.reencoded_kinds[kind] += 1
        self.report.reencoded.append(f"{name} {kind}: {why}")

    def wait_for_others(self, deferred: dict[str, tuple[str, ItemPlan]], entries: dict[str, str],
                        slots: dict[str, tuple[str, str]]) -> None:
        """Keys another process was encoding: wait for them, or take them over if it died."""
        while deferred:
            for key in list(deferred):
                kind, planned = deferred[key]
                entry = self.index.entry(key)
                if entry is not None:
                    entries[key] = entry.shard
                    self.report.by_other_process[kind] += 1
                    del deferred[key]
                else:  # claim again: succeeds only if the holder died
                    del deferred[key]
                    self.ensure(key, kind, planned, entries, slots, deferred)
            if deferred:
                time.sleep(_POLL_S)

    # ---- the whole run ----------------------------------------------------------------------
    def run(self) -> CacheResult:
        entries = self.index.entry_shards()
        self.check_shards(entries)
        planned = self.plan()
        slots = self.index.slots()
        deferred: dict[str, tuple[str, ItemPlan]] = {}
        empties = self.empty_caption_plans(planned)
        for n, (p, empty) in enumerate(zip(planned, empties, strict=True)):
            if empty is not None:
                self.ensure(empty.text_key, "text", empty, entries, slots, deferred)
            self.ensure(p.latent_key, "latent", p, entries, slots, deferred)
            for tp in p.text_plans():
                self.ensure(tp.text_key, "text", tp, entries, slots, deferred)
            if self.progress:
                self.progress(n + 1, len(planned))
        self.wait_for_others(deferred, entries, slots)
        return self.collect(planned, entries, slots, [e.text_key if e is not None else "" for e in empties])

    def collect(self, planned: list[ItemPlan], entries: dict[str, str],
                slots: dict[str, tuple[str, str]], empty_keys: list[str] | None = None) -> CacheResult:
        items: list[CacheItem] = []
        changed_slots = []
        shapes = (0, 0, 0)
        index_file = str(self.index.path)
        skipped_files = set()
        for p, empty_key in zip(planned, empty_keys or [""] * len(planned), strict=True):
            lkey, tkey = p.latent_key, p.text_key
            keys = (lkey, *(k for k, _ in p.texts[1:]), *((empty_key,) if empty_key else ()))
            why = self.failed.get(lkey) or self.failed.get(tkey) or next(
                (f"{self.failed[k]} (a caption variant or the empty caption)" for k in keys if k in self.failed), None)
            if why or tkey not in entries or any(k not in entries for k in keys):
                if p.entry.path not in skipped_files:
                    skipped_files.add(p.entry.path)
                    self.report.skipped.append(f"{Path(p.entry.path).name}: {why or 'not cached'}")
                continue
            for kind, plan in (("latent", p), *(("text", tp) for tp in p.text_plans())):
                key = plan.latent_key if kind == "latent" else plan.text_key
                if slots.get(_slot(plan, kind), ("",))[0] != key:
                    changed_slots.append((_slot(plan, kind), key, self.components(plan, kind)))
            if not shapes[0]:
                lat, txt = json.loads(self.index.entry(lkey).shapes), json.loads(self.index.entry(tkey).shapes)
                shapes = (lat["latent"][0], txt["cond"][-1], txt["pooled"][-1] if "pooled" in txt else 0)
            self.report.buckets[p.bucket_name] += 1
            item = CacheItem(index_file, index_file, p.entry.path, p.entry.caption,
                             latent_key=lkey, text_key=tkey, bucket=p.bucket_name,
                             text_variants=tuple(k for k, _ in p.texts) if len(p.texts) > 1 else (),
                             empty_text_key=empty_key, caption_dropout=self.dataset.captions.dropout)
            items.extend([item] * self.dataset.repeats)
        self.index.put_slots(changed_slots)
        return CacheResult(tuple(items), self.report, *shapes)


def _slot(p: ItemPlan, kind: str) -> str:
    """Where a kind of an item's entry is recorded (its last key); a tag-shuffle variant k > 0 has its own."""
    if kind == "latent":
        return f"{p.entry.path}#latent{p.slot}"
    return f"{p.entry.path}#text" + (f"~{p.variant}" if p.variant else "")
