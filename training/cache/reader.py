"""Reading cached tensors by key (the training ranks' side; read-only, checksummed)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

import torch

from .index import connect
from .shards import CorruptRecord, read_span, unpack


class CacheReadError(RuntimeError):
    pass


_TOTALS = {"keys": 0, "bytes": 0}  # this process's reads: a rank reports them (stage_memory event)


def read_totals() -> dict[str, int]:
    """Cache records this process has read so far (keys and bytes): what a training rank reports, so
    that a middle pipeline stage can be shown to read nothing and the last to read no text."""
    return dict(_TOTALS)


def read_entries(index_file: str | Path, keys: Iterable[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Tensors of every key from the cache whose index is ``index_file``, each checked against its checksum."""
    index_file = Path(index_file)
    wanted = sorted(set(keys))
    if not index_file.exists():
        raise CacheReadError(f"Cache index {index_file} is gone: run the 'Cache Latents & Text' node again.")
    db = connect(index_file, readonly=True)
    try:
        rows = {}
        for i in range(0, len(wanted), 500):
            chunk = wanted[i:i + 500]
            q = f"SELECT key, shard, offset, length, checksum FROM entries WHERE key IN ({','.join('?' * len(chunk))})"
            rows.update({r[0]: r[1:] for r in db.execute(q, chunk)})
    finally:
        db.close()
    missing = [k for k in wanted if k not in rows]
    if missing:
        raise CacheReadError(f"{len(missing)} cached item(s) are missing from {index_file} (e.g. {missing[0]}): "
                             "run the 'Cache Latents & Text' node again; it re-encodes them.")
    out = {}
    for key, (shard, offset, length, digest) in rows.items():
        try:
            out[key] = unpack(read_span(index_file.parent / "shards" / shard, offset, length, digest))
            _TOTALS["keys"] += 1
            _TOTALS["bytes"] += length
        except (CorruptRecord, OSError) as exc:
            _forget_shard_state(index_file, shard)
            raise CacheReadError(f"Cached item {key} is damaged ({exc}): run the 'Cache Latents & Text' node "
                                 "again; it detects damaged entries and re-encodes them.") from None
    return out


def _forget_shard_state(index_file: Path, shard: str) -> None:
    """Make the next cache run checksum ``shard`` again even if its size and mtime look unchanged."""
    try:
        db = connect(index_file)
        try:
            db.execute("DELETE FROM shards WHERE name=?", (shard,))
        finally:
            db.close()
    except sqlite3.Error:
        pass  # a read-only cache folder: the error message still tells the user what to do
