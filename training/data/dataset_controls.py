"""Pairing a control folder's VACE control clips (masks, reference image) with the training clips.

Wan 2.1 VACE trains on one or more control videos per clip (depth, pose, edges, a masked copy of the
clip...), each optionally with a mask saying where the control applies (white = generate, as
``WanVaceToVideo``'s ``control_masks``), and optionally a reference image (``WanVaceToVideo``'s
``reference_image``). They live in the Dataset node's control folder, named by the training file's stem:

- ``clip.mp4`` is control stream 1 of ``clip.mp4`` / ``clip.webm``, ``clip.2.mp4`` stream 2, ``clip.3.mp4``
  stream 3... (as chained ``WanVaceToVideo`` nodes, in that order; numbered without gaps);
- ``<stream>_mask.*`` is that stream's mask: ``clip_mask.mp4`` (or ``clip_mask.png``, one mask for every
  frame) for stream 1, ``clip.2_mask.png`` for stream 2;
- ``clip_ref.png`` is the clip's reference image (an image; every stream's node gets it, as a chain must).

Any video or image extension is accepted; an image control fits only an image item (a 1-frame clip), as
training/cache/vace_control.py reads it. ``ImageEntry.controls`` holds the paths flat, stream by stream
(control, then its mask), then the reference; :func:`control_set` reads the roles back from the names.

Which pairing a control folder gets is read from the files, so the Dataset node needs no new setting and
edit datasets pair as they always did: a control folder with a video (other than MiniMax-H3's reference videos,
``name_video.mp4``, which dataset.py sets apart first) or a file with a VACE-only name (a mask, a reference, a
stream 2...) is a VACE one; any other image-only one pairs reference images
(dataset.pair_references), also for clips (MiniMax-H3's reference pictures). Such a folder of plain ``name.png`` controls is
read as VACE control images by the Cache node when its ``vace_control`` is on
(vace_control.VaceControl.dataset): image items train as 1-frame clips.

Every problem is named in the Dataset node's one-pass check, with the fix: a clip without a control, two
files for one role, a gap in the stream numbering, a mask without its control, a video reference, a
control file that pairs with no clip, an image control for a video clip and a control (or mask) clip
shorter than its clip (the frames the Cache node would need are missing; up to the dataset's
``max_frames``, the longest frame bucket).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MASK_SUFFIX = "_mask"  # clip_mask.* is the mask of control stream 1 of clip.*, clip.2_mask.* of stream 2
REFERENCE_SUFFIX = "_ref"  # clip_ref.* is the reference image of clip.*
_STREAM = re.compile(r"(.+)\.([1-9][0-9]*)")  # clip.2: control stream 2 of clip


def _stem(name: str) -> str:
    return os.path.splitext(name)[0]


def control_role(name: str, stems: set[str] | dict[str, str]) -> tuple[str, int, str] | None:
    """``(training stem, stream, role)`` a control-folder file ``name`` claims among the training ``stems``:
    role ``control`` or ``mask`` of stream 1, 2...; ``reference`` (stream 0). A stem that is itself a training
    stem is that clip's stream-1 control. None: it pairs with no clip."""
    stem = _stem(name)
    if stem in stems:
        return stem, 1, "control"
    if stem.endswith(REFERENCE_SUFFIX) and stem[:-len(REFERENCE_SUFFIX)] in stems:
        return stem[:-len(REFERENCE_SUFFIX)], 0, "reference"
    role = "control"
    if stem.endswith(MASK_SUFFIX):
        stem, role = stem[:-len(MASK_SUFFIX)], "mask"
        if stem in stems:
            return stem, 1, role
    numbered = _STREAM.fullmatch(stem)
    if numbered and numbered.group(1) in stems and int(numbered.group(2)) >= 2:
        return numbered.group(1), int(numbered.group(2)), role
    return None


@dataclass(frozen=True)
class ControlSet:
    """One clip's VACE inputs: ``streams`` ``(control, mask or None)`` in chain order, and its reference image."""

    streams: tuple[tuple[str, str | None], ...]
    reference: str | None = None


def control_set(training_path: str, controls: tuple[str, ...]) -> ControlSet:
    """The roles of an entry's flat ``controls`` (as :func:`pair_controls` gave them), read from the names."""
    stem = _stem(os.path.basename(training_path))
    by_stream: dict[int, dict[str, str]] = {}
    reference = None
    for path in controls:
        claimed = control_role(os.path.basename(path), {stem})
        if claimed is None:
            raise ValueError(f"{os.path.basename(path)} is not named as a VACE control of "
                             f"{os.path.basename(training_path)} (name.mp4, name.2.mp4, name_mask.png, name_ref.png).")
        _, stream, role = claimed
        if role == "reference":
            reference = path
        else:
            by_stream.setdefault(stream, {})[role] = path
    streams = tuple((roles["control"], roles.get("mask")) for _, roles in sorted(by_stream.items())
                    if "control" in roles)
    return ControlSet(streams, reference)


def is_control_dataset(training: list[str], control_files: list[str], video_extensions: tuple[str, ...]) -> bool:
    """Whether a control folder holds VACE controls (a video among the control files, or a file with a VACE-only
    name) rather than reference images (an edit dataset's, or the reference pictures of MiniMax-H3's clips): plain
    images pair as references even for clips, where they could never be VACE controls (an image controls an image
    item only)."""
    if any(n.lower().endswith(video_extensions) for n in control_files):
        return True
    stems = {_stem(n) for n in training}
    return any((role := control_role(n, stems)) is not None and (role[1] != 1 or role[2] != "control")
               for n in control_files)


