"""Pairing a mask folder with the training files, and checking the flip and mask options (pure Python).

A mask is named like its training file, with any image extension: ``name.png`` is the mask of
``name.jpg`` (and of ``name.mp4``: one mask per clip). White trains, black is ignored, grey weighs in
between. Like the control folder's references, a training file without a mask, two masks for one file
and masks that pair with no training file are errors naming the files: a mask silently missing would
train that item on its whole picture, the thing the mask was there to prevent.
"""

from __future__ import annotations

import os
from pathlib import Path

FLIP_MODES = ("none", "random")
MASK_MODES = ("none", "alpha", "folder")


def _stem(name: str) -> str:
    return os.path.splitext(name)[0]


def pair_masks(training: list[str], mask_files: list[str], mask_folder: str | Path,
               required: list[str] | None = None) -> tuple[dict[str, str], list[str]]:
    """``(training file name -> mask path, problems)`` pairing ``mask_files`` (the image files in
    ``mask_folder``) with the ``training`` file names by stem. Each of ``required`` (default: all) needs a mask; the others
    (skipped for a missing caption) only claim theirs, so those do not count as unpaired."""
    stems = {_stem(n): n for n in training}
    found: dict[str, list[str]] = {}
    unpaired = []
    for name in sorted(mask_files):
        target = stems.get(_stem(name))
        if target is None:
            unpaired.append(name)
        else:
            found.setdefault(target, []).append(name)
    problems = []
    duplicates = [" and ".join(names) for names in found.values() if len(names) > 1]
    if duplicates:
        problems.append(f"{len(duplicates)} training file(s) have several masks in {mask_folder}: "
                        f"{'; '.join(duplicates)}. Keep one mask per file.")
    without = [n for n in (training if required is None else required) if n not in found]
    if without:
        listed = ", ".join(f"{n} (needs {_stem(n)}.png)" for n in without[:20])
        more = f" and {len(without) - 20} more" if len(without) > 20 else ""
        problems.append(f"{len(without)} training file(s) have no mask in {mask_folder}: {listed}{more}. Add a mask "
                        "named like the file (white = train, black = ignore), or remove the file.")
    if unpaired:
        problems.append(f"{len(unpaired)} file(s) in {mask_folder} pair with no training file: "
                        f"{', '.join(unpaired[:20])}{' and more' if len(unpaired) > 20 else ''}. A mask is named like "
                        "its training file (name.png for name.jpg): rename or remove them.")
    return {t: os.path.join(str(mask_folder), names[0]) for t, names in found.items()}, problems


def option_problems(flip: str, mask: str, mask_folder: str, has_references: bool) -> list[str]:
    """What is wrong with the flip and mask options, phrased as the fix."""
    out = []
    if flip not in FLIP_MODES:
        out.append(f"flip must be one of {', '.join(FLIP_MODES)} (got {flip!r}).")
    if mask not in MASK_MODES:
        out.append(f"mask must be one of {', '.join(MASK_MODES)} (got {mask!r}).")
    if mask == "folder" and not str(mask_folder).strip():
        out.append("mask is 'folder' but mask_folder is empty: give the folder of masks (named like the training "
                   "files), or set mask to 'alpha' or 'none'.")
    if flip != "none" and has_references:
        out.append("flip cannot be used with a control folder: the references would need the same mirror, "
                   "which the cache does not encode. Set flip to 'none' for edit datasets.")
    return out
