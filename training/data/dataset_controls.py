"""Pairing a control folder's VACE control clips (and optional masks) with the training clips.

Wan 2.1 VACE trains on a control video per clip (depth, pose, edges, a masked copy of the clip...) and
optionally a mask saying where the control applies (white = generate, as ``WanVaceToVideo``'s
``control_masks``). They live in the Dataset node's control folder, named by the training file's stem:
``clip.mp4`` is the control of ``clip.mp4`` / ``clip.webm``, ``clip_mask.mp4`` (or ``clip_mask.png``, one mask
for every frame) its mask. Any video or image extension is accepted; an image control fits only an image item
(a 1-frame clip), as training/cache/vace_control.py reads it.

Which pairing a control folder gets is read from the files, so the Dataset node needs no new setting and
edit datasets pair as they always did: a dataset with a video (among its training files or in the control
folder) is a VACE dataset; an image-only one pairs reference images (dataset.pair_references).

Every problem is named in the Dataset node's one-pass check, with the fix: a clip without a control, two
controls (or masks) for one clip, a control file that pairs with no clip, an image control for a video clip
and a control (or mask) clip shorter than its clip (the frames the Cache node would need are missing; up to
the dataset's ``max_frames``, the longest frame bucket).
"""

from __future__ import annotations

import os
from pathlib import Path

MASK_SUFFIX = "_mask"  # clip_mask.* is the control mask of clip.*


def _stem(name: str) -> str:
    return os.path.splitext(name)[0]


def is_control_dataset(training: list[str], control_files: list[str], video_extensions: tuple[str, ...]) -> bool:
    """Whether a control folder holds VACE control clips (a video among the training or control files) rather
    than the reference images of an edit dataset."""
    return any(n.lower().endswith(video_extensions) for n in (*training, *control_files))


def pair_controls(training: list[str], control_files: list[str], control_folder: str | Path,
                  media: tuple[str, ...], required: list[str] | None = None
                  ) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """``(training file name -> (control path[, mask path]), problems)``: the control folder's ``media`` files
    paired with the ``training`` file names by stem (``name.*`` control, ``name_mask.*`` mask). Each of
    ``required`` (default: all) needs a control; the others (skipped for a missing caption) only claim theirs."""
    folder = str(control_folder)
    stems = {_stem(n): n for n in training}
    found: dict[str, dict[str, list[str]]] = {}
    unpaired = []
    for name in sorted(n for n in control_files if n.lower().endswith(media)):  # captions, notes: ignored
        stem = _stem(name)
        if stem in stems:
            target, role = stems[stem], "control"
        elif stem.endswith(MASK_SUFFIX) and stem[:-len(MASK_SUFFIX)] in stems:
            target, role = stems[stem[:-len(MASK_SUFFIX)]], "mask"
        else:
            unpaired.append(name)
            continue
        found.setdefault(target, {}).setdefault(role, []).append(name)
    problems = []
    several = [" and ".join(names) for roles in found.values() for names in roles.values() if len(names) > 1]
    if several:
        problems.append(f"{len(several)} control file(s) in {folder} have several files (one control and one mask "
                        f"per clip): {'; '.join(several)}. Keep one of each.")
    required = training if required is None else required
    without = [n for n in required if "control" not in found.get(n, {})]
    if without:
        listed = ", ".join(f"{n} (needs {_stem(n)}.mp4 or another video type)" for n in without[:20])
        more = f" and {len(without) - 20} more" if len(without) > 20 else ""
        problems.append(f"{len(without)} training clip(s) have no VACE control clip in {folder}: {listed}{more}. "
                        "Add the control video under the clip's name (its mask, if any, as name_mask.mp4 or "
                        "name_mask.png), or remove the clip.")
    if unpaired:
        problems.append(f"{len(unpaired)} file(s) in {folder} pair with no training clip: "
                        f"{', '.join(unpaired[:20])}{' and more' if len(unpaired) > 20 else ''}. A control is named "
                        "like its clip (name.mp4) and its mask name_mask.mp4 (or .png): rename or remove them.")
    paths = {t: tuple(os.path.join(folder, roles[r][0]) for r in ("control", "mask") if r in roles)
             for t, roles in found.items() if "control" in roles}
    return paths, problems


def control_length_problems(clips: dict[str, tuple[str, ...]], fps: float, max_frames: int,
                            video_extensions: tuple[str, ...]) -> list[str]:
    """The controls and masks of ``clips`` (training clip path -> (control[, mask])) that cannot give the
    Cache node their clip's frames at ``fps`` (up to ``max_frames``), one problem naming them all."""
    from .media_probe import probe_video  # decodes the clip: the count load_control checks again

    def frames(path: str) -> int:
        return probe_video(path).frames_at(fps) if path.lower().endswith(video_extensions) else 1

    short = []
    for clip, controls in clips.items():
        try:
            needed = min(frames(clip), max_frames)
        except Exception:  # noqa: BLE001 - an unreadable clip is reported by the readability check
            continue
        for path in controls:
            name = os.path.basename(path)
            try:
                got = frames(path)
            except Exception as exc:  # noqa: BLE001 - named with the others, as the fix
                short.append(f"{name} cannot be read ({type(exc).__name__}: {exc})")
                continue
            if got < needed and not (got == 1 and not path.lower().endswith(video_extensions)
                                     and _stem(name).endswith(MASK_SUFFIX)):
                what = "is an image" if got == 1 and needed > 1 else f"has {got} frames at {fps:g} fps"
                short.append(f"{name} {what}, and {os.path.basename(clip)} trains {needed} frames")
    if not short:
        return []
    return [f"{len(short)} VACE control file(s) are shorter than their training clip: {'; '.join(short)}. Give each "
            "clip a control video (and mask video) at least as long as the clip, or lower max_frames."]