def pair_controls(training: list[str], control_files: list[str], control_folder: str | Path,
                  media: tuple[str, ...], required: list[str] | None = None,
                  image_extensions: tuple[str, ...] = ()) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """``(training file name -> flat control paths, problems)``: the control folder's ``media`` files paired
    with the ``training`` file names by stem (:func:`control_role`), each clip's paths stream by stream
    (control, its mask), then the reference. Each of ``required`` (default: all) needs a stream-1 control;
    the others (skipped for a missing caption) only claim theirs. ``image_extensions``: what a reference may be
    (empty: anything)."""
    folder = str(control_folder)
    stems = {_stem(n): n for n in training}
    found: dict[str, dict[tuple[int, str], list[str]]] = {}
    unpaired = []
    for name in sorted(n for n in control_files if n.lower().endswith(media)):  # captions, notes: ignored
        claimed = control_role(name, stems)
        if claimed is None:
            unpaired.append(name)
            continue
        stem, stream, role = claimed
        found.setdefault(stems[stem], {}).setdefault((stream, role), []).append(name)
    problems = []
    several = [" and ".join(names) for roles in found.values() for names in roles.values() if len(names) > 1]
    if several:
        problems.append(f"{len(several)} control file(s) in {folder} have several files (one control and one mask "
                        f"per stream, one reference per clip): {'; '.join(several)}. Keep one of each.")
    required = training if required is None else required
    without = [n for n in required if (1, "control") not in found.get(n, {})]
    if without:
        listed = ", ".join(f"{n} (needs {_stem(n)}.mp4 or another video type)" for n in without[:20])
        more = f" and {len(without) - 20} more" if len(without) > 20 else ""
        problems.append(f"{len(without)} training clip(s) have no VACE control clip in {folder}: {listed}{more}. "
                        "Add the control video under the clip's name (its mask, if any, as name_mask.mp4 or "
                        "name_mask.png), or remove the clip.")
    gaps, orphans, video_refs = [], [], []
    for target, roles in found.items():
        streams = sorted({s for s, r in roles if r == "control" and s >= 1})
        if streams and streams != list(range(1, len(streams) + 1)):
            gaps.append(f"{target} has streams {', '.join(map(str, streams))}")
        orphans += [roles[(s, r)][0] for s, r in roles if r == "mask" and (s, "control") not in roles]
        reference = roles.get((0, "reference"))
        if reference and image_extensions and not reference[0].lower().endswith(image_extensions):
            video_refs.append(reference[0])
    if gaps:
        problems.append(f"VACE control streams of {len(gaps)} clip(s) in {folder} are numbered with gaps: "
                        f"{'; '.join(gaps)}. Number them name.mp4, name.2.mp4, name.3.mp4... without gaps.")
    if orphans:
        problems.append(f"{len(orphans)} mask(s) in {folder} have no control of their stream: {', '.join(orphans)}. "
                        "Add the control (name.2.mp4 for name.2_mask.png) or remove the mask.")
    if video_refs:
        problems.append(f"{len(video_refs)} reference(s) in {folder} are not images: {', '.join(video_refs)}. "
                        "WanVaceToVideo takes one reference image: save it as name_ref.png.")
    if unpaired:
        problems.append(f"{len(unpaired)} file(s) in {folder} pair with no training clip: "
                        f"{', '.join(unpaired[:20])}{' and more' if len(unpaired) > 20 else ''}. A control is named "
                        "like its clip (name.mp4, then name.2.mp4...), its mask name_mask.mp4 (or .png) and its "
                        "reference name_ref.png: rename or remove them.")
    paths = {t: tuple(os.path.join(folder, names[0]) for (s, r), names in sorted(roles.items(), key=_chain_order))
             for t, roles in found.items() if (1, "control") in roles}
    return paths, problems


def _chain_order(item) -> tuple[int, int]:
    """Streams in order (control before its mask), the reference last."""
    (stream, role), _ = item
    return (stream if stream else 1 << 30, role == "mask")


def control_length_problems(clips: dict[str, tuple[str, ...]], fps: float, max_frames: int,
                            video_extensions: tuple[str, ...]) -> list[str]:
    """The controls and masks of ``clips`` (training clip path -> flat controls) that cannot give the Cache node
    their clip's frames at ``fps`` (up to ``max_frames``), one problem naming them all. A still mask and the
    reference image are one frame by design."""
    from .media_probe import probe_video  # decodes the clip: the count load_control checks again

    def frames(path: str) -> int:
        return probe_video(path).frames_at(fps) if path.lower().endswith(video_extensions) else 1

    short = []
    for clip, controls in clips.items():
        try:
            needed = min(frames(clip), max_frames)
        except Exception:  # noqa: BLE001 - an unreadable clip is reported by the readability check
            continue
        stem = _stem(os.path.basename(clip))
        for path in controls:
            name = os.path.basename(path)
            role = control_role(name, {stem})
            still = not path.lower().endswith(video_extensions)
            if role is not None and still and role[2] in ("mask", "reference"):
                continue
            try:
                got = frames(path)
            except Exception as exc:  # noqa: BLE001 - named with the others, as the fix
                short.append(f"{name} cannot be read ({type(exc).__name__}: {exc})")
                continue
            if got < needed:
                what = "is an image" if got == 1 and needed > 1 else f"has {got} frames at {fps:g} fps"
                short.append(f"{name} {what}, and {os.path.basename(clip)} trains {needed} frames")
    if not short:
        return []
    return [f"{len(short)} VACE control file(s) are shorter than their training clip: {'; '.join(short)}. Give each "
            "clip a control video (and mask video) at least as long as the clip, or lower max_frames."]
