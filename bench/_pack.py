"""Import this pack as the package ``pipetrainer`` from a bench script (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACK_DIR = Path(__file__).resolve().parent.parent


def import_pack():
    spec = importlib.util.spec_from_file_location("_pipetrainer_entry", PACK_DIR / "training" / "process" / "entry.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry.import_pack()
