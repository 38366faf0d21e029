"""Developer commands (host, fixtures, demo); see devkit/cli.py. Run with the project's .venv."""

import importlib.util
import sys
from pathlib import Path

_entry = Path(__file__).resolve().parent.parent / "training" / "process" / "entry.py"
_spec = importlib.util.spec_from_file_location("_pipetrainer_entry", _entry)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.import_pack()

from pipetrainer.devkit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
