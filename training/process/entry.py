"""Command-line entry of the training process, started by file path.

The pack's folder name (``ComfyUI-PipeTrainer``) is not a Python module name, so this file imports
the pack as the package ``pipetrainer`` from its own location, then hands over to the supervisor or a
rank. ``import_pack`` is also what tests use to import the pack.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = "pipetrainer"
PACK_DIR = Path(__file__).resolve().parents[2]


def import_pack(name: str = PACKAGE):
    """Import this pack as a package called ``name`` (idempotent)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PACK_DIR / "__init__.py",
                                                  submodule_search_locations=[str(PACK_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    commands = {"supervise": 1, "rank": 1, "warm": 3, "warm-rank": 0}
    if not argv or argv[0] not in commands or len(argv) != 1 + commands[argv[0]]:
        print("usage: entry.py supervise|rank <spec.json> | warm <device> <parent pid> <log dir> | warm-rank",
              file=sys.stderr)
        return 2
    import_pack()
    command, args = argv[0], argv[1:]
    entry = str(Path(__file__).resolve())
    if command == "supervise":
        from pipetrainer.training.process.supervisor import supervise

        return supervise(args[0], entry=entry)
    if command == "warm":
        from pipetrainer.training.process.warm_supervisor import warm_supervise

        return warm_supervise(entry, device=args[0], parent_pid=int(args[1]), log_dir=args[2])
    if command == "warm-rank":
        from pipetrainer.training.process.warm_rank import run_warm_rank

        return run_warm_rank()
    from pipetrainer.training.process.rank import run_rank

    return run_rank(args[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
