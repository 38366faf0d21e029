"""Cheap, content-based fingerprints of model files (pure Python: the node layer uses it too).

Hashing every byte of a 20 GB checkpoint would cost minutes, so a file fingerprint covers its size,
its safetensors header (names, shapes, dtypes, offsets) and sampled chunks spread over the whole file.
A re-saved or fine-tuned file changes the sampled bytes; a renamed or copied one keeps its print.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 16
_SAMPLES = 64


def file_fingerprint(path: str | Path) -> str:
    path = Path(path)
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= _CHUNK * _SAMPLES:
            h.update(f.read())
        else:
            step = (size - _CHUNK) // (_SAMPLES - 1)
            for i in range(_SAMPLES - 1):
                f.seek(i * step)
                h.update(f.read(_CHUNK))
            f.seek(size - _CHUNK)  # the last chunk ends exactly at the end of the file
            h.update(f.read(_CHUNK))
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()
