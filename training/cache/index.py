"""The cache index: one SQLite file next to the shards.

Tables: ``entries`` (key -> shard, offset, length, checksum, shapes), ``sources`` (path -> size,
mtime, content digest, probe; the fast path of revalidation), ``slots`` (what each dataset item was
last encoded from, so a re-encode can say why), ``shards`` (size and mtime when last known good, so
only changed shards are re-checked) and ``claims`` (which process is encoding which key right now,
so several processes filling one cache encode each key once). WAL mode lets readers and one writer
at a time work concurrently; every write commits at once, so a killed process loses nothing done.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ..process.process_util import process_alive

INDEX_FILE = "index.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, shard TEXT NOT NULL, offset INTEGER NOT NULL,
    length INTEGER NOT NULL, checksum TEXT NOT NULL, shapes TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS entries_by_shard ON entries (shard);
CREATE TABLE IF NOT EXISTS sources (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, digest TEXT,
    probe TEXT, ctime_ns INTEGER, inode INTEGER);
CREATE TABLE IF NOT EXISTS slots (slot TEXT PRIMARY KEY, key TEXT, components TEXT);
CREATE TABLE IF NOT EXISTS shards (name TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER);
CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, host TEXT, pid INTEGER, at REAL);
"""


@dataclass(frozen=True)
class Entry:
    shard: str
    offset: int
    length: int
    checksum: str
    shapes: str  # JSON {tensor name: shape}


@dataclass(frozen=True)
class Source:
    """A source file as last hashed. ctime and inode join size and mtime in the fast path: a file
    replaced by another one with the same size and a copied-over mtime (``cp -p``, ``rsync -t``)
    still gets a new ctime or inode, so it is hashed again instead of trusted."""

    size: int
    mtime_ns: int
    digest: str
    probe: str  # JSON
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result, digest: str, probe: str) -> Source:
        return cls(st.st_size, st.st_mtime_ns, digest, probe, st.st_ctime_ns, st.st_ino)

    def unchanged(self, st: os.stat_result) -> bool:
        return (self.size, self.mtime_ns, self.ctime_ns, self.inode) == (
            st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
    db = sqlite3.connect(str(path), timeout=60, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)
    _add_missing_columns(db)
    return db


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Indexes written before a column existed gain it (NULL: such sources are simply hashed again)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(sources)")}
    for column in ("ctime_ns", "inode"):
        if column not in have:
            db.execute(f"ALTER TABLE sources ADD COLUMN {column} INTEGER")


class CacheIndex:
    """Typed access to the index tables; each mutating call is its own committed transaction."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / INDEX_FILE
        self.db = connect(self.path)
        self.host = socket.gethostname()
        self.pid = os.getpid()

    def close(self) -> None:
        self.db.close()

    # ---- entries ----------------------------------------------------------------------------
    def entries(self) -> dict[str, Entry]:
        rows = self.db.execute("SELECT key, shard, offset, length, checksum, shapes FROM entries")
        return {r[0]: Entry(*r[1:]) for r in rows}

    def entry_shards(self) -> dict[str, str]:
        """Key -> shard of every entry (the cheap listing revalidation needs)."""
        return dict(self.db.execute("SELECT key, shard FROM entries"))

    def entry(self, key: str) -> Entry | None:
        r = self.db.execute("SELECT shard, offset, length, checksum, shapes FROM entries WHERE key=?",
                            (key,)).fetchone()
        return Entry(*r) if r else None

    def put_entry(self, key: str, entry: Entry, shard_size: int, shard_mtime_ns: int) -> None:
        """Index a written record, note its shard's new state and release the key's claim, atomically."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("INSERT OR REPLACE INTO entries VALUES (?,?,?,?,?,?)",
                            (key, entry.shard, entry.offset, entry.length, entry.checksum, entry.shapes))
            self.db.execute("INSERT OR REPLACE INTO shards VALUES (?,?,?)", (entry.shard, shard_size, shard_mtime_ns))
            self.db.execute("DELETE FROM claims WHERE key=?", (key,))

    def drop_entries(self, keys: list[str]) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany("DELETE FROM entries WHERE key=?", [(k,) for k in keys])

    def entries_of_shard(self, shard: str) -> dict[str, Entry]:
        rows = self.db.execute("SELECT key, shard, offset, length, checksum, shapes FROM entries WHERE shard=?",
                               (shard,))
        return {r[0]: Entry(*r[1:]) for r in rows}

    def shard_end(self, shard: str) -> int:
        r = self.db.execute("SELECT MAX(offset + length) FROM entries WHERE shard=?", (shard,)).fetchone()
        return int(r[0] or 0)

    # ---- shards -----------------------------------------------------------------------------
    def shard_states(self) -> dict[str, tuple[int, int]]:
        return {r[0]: (r[1], r[2]) for r in self.db.execute("SELECT name, size, mtime_ns FROM shards")}

    def put_shard_state(self, name: str, size: int, mtime_ns: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO shards VALUES (?,?,?)", (name, size, mtime_ns))

    # ---- sources and slots ------------------------------------------------------------------
    def sources(self) -> dict[str, Source]:
        rows = self.db.execute("SELECT path, size, mtime_ns, digest, probe, ctime_ns, inode FROM sources")
        return {r[0]: Source(*r[1:]) for r in rows}

    def put_source(self, path: str, source: Source) -> None:
        self.db.execute("INSERT OR REPLACE INTO sources VALUES (?,?,?,?,?,?,?)",
                        (path, source.size, source.mtime_ns, source.digest, source.probe, source.ctime_ns,
                         source.inode))

    def slots(self) -> dict[str, tuple[str, str]]:
        """Slot -> (key, components as JSON text; parsed only when a reason is needed)."""
        return {r[0]: (r[1], r[2]) for r in self.db.execute("SELECT slot, key, components FROM slots")}

    def put_slots(self, rows: list[tuple[str, str, dict]]) -> None:
        if rows:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.executemany("INSERT OR REPLACE INTO slots VALUES (?,?,?)",
                                    [(s, k, json.dumps(c, sort_keys=True)) for s, k, c in rows])

    # ---- claims -----------------------------------------------------------------------------
    def claim(self, key: str) -> bool:
        """Take the right to encode ``key``; False while another live process holds it."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            row = self.db.execute("SELECT host, pid, at FROM claims WHERE key=?", (key,)).fetchone()
            if row and (row[0], row[1]) != (self.host, self.pid) and self._alive(*row):
                return False
            self.db.execute("INSERT OR REPLACE INTO claims VALUES (?,?,?,?)", (key, self.host, self.pid, time.time()))
            return True

    def release(self, key: str) -> None:
        self.db.execute("DELETE FROM claims WHERE key=? AND host=? AND pid=?", (key, self.host, self.pid))

    def _alive(self, host: str, pid: int, at: float, stale_after_s: float = 3600.0) -> bool:
        if host != self.host:  # another machine sharing the folder: trust the claim for a while
            return time.time() - at < stale_after_s
        return process_alive(pid)
