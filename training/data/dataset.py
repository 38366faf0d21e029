"""Scanning a folder of images and videos with same-name ``.txt`` captions (pure Python).

The missing-caption policy is explicit: ``error`` names every file without a caption, ``skip`` drops
them, ``empty`` trains them with an empty caption; both of the latter are counted in the report.

Edit models train on pairs: an optional control folder holds each training image's reference images,
paired by file-name stem as the other trainers do: ``name.png`` is reference 0 of ``name.jpg``,
``name_1.png`` reference 1, ``name_2.png`` reference 2 and so on (any image extension). A stem that
is itself a training image's stem is that image's reference 0, so ``cat_1.png`` belongs to a training
image ``cat_1`` when there is one. A training image without references, a gap in the numbering, two
files for one reference and control files that pair with no training image are errors naming the files:
silently training an edit model on half its pairs is the costly mistake. Audio files in the control folder
are reference audio, numbered the same way on their own (``name.wav`` is reference audio 0, ``name_1.flac``
reference audio 1: MiniMax-H3's ``ref_audios``, ``<Audio 1>`` and on in the prompt), and videos named
``name_video.mp4``, ``name_video_1.mp4`` are reference videos (its ``ref_videos``, ``<Video 1>`` and on, each with
its own sound track as its ``ref_video_audio``); ``ImageEntry.references`` holds the pictures, then the videos, then
the audio (the node's order), and an item with videos or audio needs no picture. A dataset with other videos pairs its
control folder as Wan VACE control clips instead (``name.mp4`` and an optional ``name_mask.*``, in
``ImageEntry.controls``; dataset_controls.py), with the same one-pass report of every problem.
The bucket settings (aspect ratios, resolutions, video frames and fps) travel with the dataset so the
cache can place every item; see ``cache/buckets.py`` for the arithmetic.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .captions import CaptionOptions
from .dataset_controls import is_control_dataset
from .dataset_masks import option_problems, pair_masks
from .media_check import audio_problems, media_problems

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".m4a")  # reference audio (MiniMax-H3's ref_audios)
VIDEO_MARKER = "_video"  # name_video.mp4, name_video_1.mp4: reference videos of name.* (MiniMax-H3's ref_videos)
CAPTION_POLICIES = ("error", "skip", "empty")
# Sound, for families that train on it: "off" (today's families: nothing is checked), "optional" (clips
# without an audio track are named and train with the family's no-audio input), "required" (they are refused).
AUDIO_POLICIES = ("off", "optional", "required")


def is_audio(path: str) -> bool:
    """Whether ``path`` is an audio file (a reference audio among an item's references)."""
    return path.lower().endswith(AUDIO_EXTENSIONS)


def is_video(path: str) -> bool:
    """Whether ``path`` is a video file (a reference video among an item's references)."""
    return path.lower().endswith(VIDEO_EXTENSIONS)


def is_picture(path: str) -> bool:
    """Whether a reference is a picture (neither audio nor video)."""
    return not (is_audio(path) or is_video(path))


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class ImageEntry:
    """One source file (image or video) and its caption."""

    path: str
    caption: str
    references: tuple[str, ...] = ()  # reference image paths in reference order, then reference audio (control folder)
    mask: str = ""  # the loss mask's file (mask folder; dataset_masks.py), "" = none or the image's alpha
    controls: tuple[str, ...] = ()  # VACE control clips, masks, reference (control folder; dataset_controls.py)

    @property
    def is_video(self) -> bool:
        return self.path.lower().endswith(VIDEO_EXTENSIONS)


@dataclass(frozen=True)
class BucketSettings:
    """Aspect-ratio buckets (log-spaced between ``min_ratio`` and ``max_ratio``, width/height), the
    training resolutions (each item is cached once per resolution), the pixel multiple every bucket
    side is rounded to, and video frame buckets (1 and step·k+1 frames up to ``max_frames`` at ``fps``, step
    being the VAE's temporal rule: 4 for Wan and HunyuanVideo, 8 for LTX-Video)."""

    resolutions: tuple[int, ...]
    min_ratio: float = 1.0
    max_ratio: float = 1.0
    count: int = 1
    multiple: int = 16
    max_frames: int = 33
    fps: float = 16.0

    def problems(self) -> list[str]:
        out = []
        if not self.resolutions:
            out.append("Give at least one training resolution.")
        for res in self.resolutions:
            if res < self.multiple:
                out.append(f"Resolution {res} is smaller than the bucket multiple {self.multiple}: raise it.")
        if not 0 < self.min_ratio <= 1.0 <= self.max_ratio:
            out.append(f"Aspect ratios need 0 < min_ratio <= 1 <= max_ratio (got {self.min_ratio}, {self.max_ratio}).")
        if self.count < 1:
            out.append(f"Bucket count must be at least 1 (got {self.count}).")
        if self.multiple < 1:
            out.append(f"Bucket multiple must be at least 1 (got {self.multiple}).")
        if self.max_frames < 1:
            out.append(f"max_frames must be at least 1 (got {self.max_frames}).")
        if not self.fps > 0:
            out.append(f"fps must be positive (got {self.fps}).")
        return out


@dataclass(frozen=True)
class DatasetSpec:
    """What the Dataset node hands to the Cache node."""

    folder: str
    entries: tuple[ImageEntry, ...]
    resolution: int
    repeats: int = 1
    skipped: tuple[str, ...] = ()
    empty_captions: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    buckets: BucketSettings | None = None
    control_folder: str = ""  # where the entries' reference images came from ("" = none)
    captions: CaptionOptions = CaptionOptions()  # caption dropout and tag shuffle (training/data/captions.py)
    flip: str = "none"  # "random": a mirrored latent is cached per item, used half the time (cache/masks.py)
    mask: str = "none"  # loss mask: "alpha" (the image's) or "folder" (mask_folder, paired by name)
    mask_folder: str = ""
    unreadable: tuple[str, ...] = ()  # "<file>: <why>" of the files skipped because they cannot be read
    audio: str = "off"  # AUDIO_POLICIES: whether the family trains on the clips' sound
    without_audio: tuple[str, ...] = ()  # "<file>: <why>" of the clips that train with the no-audio input

    @property
    def bucket_settings(self) -> BucketSettings:
        """The explicit settings, or one square bucket at ``resolution`` (the plain case)."""
        return self.buckets or BucketSettings(resolutions=(self.resolution,))

    def report(self) -> str:
        b = self.bucket_settings
        videos = sum(e.is_video for e in self.entries)
        res = ", ".join(f"{r}px" for r in b.resolutions)
        lines = [f"{len(self.entries) - videos} images and {videos} videos in {self.folder} "
                 f"(x{self.repeats} repeats), {res}"]
        if b.count > 1:
            lines.append(f"{b.count} aspect buckets from {b.min_ratio:g} to {b.max_ratio:g} (width/height)")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} without caption: {', '.join(self.skipped)}")
        if self.unreadable:
            lines.append(f"skipped {len(self.unreadable)} that cannot be read: {'; '.join(self.unreadable)}")
        if self.empty_captions:
            lines.append(f"{len(self.empty_captions)} trained with an empty caption: {', '.join(self.empty_captions)}")
        if self.without_audio:
            lines.append(f"{len(self.without_audio)} clip(s) without sound train with the model's no-audio input: "
                         f"{'; '.join(self.without_audio)}")
        if self.control_folder and any(e.controls for e in self.entries):
            from .dataset_controls import control_set

            sets = [control_set(e.path, e.controls) for e in self.entries]
            streams = sorted({len(c.streams) for c in sets})
            per = str(streams[0]) if len(streams) == 1 else f"{streams[0]} to {streams[-1]}"
            masks = sum(sum(m is not None for _, m in c.streams) > 0 for c in sets)
            refs = sum(c.reference is not None for c in sets)
            lines.append(f"VACE control clips in {self.control_folder}: {'one' if per == '1' else per} per clip, "
                         f"{masks} with a mask" + (f", {refs} with a reference image" if refs else ""))
        elif self.control_folder:
            refs = [r for e in self.entries for r in e.references]
            sounds, clips = sum(map(is_audio, refs)), sum(map(is_video, refs))
            counts = sorted({len(e.references) for e in self.entries})
            per = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
            lines.append(f"{len(refs) - sounds - clips} reference images "
                         + (f"and {clips} reference videos " if clips else "")
                         + (f"and {sounds} reference audio files " if sounds else "")
                         + f"in {self.control_folder} ({per} per item)")
        if self.captions.report():
            lines.append(self.captions.report())
        if self.flip != "none":
            lines.append("horizontal flip: a mirrored latent is cached per item and trained half the time")
        if self.mask != "none":
            lines.append(f"loss masks from {self.mask_folder if self.mask == 'folder' else 'the alpha channel'} "
                         "(white = train, black = ignore)")
        return "\n".join(lines + list(self.notes))


