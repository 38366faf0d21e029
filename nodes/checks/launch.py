"""Read how this ComfyUI process was launched, for the run spec (training/model/launch_settings.py).

The flags come from ``comfy.cli_args.args``, what ComfyUI itself parsed, never from ``sys.argv`` (a
launcher or another custom node may have set them, and ComfyUI's parser applies implications, such
as ``--force-fp16`` setting fp16_unet). The GPUs come from the Train node's ``gpus`` input, checked
against what this process can see (nodes/checks/gpus.py).
"""

from __future__ import annotations

import os
import sys

from ...training.model.launch_settings import LaunchSettings, settings_from_args
from .gpus import GpuInfo, cpu_gpus_problems, parse_gpus, select_gpus, visible_gpus


def comfyui_device() -> str:
    """"cuda" when ComfyUI computes on a CUDA GPU, else "cpu" (the training process does the same)."""
    import comfy.model_management

    return "cuda" if comfy.model_management.get_torch_device().type == "cuda" else "cpu"


def picked_attention() -> str:
    """The attention function ComfyUI's models call in this process ("" before ComfyUI loaded it)."""
    module = sys.modules.get("comfy.ldm.modules.attention")
    return getattr(getattr(module, "optimized_attention", None), "__name__", "")


def resolve_gpus(text: str, ranks: int, device: str, visible: list[GpuInfo] | None = None) -> tuple[tuple[int, ...], list[str]]:
    """The GPU of each rank from the ``gpus`` input, with every problem (none on CPU unless it is set)."""
    if device != "cuda":
        return (), cpu_gpus_problems(text)
    requested, problems = parse_gpus(text)
    if problems:
        return (), problems
    return select_gpus(requested, ranks, visible_gpus() if visible is None else visible)


def launch_settings(gpus: tuple[int, ...] = ()) -> LaunchSettings:
    """This ComfyUI process's launch settings, with the ranks' GPUs."""
    import comfy.cli_args

    return settings_from_args(comfy.cli_args.args, os.environ, picked_attention=picked_attention(), gpus=gpus)
