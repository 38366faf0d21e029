"""The mutation check: apply each critical one-line mutant alone and run only the tests that must kill it.

Why a small script and not mutmut or cosmic-ray: the killing tests run real processes (training ranks
over gloo, the supervisor, ComfyUI loaders) that import the pack from its own folder by path, in fresh
interpreters. Those tools mutate and import inside their own runner, generate thousands of mutants by
operator, and cannot say which test must kill which bug. Here the list is short and curated
(tests/mutants.toml), each mutant names its killers, and the whole check runs in minutes.

Each mutant is applied to a private copy of the working tree (tracked and untracked, not ignored
files), never to the tree itself, so agents and editors working there never see a mutant. The copy
gets its own ComfyUI root made of links to the real host, with only ``custom_nodes`` pointing at the
copy: ensure_host() relinks the pack into ``custom_nodes``, and the shared host must keep pointing at
the real checkout. Bytecode caching is off in the copy: a same-length mutant written within the same
second as the original would otherwise run the original's cached bytecode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .host import PACK_DIR, PACK_LINK_NAME, comfyui_root

MUTANTS_FILE = PACK_DIR / "tests" / "mutants.toml"
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    killers: tuple[str, ...]
    user_gets: str


@dataclass(frozen=True)
class Outcome:
    mutant: str
    verdict: str  # killed | SURVIVED | NOT FOUND | TIMEOUT | ERROR
    by: str
    seconds: float


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    """The mutant list; raises ValueError naming every malformed entry."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    entries = tomllib.loads(path.read_text(encoding="utf-8")).get("mutant", [])
    fields = ("id", "file", "original", "replacement", "killers", "user_gets")
    problems = [f"entry {i} ({e.get('id', '?')}): missing {[f for f in fields if not e.get(f)]}"
                for i, e in enumerate(entries) if not all(e.get(f) for f in fields)]
    ids = [e.get("id") for e in entries]
    problems += [f"duplicate id {i!r}" for i in sorted({i for i in ids if ids.count(i) > 1})]
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return [Mutant(e["id"], e["file"], e["original"], e["replacement"], tuple(e["killers"]), e["user_gets"])
            for e in entries]


def _tree_files(pack: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=pack,
                         check=True, capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (pack / f).is_file()]