def folder_fingerprint(folder: str | Path) -> str:
    """Names, sizes and mtimes of the folder's files: changes when a file or caption is edited, added or
    removed, so ComfyUI re-runs the Dataset node (and the cache after it) instead of reusing its output."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with os.scandir(folder) as listing:
            for e in sorted(listing, key=lambda e: e.name):
                if e.is_file():
                    st = e.stat()
                    h.update(f"{e.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    except OSError as exc:
        h.update(f"unreadable: {exc}".encode())
    return h.hexdigest()


_NUMBERED = re.compile(r"^(.+)_([1-9][0-9]*)$")  # name_1, name_2, ... (no leading zeros)


def _stem(name: str) -> str:
    return os.path.splitext(name)[0]


def reference_claim(name: str, stems: dict[str, str], marker: str = "") -> tuple[str, int] | None:
    """``(training file, reference index)`` a control-folder file ``name`` claims: ``<stem><marker>`` is reference 0
    of the training file of that stem, ``<stem><marker>_<n>`` reference ``n``; None: it claims none."""
    stem = _stem(name)
    numbered = _NUMBERED.match(stem)
    for base, index in ((stem, 0), *([(numbered.group(1), int(numbered.group(2)))] if numbered else [])):
        owner = base[:len(base) - len(marker)]
        if base.endswith(marker) and owner in stems:
            return stems[owner], index
    return None


def pair_references(images: list[str], control_files: list[str], control_folder: str | Path,
                    required: list[str] | None = None, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                    optional: bool = False, marker: str = "") -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Pair the control folder's files of ``extensions`` (reference images by default) with the training files
    ``images`` by stem (followed by ``marker``, see :func:`reference_claim`).

    Returns ``(training file name -> reference paths in reference order, problems)``; every problem
    names the files concerned. Each file of ``required`` (default: all) needs reference 0 (unless
    ``optional``) and an unbroken numbering; the others (skipped for a missing caption) only claim their
    references, so those do not count as unpaired.
    """
    control_folder = str(control_folder)
    stems = {_stem(n): n for n in images}
    found: dict[str, dict[int, list[str]]] = {}
    unpaired = []
    for name in sorted(n for n in control_files if n.lower().endswith(extensions)):  # captions, notes: ignored
        claimed = reference_claim(name, stems, marker)
        if claimed is None:
            unpaired.append(name)
            continue
        target, index = claimed
        found.setdefault(target, {}).setdefault(index, []).append(name)
    problems = []
    duplicates = [" and ".join(names) for refs in found.values() for names in refs.values() if len(names) > 1]
    if duplicates:
        problems.append(f"{len(duplicates)} reference(s) in {control_folder} have several files (one reference, one "
                        f"file): {'; '.join(duplicates)}. Keep one of each.")
    required = images if required is None else required
    without = [] if optional else [n for n in required if n not in found]
    if without:
        expected = ", ".join(f"{n} (needs {_stem(n)}.png or another image type)" for n in without[:20])
        more = f" and {len(without) - 20} more" if len(without) > 20 else ""
        problems.append(f"{len(without)} training image(s) have no reference image in {control_folder}: "
                        f"{expected}{more}. Add the reference under the training image's name, or remove the image.")
    gaps = []
    for target in required:
        refs = found.get(target)
        if refs:
            holes = [i for i in range(max(refs)) if i not in refs]
            if holes:
                names = ", ".join(f"{_stem(target)}{f'_{i}' if i else ''}.*" for i in holes)
                gaps.append(f"{target} has {refs[max(refs)][0]} but no {names}")
    if gaps:
        problems.append(f"Reference numbering has gaps in {control_folder}: {'; '.join(gaps)}. Number the references "
                        "of each image name.png, name_1.png, name_2.png, ... without gaps.")
    if unpaired:
        problems.append(f"{len(unpaired)} file(s) in {control_folder} pair with no training image: "
                        f"{', '.join(unpaired[:20])}{' and more' if len(unpaired) > 20 else ''}. A reference is named "
                        "like its training image (name.png, then name_1.png, name_2.png, ...): rename or remove them.")
    paths = {target: tuple(os.path.join(control_folder, refs[i][0]) for i in sorted(refs))
             for target, refs in found.items()}
    return paths, problems


