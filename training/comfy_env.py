"""Make ComfyUI's model code importable in a process that is not the ComfyUI server.

The training process (and tests, and fixture builders) import ``comfy.*`` from the ComfyUI tree named
in the spec. ComfyUI reads its command-line options from ``comfy.cli_args.args`` at import of
``comfy.model_management``; setting ``cpu`` there (ComfyUI's own switch, as ``--cpu`` would) must
happen before that import on machines without a usable GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path


def use_comfyui(comfyui_path: str | Path, device: str = "cpu") -> None:
    """Put a ComfyUI tree on ``sys.path`` and choose its device before ``comfy.model_management`` loads."""
    root = str(Path(comfyui_path).resolve())
    if not (Path(root) / "comfy" / "model_management.py").exists():
        raise FileNotFoundError(f"{root} is not a ComfyUI folder (no comfy/model_management.py).")
    if root not in sys.path:
        sys.path.insert(0, root)
    if "comfy.model_management" in sys.modules:
        return
    import comfy.cli_args

    comfy.cli_args.args.cpu = device == "cpu"
