"""Why a rank died, from the kernel's own evidence: its out-of-memory killer, or not.

A rank ended by the kernel's OOM killer dies of SIGKILL with no Python traceback, exactly like a rank a
person ends with ``kill -9``. Only the kernel can tell the two apart, and this module reads what it
records, never a guess from the signal:

- its log, where each victim is named by pid ("Out of memory: Killed process 4242 (python3) ...",
  "Memory cgroup out of memory: Killed process 4242 ..."), read from ``/dev/kmsg`` when it is readable
  (root, or ``kernel.dmesg_restrict = 0``); only records written after the rank started count;
- the ``oom_kill`` counter of the rank's memory cgroup (cgroup v2 ``memory.events``, cgroup v1
  ``memory.oom_control``), which counts the cgroup's processes killed by any OOM kill, the machine's or
  a memory limit's. It is read when the rank starts and again when it dies: a rise names the cause.

A SIGKILL without either is reported as a plain kill. :class:`DeathWatch` is used by the supervisor.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
KMSG = Path("/dev/kmsg")
HOST_MEMORY = "host_memory"
_KILLED = re.compile(r"Killed process (\d+) \(")

WHAT_TO_LOWER = ("Lower batch_size or the dataset resolution, run fewer ranks on this machine "
                 "(pipeline_stages x data_parallel), load the model with an fp8 weight_dtype, or close other "
                 "programs.")


@dataclass(frozen=True)
class Death:
    """A rank's cause of death and the kernel evidence for it."""

    cause: str
    evidence: str

    def message(self, rank: int) -> str:
        return (f"rank {rank} was killed by the kernel's out-of-memory killer: host memory ran out "
                f"({self.evidence}). {WHAT_TO_LOWER}")


# ---- the kernel's files ------------------------------------------------------------------------
def oom_kills(text: str) -> int | None:
    """The ``oom_kill`` count in a cgroup v2 ``memory.events`` or v1 ``memory.oom_control`` file."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def cgroup_mounts(mountinfo: str) -> tuple[tuple[Path, str] | None, list[tuple[Path, str]]]:
    """The cgroup v2 mount and the v1 mounts with the memory controller, each as (mount point, mount root)."""
    v2, v1_memory = None, []
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, tail_parts = fields.split(), tail.split()
        if len(parts) < 5 or len(tail_parts) < 3:
            continue
        root, mount_point = parts[3], parts[4]
        fstype, options = tail_parts[0], tail_parts[2].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = (Path(mount_point), root)
        elif fstype == "cgroup" and "memory" in options:
            v1_memory.append((Path(mount_point), root))
    return v2, v1_memory


def _under(mount: tuple[Path, str], path: str) -> Path | None:
    """Where the cgroup ``path`` (as /proc/<pid>/cgroup names it) is inside ``mount``, if it is visible there."""
    mount_point, root = mount
    root = root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    relative = path[len(root):].lstrip("/")
    return mount_point / relative if relative else mount_point


def memory_cgroup_file(proc_cgroup: str, mountinfo: str) -> Path | None:
    """The file holding the ``oom_kill`` counter of a process's memory cgroup (None when there is none).

    ``proc_cgroup`` is ``/proc/<pid>/cgroup`` ("<hierarchy>:<controllers>:<path>" lines). The memory
    controller sits in a v1 hierarchy when one lists it, else in the unified (v2) hierarchy.
    """
    v2, v1_memory = cgroup_mounts(mountinfo)
    v1_path = v2_path = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            v1_path = path
        elif hierarchy == "0" and controllers == "":
            v2_path = path
    candidates: list[Path | None] = []
    if v1_path is not None:
        candidates += [(d / "memory.oom_control") if (d := _under(m, v1_path)) else None for m in v1_memory]
    elif v2_path is not None and v2 is not None:
        d = _under(v2, v2_path)
        candidates.append(d / "memory.events" if d else None)
    return next((c for c in candidates if c is not None and c.is_file()), None)


def killed_in_log(pid: int, messages: Iterable[str]) -> str | None:
    """The kernel log line that names ``pid`` as an OOM-killer victim, if any."""
    for message in messages:
        match = _KILLED.search(message)
        if match and int(match.group(1)) == pid and "out of memory" in message.lower():
            return message.strip()
    return None


def parse_kmsg_record(record: str) -> tuple[int, str] | None:
    """(sequence number, message) of one ``/dev/kmsg`` record ("prio,seq,usec,flags;message")."""
    head, sep, message = record.partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 3 or not fields[1].isdigit():
        return None
    return int(fields[1]), message.splitlines()[0] if message else ""


def read_kmsg(path: Path = KMSG) -> list[tuple[int, str]] | None:
    """Every record in the kernel's log buffer, or None when it cannot be read (restricted or absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    records = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records were overwritten while reading: go on from the next
                    continue
                return None
            if not chunk:
                break
            parsed = parse_kmsg_record(chunk.decode("utf-8", errors="replace"))
            if parsed is not None:
                records.append(parsed)
    finally:
        os.close(fd)
    return records


# ---- the watch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Counter:
    path: Path
    kills: int


class DeathWatch:
    """Snapshots taken when the ranks start, compared when one of them dies."""

    def __init__(self, counters: dict[int, _Counter], kmsg_seq: int | None, kmsg: Path = KMSG):
        self._counters = counters
        self._kmsg_seq = kmsg_seq
        self._kmsg = kmsg

    @classmethod
    def start(cls, pids: Sequence[int], proc: Path = PROC, kmsg: Path = KMSG) -> DeathWatch:
        counters = {}
        try:
            mountinfo = (proc / "self" / "mountinfo").read_text()
        except OSError:
            mountinfo = ""
        for pid in pids:
            try:
                path = memory_cgroup_file((proc / str(pid) / "cgroup").read_text(), mountinfo)
                kills = oom_kills(path.read_text()) if path is not None else None
            except OSError:
                continue
            if path is not None and kills is not None:
                counters[pid] = _Counter(path, kills)
        records = read_kmsg(kmsg)
        seq = max((s for s, _ in records), default=-1) if records is not None else None
        return cls(counters, seq, kmsg)

    def cause(self, pid: int, exit_code: int | None) -> Death | None:
        """Why the process ``pid`` that exited with ``exit_code`` died, when the kernel says it was OOM."""
        if exit_code != -signal.SIGKILL:
            return None
        if self._kmsg_seq is not None:
            records = read_kmsg(self._kmsg) or []
            line = killed_in_log(pid, (m for s, m in records if s > self._kmsg_seq))
            if line is not None:
                return Death(HOST_MEMORY, f"kernel log: {line}")
        counter = self._counters.get(pid)
        if counter is not None:
            try:
                now = oom_kills(counter.path.read_text())
            except OSError:
                now = None
            if now is not None and now > counter.kills:
                return Death(HOST_MEMORY, f"oom_kill {counter.kills} -> {now} in {counter.path}")
        return None
