"""devkit/disk.py: the two test venvs keep one copy of the files they share, and nothing else changes."""

from __future__ import annotations

import os
from pathlib import Path

from pipetrainer.devkit.disk import link_identical_files


def _write(path, data: bytes, mode: int = 0o644):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)


def test_identical_files_become_one_inode_and_the_rest_stay_apart(tmp_path):
    keep, other = tmp_path / "keep", tmp_path / "other"
    for root in (keep, other):
        _write(root / "torch" / "lib.so", b"\x7fELF" + bytes(range(256)) * 40, 0o755)
        _write(root / "torch" / "__init__.py", b"import os\n")
    _write(keep / "pkg" / "RECORD", b"a,1\n")
    _write(other / "pkg" / "RECORD", b"b,1\n")  # same size, other bytes
    _write(keep / "pkg" / "mode.py", b"x = 1\n", 0o644)
    _write(other / "pkg" / "mode.py", b"x = 1\n", 0o600)  # same bytes, other mode
    _write(other / "only_here.py", b"y = 2\n")
    (other / "link.py").symlink_to(other / "only_here.py")

    report = link_identical_files(keep, other)

    assert (report.linked, report.differing) == (2, 2)
    assert report.bytes_saved == (4 + 256 * 40) + len(b"import os\n")
    for rel in ("torch/lib.so", "torch/__init__.py"):
        assert (keep / rel).stat().st_ino == (other / rel).stat().st_ino
        assert (keep / rel).stat().st_nlink == 2
    assert os.access(other / "torch" / "lib.so", os.X_OK)
    assert (other / "pkg" / "RECORD").read_bytes() == b"b,1\n"
    assert (other / "pkg" / "mode.py").stat().st_ino != (keep / "pkg" / "mode.py").stat().st_ino
    assert (other / "link.py").is_symlink() and (other / "only_here.py").read_bytes() == b"y = 2\n"
    assert not list(other.rglob(".*pipetrainer-link"))

    again = link_identical_files(keep, other)  # already linked: nothing to do
    assert (again.linked, again.bytes_saved) == (0, 0)


def test_a_python_source_of_another_time_keeps_its_own_bytecode_cache(tmp_path):
    """A linked ``.py`` has one modification time; each venv's ``.pyc`` records its own copy's, so linking
    sources of different times would leave one venv's bytecode stale (every import compiling it again)."""
    import importlib.util
    import py_compile

    keep, other = tmp_path / "keep", tmp_path / "other"
    for root, when in ((keep, 1_700_000_000), (other, 1_700_000_500)):
        _write(root / "pkg" / "mod.py", b"x = 1\n")
        _write(root / "pkg" / "same.py", b"y = 2\n")
        os.utime(root / "pkg" / "same.py", (1_600_000_000, 1_600_000_000))
        os.utime(root / "pkg" / "mod.py", (when, when))
        for name in ("mod.py", "same.py"):
            py_compile.compile(str(root / "pkg" / name), doraise=True)

    report = link_identical_files(keep, other)

    assert (report.linked, report.sources_kept) == (1, 1)
    assert (keep / "pkg" / "same.py").stat().st_ino == (other / "pkg" / "same.py").stat().st_ino
    source = other / "pkg" / "mod.py"
    assert source.stat().st_ino != (keep / "pkg" / "mod.py").stat().st_ino
    cached = Path(importlib.util.cache_from_source(str(source))).read_bytes()
    assert int.from_bytes(cached[8:12], "little") == int(source.stat().st_mtime)  # still valid for its source
