"""Disk the test hosts take: the two venvs hold the same torch wheel (CUDA build, about 5 GB each).

CI runs on machines whose free disk varies (once only a few hundred MB were seen); two copies of
torch, triton and the NVIDIA libraries are the largest thing this project writes. Hard-linking the
files both venvs hold byte for byte keeps one copy on disk and changes nothing either venv sees: pip
never rewrites an installed file in place (an upgrade unlinks it first), so a later install in one venv
cannot reach into the other.

Except a Python source's modification time: a linked file has one, and each venv's bytecode cache
(``__pycache__/*.pyc``, written by pip at install) records the time of its own copy. A source linked to
the other venv's copy would leave its ``.pyc`` stale, and every import in every process would compile
it again (on CI, where ``PYTHONDONTWRITEBYTECODE`` is set, for good: about 5 s of each training rank's
start-up, measured on the current host). So ``.py`` files are linked only when their times agree (they
are about 3 % of the bytes).
"""

from __future__ import annotations

import filecmp
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LinkReport:
    linked: int
    bytes_saved: int
    differing: int
    sources_kept: int = 0  # identical .py files of other times, kept apart for their bytecode caches

    def summary(self) -> str:
        return (f"{self.linked} identical files hard-linked ({self.bytes_saved / 2**30:.2f} GiB saved), "
                f"{self.differing} differing and {self.sources_kept} Python sources of other times (their "
                "bytecode caches) left as they are")


def link_identical_files(keep: Path, other: Path) -> LinkReport:
    """Replace each regular file under ``other`` whose counterpart at the same relative path under ``keep``
    has the same bytes and mode by a hard link to that counterpart. Files already linked, links, files ``keep`` lacks,
    files on another file system and ``.py`` sources whose modification times differ (whole seconds, as a ``.pyc``
    records them) are left alone; a replacement is atomic (link beside it, then rename)."""
    linked = saved = differing = sources_kept = 0
    for dirpath, _dirs, files in os.walk(other):
        for name in files:
            theirs = Path(dirpath) / name
            ours = keep / theirs.relative_to(other)
            if theirs.is_symlink() or ours.is_symlink() or not ours.is_file():
                continue
            a, b = ours.stat(), theirs.stat()
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) or a.st_dev != b.st_dev:
                continue
            if a.st_mode != b.st_mode or a.st_size != b.st_size or not filecmp.cmp(ours, theirs, shallow=False):
                differing += 1
                continue
            if name.endswith(".py") and int(a.st_mtime) != int(b.st_mtime):
                sources_kept += 1
                continue
            temporary = theirs.with_name(f".{name}.pipetrainer-link")
            temporary.unlink(missing_ok=True)
            os.link(ours, temporary)
            os.replace(temporary, theirs)
            linked += 1
            saved += b.st_size
    return LinkReport(linked, saved, differing, sources_kept)