def make_copy(pack: Path, into: Path) -> tuple[Path, Path]:
    """``(copy of the pack, ComfyUI root for the copy)`` under ``into``."""
    copy = into / "pack"
    for rel in _tree_files(pack):
        target = copy / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pack / rel, target)
    real_host, host = comfyui_root(), into / "ComfyUI"
    if not (real_host / "main.py").exists():
        raise FileNotFoundError(f"No ComfyUI host at {real_host}: run scripts/setup.sh (or set COMFYUI_PATH) first.")
    host.mkdir()
    for entry in real_host.iterdir():
        if entry.name != "custom_nodes":
            (host / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    nodes = host / "custom_nodes"
    nodes.mkdir()
    for entry in (real_host / "custom_nodes").iterdir():
        if entry.name != PACK_LINK_NAME:
            (nodes / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    (nodes / PACK_LINK_NAME).symlink_to(copy, target_is_directory=True)
    return copy, host


def _failed_tests(junit: Path) -> list[str]:
    """Node-id-like names (``file::test``) of the failed or errored test cases in a JUnit report."""
    if not junit.exists():
        return []
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").rsplit(".", 1)[-1]
            failed.append(f"{module}.py::{case.get('name')}")
    return failed


def run_tests(copy: Path, host: Path, node_ids: Sequence[str], junit: Path, timeout: float) -> tuple[int | None, str]:
    """Run ``node_ids`` in the copy; ``(pytest exit code or None on timeout, output tail)``."""
    env = {**os.environ, "COMFYUI_PATH": str(host), "PYTHONDONTWRITEBYTECODE": "1"}
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *node_ids, "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out[-3000:]
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def try_mutant(m: Mutant, copy: Path, host: Path, junit: Path, timeout: float) -> tuple[Outcome, str]:
    path = copy / m.file
    started = time.monotonic()
    if not path.exists():
        return Outcome(m.id, "NOT FOUND", f"{m.file} does not exist", 0.0), ""
    source = path.read_text(encoding="utf-8")
    count = source.count(m.original)
    if count != 1:
        return Outcome(m.id, "NOT FOUND", f"original text found {count} times in {m.file}", 0.0), ""
    path.write_text(source.replace(m.original, m.replacement), encoding="utf-8")
    try:
        code, tail = run_tests(copy, host, m.killers, junit, timeout)
    finally:
        path.write_text(source, encoding="utf-8")
    seconds = time.monotonic() - started
    if code is None:
        return Outcome(m.id, "TIMEOUT", f"no verdict within {timeout:.0f} s (a hang is not a kill)", seconds), tail
    failed = _failed_tests(junit)
    named = [n.split("/")[-1] for n in m.killers]  # a node id, or a whole test file
    killers = [k for k in failed if any(k == n or k.startswith((f"{n}::", f"{n}[")) for n in named)]
    if code == 1 and killers:
        return Outcome(m.id, "killed", killers[0].split("::")[-1], seconds), tail
    if code == 0:
        return Outcome(m.id, "SURVIVED", "every killer passed", seconds), tail
    return Outcome(m.id, "ERROR", f"pytest exit {code}, failed: {failed or 'none'}", seconds), tail


def print_table(outcomes: Sequence[Outcome]) -> None:
    rows = [("mutant", "result", "by", "s")] + [(o.mutant, o.verdict, o.by, f"{o.seconds:.1f}") for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mutants.py", description="Apply each critical mutant alone and run "
                                     "the tests that must kill it (tests/mutants.toml, docs/mutation.md).")
    parser.add_argument("--only", action="append", default=[], metavar="ID", help="run only these mutant ids")
    parser.add_argument("--list", action="store_true", help="list the mutants and their killers, run nothing")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per test run (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = parser.parse_args(argv)
    mutants = load_mutants()
    unknown = sorted(set(args.only) - {m.id for m in mutants})
    if unknown:
        parser.error(f"unknown mutant ids {unknown}; known: {', '.join(m.id for m in mutants)}")
    if args.only:
        mutants = [m for m in mutants if m.id in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.id}: {m.file}: {m.original!r} -> {m.replacement!r}\n  user gets: {m.user_gets}\n"
                  f"  killers: {', '.join(m.killers)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="pipetrainer-mutants-"))
    started = time.monotonic()
    try:
        copy, host = make_copy(PACK_DIR, work)
        junit = work / "junit.xml"
        baseline = list(dict.fromkeys(k for m in mutants for k in m.killers))
        print(f"baseline: {len(baseline)} killer tests on the unmutated copy ({copy}) ...", flush=True)
        code, tail = run_tests(copy, host, baseline, junit, args.timeout * 2)
        if code != 0:
            print(tail)
            print(f"The killer tests fail (or hang) without any mutant (pytest exit {code}): fix them first.")
            return 1
        print(f"baseline passed in {time.monotonic() - started:.0f} s", flush=True)
        outcomes = []
        for m in mutants:
            outcome, tail = try_mutant(m, copy, host, junit, args.timeout)
            outcomes.append(outcome)
            print(f"  {outcome.mutant}: {outcome.verdict} ({outcome.seconds:.1f} s)", flush=True)
            if outcome.verdict not in ("killed", "NOT FOUND"):
                print("    " + "\n    ".join(tail.splitlines()[-15:]))
        print()
        print_table(outcomes)
        bad = [o for o in outcomes if o.verdict != "killed"]
        print(f"\n{len(outcomes) - len(bad)}/{len(outcomes)} killed in {time.monotonic() - started:.0f} s")
        gets = {m.id: m.user_gets for m in mutants}
        for o in bad:
            print(f"{o.verdict}: {o.mutant} ({o.by}); a user would get: {gets[o.mutant]}")
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
