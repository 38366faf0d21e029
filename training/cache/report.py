"""What a Cache node run did, file by file: the counts, the re-encoded and skipped files, the buckets.

Its :meth:`CacheReport.text` is the node's ``report`` output (every file); :meth:`CacheReport.summary` is
what the node draws on itself, short enough not to be cut by the node's size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CacheReport:
    cached: Counter = field(default_factory=Counter)  # kind -> first-time encodes
    reused: Counter = field(default_factory=Counter)
    reencoded: list[str] = field(default_factory=list)  # "file kind: reason"
    reencoded_kinds: Counter = field(default_factory=Counter)
    by_other_process: Counter = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)  # "file: reason"
    notes: list[str] = field(default_factory=list)
    buckets: Counter = field(default_factory=Counter)  # bucket name -> items
    rehashed: list[str] = field(default_factory=list)  # files whose size/mtime changed, hashed again
    seconds: float = 0.0

    @property
    def encoded(self) -> Counter:
        """Every encode this process ran, first-time and repeated."""
        return self.cached + self.reencoded_kinds

    def text(self) -> str:
        def kinds(c: Counter) -> str:
            return f"{c['latent']} latents, {c['text']} texts"

        lines = [f"cached {kinds(self.cached)}; reused {kinds(self.reused)}; "
                 f"re-encoded {kinds(self.reencoded_kinds)}; skipped {len(self.skipped)} files "
                 f"({self.seconds:.1f} s)"]
        if self.rehashed:
            lines.append(f"{len(self.rehashed)} files changed size or mtime and were hashed again")
        if self.by_other_process:
            lines.append(f"encoded meanwhile by another process: {kinds(self.by_other_process)}")
        if self.buckets:
            lines.append("buckets: " + ", ".join(f"{b} ({n})" for b, n in sorted(self.buckets.items())))
        lines += [f"re-encoded {r}" for r in self.reencoded]
        lines += [f"skipped {s}" for s in self.skipped]
        return "\n".join(lines + self.notes)

    def summary(self, per_kind: int = 3) -> str:
        """:meth:`text` short enough to read on the node: the counts, the notes, and at most ``per_kind``
        re-encoded and skipped files each, with how many more the ``report`` output lists."""
        full = self.text().splitlines()
        head = [line for line in full if not line.startswith(("re-encoded ", "skipped "))]
        for prefix, files in (("re-encoded", self.reencoded), ("skipped", self.skipped)):
            head += [f"{prefix} {f}" for f in files[:per_kind]]
            if len(files) > per_kind:
                head.append(f"{prefix} {len(files) - per_kind} more: the node's report output lists every file")
        return "\n".join(head)
