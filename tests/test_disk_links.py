"""devkit/disk.py: the two test venvs keep one copy of the files they share, and nothing else changes."""

from __future__ import annotations

import os

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