def _image_files(folder: Path) -> list[str]:
    with os.scandir(folder) as listing:
        return sorted(e.name for e in listing if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))


def scan_dataset(folder: str | Path, resolution: int, repeats: int = 1, missing_caption: str = "error",
                 buckets: BucketSettings | None = None, control_folder: str | Path | None = None,
                 captions: CaptionOptions | None = None, flip: str = "none", mask: str = "none",
                 mask_folder: str | Path | None = None, audio: str = "off") -> DatasetSpec:
    """List the images and videos of ``folder`` with their captions, applying the missing-caption policy,
    and with ``control_folder`` each item's reference images (see :func:`pair_references`); ``captions``:
    caption dropout and tag shuffle, checked here (every problem in one message); ``flip``, ``mask`` and
    ``mask_folder``: the cached variants of cache/masks.py (masks paired by :func:`pair_masks`); ``audio``
    (``AUDIO_POLICIES``, default off): for a family that trains on sound, the videos without an audio track
    are named, and with ``required`` refused."""
    folder = Path(folder)
    if missing_caption not in CAPTION_POLICIES:
        raise DatasetError(f"missing_caption must be one of {', '.join(CAPTION_POLICIES)} (got {missing_caption!r}).")
    if audio not in AUDIO_POLICIES:
        raise DatasetError(f"audio must be one of {', '.join(AUDIO_POLICIES)} (got {audio!r}).")
    captions = captions or CaptionOptions()
    settings = [f"{what}: {' '.join(problems)}" for what, problems in (
        ("Bucket settings", buckets.problems() if buckets is not None else []),
        ("Caption options", captions.problems()),
        ("Flip and mask", option_problems(flip, mask, str(mask_folder or ""), bool(control_folder)))) if problems]
    if settings:
        raise DatasetError("\n".join(settings))
    if not folder.is_dir():
        raise DatasetError(f"Dataset folder {folder} does not exist: create it or fix the path.")
    media = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
    with os.scandir(folder) as listing:  # one directory read; no stat per file (large datasets)
        files = {e.name for e in listing if e.is_file()}
    images = sorted(n for n in files if n.lower().endswith(media))
    if not images:
        raise DatasetError(
            f"Dataset folder {folder} has no images or videos ({', '.join(media)}): add them with .txt captions."
        )
    entries, missing, skipped, empty = [], [], [], []
    for name in images:
        cap_name = os.path.splitext(name)[0] + ".txt"
        caption = None
        if cap_name in files:
            with open(os.path.join(folder, cap_name), encoding="utf-8") as f:
                caption = f.read().strip()
        path = os.path.join(folder, name)
        if caption:
            entries.append(ImageEntry(path, caption))
        elif missing_caption == "error":
            missing.append(name)
        elif missing_caption == "skip":
            skipped.append(name)
        else:
            empty.append(name)
            entries.append(ImageEntry(path, ""))
    if not entries and not missing:
        raise DatasetError(f"Every file in {folder} was skipped for lack of a caption: add .txt captions.")
    # Every problem of the folder in one message: one queue shows them all.
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} file(s) in {folder} have no caption (or an empty one): {', '.join(missing)}. "
            "Add a same-name .txt file for each, or set missing_caption to 'skip' or 'empty'."
        )
    # Files that cannot be read are skipped (named in the report, as the cache skips what it cannot decode)
    unreadable = media_problems([e.path for e in entries], VIDEO_EXTENSIONS)
    unreadable_names = {line.split(": ", 1)[0] for line in unreadable}
    entries = [e for e in entries if os.path.basename(e.path) not in unreadable_names]
    if not entries and not problems:
        problems.append(f"No file in {folder} can be read: {'; '.join(unreadable)}. Replace them with good copies.")
    elif unreadable and problems:
        problems.append(f"(Also skipped, {len(unreadable)} file(s) that cannot be read: {'; '.join(unreadable)}.)")
    without_audio = audio_problems([e.path for e in entries if e.is_video]) if audio != "off" else []
    if without_audio and audio == "required":
        problems.append(f"{len(without_audio)} clip(s) in {folder} have no sound and this model trains on it: "
                        f"{'; '.join(without_audio)}. Give each clip an audio track (or remove it from the folder).")
        without_audio = []
    control = ""
    if control_folder:
        try:
            entries, control = _with_references(folder, images, entries, Path(control_folder), buckets), str(control_folder)
        except DatasetError as exc:
            problems.append(str(exc))
    if mask == "folder":
        try:
            entries = _with_masks(folder, images, entries, Path(mask_folder))
        except DatasetError as exc:
            problems.append(str(exc))
    if problems:
        raise DatasetError("\n".join(problems))
    return DatasetSpec(str(folder), tuple(entries), resolution, repeats, tuple(skipped), tuple(empty),
                       unreadable=tuple(unreadable), audio=audio, without_audio=tuple(without_audio),
                       buckets=buckets, control_folder=control, captions=captions, flip=flip, mask=mask,
                       mask_folder=str(mask_folder) if mask == "folder" else "")


