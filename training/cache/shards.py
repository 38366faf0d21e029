"""Append-only shard files holding cache records, with checksums and one writer per shard.

A record is one small safetensors blob (its own header, so it decodes alone) stored at an offset the
index remembers; reading one item is a seek and a read. Bytes are appended first and indexed after, so
a process killed mid-write leaves only unindexed bytes at the end of its shard, which the next writer
of that shard cuts off. A checksum per record catches bytes changed later (disk faults, edits).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SHARD_LIMIT_BYTES = 256 << 20
SHARD_SUFFIX = ".bin"


class CorruptRecord(ValueError):
    pass


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def unpack(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


def checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def read_span(path: Path, offset: int, length: int, expected: str) -> bytes:
    """The record's bytes, or :class:`CorruptRecord` if they are short or fail the checksum."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length or checksum(data) != expected:
        raise CorruptRecord(f"checksum mismatch in {path.name} at byte {offset}")
    return data


class ShardWriter:
    """Appends records to one shard that this process holds an exclusive lock on.

    ``indexed_end(name)`` tells how far the index knows the shard; anything beyond is a torn write
    from a killed process and is truncated before appending.
    """

    def __init__(self, folder: Path, indexed_end: Callable[[str], int]):
        self.folder = folder
        self.indexed_end = indexed_end
        self._file = None
        self.name = ""

    def _open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        candidates = sorted(p for p in self.folder.iterdir() if p.suffix == SHARD_SUFFIX)
        for path in candidates + [self.folder / f"shard-{uuid.uuid4().hex[:12]}{SHARD_SUFFIX}"]:
            f = open(path, "ab")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            end = self.indexed_end(path.name)
            if end >= SHARD_LIMIT_BYTES:
                f.close()
                continue
            if os.fstat(f.fileno()).st_size != end:
                f.truncate(end)
            f.seek(0, os.SEEK_END)
            self._file, self.name = f, path.name
            return
        raise OSError(f"No writable shard in {self.folder}")  # unreachable: a fresh name always locks

    def append(self, data: bytes) -> tuple[str, int]:
        """Write ``data`` at the end of the shard; return ``(shard name, offset)``."""
        if self._file is None or self._file.tell() >= SHARD_LIMIT_BYTES:
            self.close()
            self._open()
        offset = self._file.tell()
        self._file.write(data)
        self._file.flush()
        return self.name, offset

    def close(self) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None
