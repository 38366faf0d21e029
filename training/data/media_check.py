"""A quick readability check of a dataset's files, made when the Dataset node lists them.

Full decoding stays with the Cache node (training/cache/media.py probes each source once and keeps the result in
its index). This check reads only what says whether a file can be decoded at all: an image's header (Pillow
identifies the format and size without decoding pixels) and, for the formats that mark their end, that the file
reaches it (a PNG's chunks up to IEND, a JPEG's end-of-image marker near its end, a WebP's RIFF length), so a file cut
short by a failed copy is found too; a video's container and its video stream. Such files are skipped and named
on the Dataset node, listed in the same message as missing captions and unpaired references when those stop the
queue, and handed to the cache's report as dropped items, which the Train node refuses with its other problems:
one queue shows every problem of the folder. The
node runs it only when the folder's fingerprint changes (ComfyUI reuses the node's output otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

_JPEG_END = b"\xff\xd9"
_JPEG_TAIL = 4096  # bytes searched for the end marker: some writers pad after it


def _png_reaches_iend(f, size: int) -> bool:
    """Walk the PNG's chunk headers (seeking over their data) to IEND; bytes after it are allowed."""
    offset = 8
    while offset + 12 <= size:
        f.seek(offset)
        header = f.read(8)
        length = int.from_bytes(header[:4], "big")
        if header[4:8] == b"IEND":
            return True
        offset += 12 + length
    return False


def _ends_where_its_format_ends(path: str, size: int) -> str | None:
    """Why the file stops before its format's end, or None (formats without an end marker pass)."""
    ext = os.path.splitext(path)[1].lower()
    with open(path, "rb") as f:
        head = f.read(12)
        if ext == ".png" and head[:8] == b"\x89PNG\r\n\x1a\n" and not _png_reaches_iend(f, size):
            return "the PNG ends before its IEND chunk (the file is cut short)"
        f.seek(max(0, size - _JPEG_TAIL))
        tail = f.read()
    if ext in (".jpg", ".jpeg") and _JPEG_END not in tail:
        return "the JPEG has no end-of-image marker (the file is cut short)"
    if ext == ".webp" and head[:4] == b"RIFF" and int.from_bytes(head[4:8], "little") + 8 > size:
        return "the WebP is shorter than its RIFF header says (the file is cut short)"
    return None


def image_problem(path: str) -> str | None:
    """Why Pillow cannot read the image at ``path``, or None."""
    from PIL import Image, UnidentifiedImageError

    try:
        size = os.path.getsize(path)
        if size == 0:
            return "the file is empty"
        with Image.open(path) as img:
            width, height = img.size
        if width <= 0 or height <= 0:
            return f"the image is {width}x{height}"
        return _ends_where_its_format_ends(path, size)
    except UnidentifiedImageError:
        return "not an image Pillow can read (wrong extension, or a damaged header)"
    except (OSError, ValueError, SyntaxError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"


def video_problem(path: str) -> str | None:
    """Why PyAV cannot open the video at ``path`` or finds no video stream in it, or None."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                return "the file has no video stream"
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None


def audio_problems(paths: Iterable[str]) -> list[str]:
    """``"<file name>: <why>"`` for each clip of ``paths`` without an audio track PyAV can decode (asked only
    for families that train on sound; the container is opened, nothing is decoded). A track that is present
    but silent is found when the Cache node reads it (audio.py ``SILENT``)."""
    from .audio import track_problem

    out = []
    for path in paths:
        problem = track_problem(path)
        if problem:
            out.append(f"{os.path.basename(path)}: {problem}")
    return out


def media_problems(paths: Iterable[str], video_extensions: tuple[str, ...]) -> list[str]:
    """``"<file name>: <why>"`` for each file of ``paths`` that cannot be read, in the given order."""
    out = []
    for path in paths:
        check = video_problem if path.lower().endswith(video_extensions) else image_problem
        problem = check(path)
        if problem:
            out.append(f"{os.path.basename(path)}: {problem}")
    return out