def _with_masks(folder: Path, training: list[str], entries: list[ImageEntry], masks: Path) -> list[ImageEntry]:
    """``entries`` with their mask files, or a :class:`DatasetError` naming every pairing problem."""
    if not masks.is_dir():
        raise DatasetError(f"Mask folder {masks} does not exist: create it (masks named like the training files) "
                           "or set mask to 'none'.")
    if masks.resolve() == folder.resolve():
        raise DatasetError(f"The mask folder is the dataset folder ({folder}): put the masks in a folder of their own.")
    paired, problems = pair_masks(training, _image_files(masks), masks,
                                  required=[os.path.basename(e.path) for e in entries])
    if problems:
        raise DatasetError("\n".join(problems))
    return [replace(e, mask=paired[os.path.basename(e.path)]) for e in entries]


def _with_references(folder: Path, images: list[str], entries: list[ImageEntry], control: Path,
                     buckets: BucketSettings | None = None) -> list[ImageEntry]:
    """``entries`` with their references, or a :class:`DatasetError` naming every pairing problem.

    Pairing runs against every training file (also those skipped for a missing caption, so their
    references do not show up as unpaired); only the kept entries need references."""
    if not control.is_dir():
        raise DatasetError(f"Control folder {control} does not exist: create it (reference images named like the "
                           "training images) or clear the control_folder input.")
    if control.resolve() == folder.resolve():
        raise DatasetError(f"The control folder is the dataset folder ({folder}): put the reference images in a "
                           "folder of their own.")
    with os.scandir(control) as listing:
        files = sorted(e.name for e in listing if e.is_file())
    stems = {_stem(n): n for n in images}
    videos = [n for n in files if n.lower().endswith(VIDEO_EXTENSIONS) and reference_claim(n, stems, VIDEO_MARKER)]
    if is_control_dataset(images, [n for n in files if n not in videos], VIDEO_EXTENSIONS):  # VACE control clips
        return with_controls(images, entries, files, control, buckets or BucketSettings((0,)))
    kept = [os.path.basename(e.path) for e in entries]
    clips, problems = pair_references(images, videos, control, required=kept, extensions=VIDEO_EXTENSIONS,
                                      optional=True, marker=VIDEO_MARKER)
    sounds, audio_problems = pair_references(images, files, control, required=kept, extensions=AUDIO_EXTENSIONS,
                                             optional=True)
    refs, picture_problems = pair_references(images, files, control,
                                             required=[n for n in kept if n not in sounds and n not in clips])
    problems = picture_problems + problems + audio_problems
    if problems:
        raise DatasetError("\n".join(problems))
    return [ImageEntry(e.path, e.caption, refs.get(n, ()) + clips.get(n, ()) + sounds.get(n, ()))
            for e, n in zip(entries, kept, strict=True)]


def with_controls(images: list[str], entries: list[ImageEntry], files: list[str], control: Path,
                  buckets: BucketSettings) -> list[ImageEntry]:
    """``entries`` with their VACE control clips, masks and reference (dataset_controls.py), or a
    :class:`DatasetError` naming every missing, unpaired, doubled or short control."""
    from .dataset_controls import control_length_problems, pair_controls

    paired, problems = pair_controls(images, files, control, IMAGE_EXTENSIONS + VIDEO_EXTENSIONS,
                                     required=[os.path.basename(e.path) for e in entries],
                                     image_extensions=IMAGE_EXTENSIONS)
    kept = [replace(e, controls=paired[os.path.basename(e.path)]) for e in entries
            if os.path.basename(e.path) in paired]
    problems += control_length_problems({e.path: e.controls for e in kept}, buckets.fps, buckets.max_frames,
                                        VIDEO_EXTENSIONS)
    if problems:
        raise DatasetError("\n".join(problems))
    return kept
