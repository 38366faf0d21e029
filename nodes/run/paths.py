"""Where a run writes: the LoRA in ComfyUI's loras folder (each save of each run in a subfolder of it),
the run dir under the output folder.

LoRA names are plain file stems: nothing may be written outside those folders.
"""

from __future__ import annotations

import os
import re
import secrets
import time

import folder_paths

_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}
_ALLOWED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._+-]*$")
STEP_LORAS_FOLDER = "pipetrainer"  # the subfolder of models/loras with each run's saves


def lora_name_problems(name: str) -> list[str]:
    stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else name
    problems = []
    if not stem.strip():
        problems.append("lora_name is empty: give the LoRA a file name, e.g. my_style.")
    elif "/" in stem or "\\" in stem or ".." in stem or os.path.isabs(stem):
        problems.append(f"lora_name {name!r} must be a plain file name (no folders, '..' or absolute paths).")
    elif stem.split(".")[0].lower() in _RESERVED:
        problems.append(f"lora_name {name!r} is a reserved device name on Windows: choose another name.")
    elif not _ALLOWED.match(stem):
        problems.append(f"lora_name {name!r} may only use letters, digits, space, '.', '_', '+' and '-'.")
    return problems


def lora_stem(name: str) -> str:
    return name[: -len(".safetensors")] if name.endswith(".safetensors") else name


def loras_dir() -> str:
    return folder_paths.get_folder_paths("loras")[0]


def lora_output_path(name: str) -> str:
    return os.path.join(loras_dir(), lora_stem(name) + ".safetensors")


def step_loras_dir(name: str) -> str:
    """``<loras>/pipetrainer/<name>/``: every save of every run of this LoRA, named by run and step, where
    the stock LoraLoader lists them (as ``pipetrainer/<name>/<file>``) beside the final file."""
    return os.path.join(loras_dir(), STEP_LORAS_FOLDER, lora_stem(name))


def runs_root() -> str:
    return os.path.join(folder_paths.get_output_directory(), "pipetrainer", "runs")


def new_run_dir(name: str) -> str:
    """A fresh, unique run dir: two trainings never share one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(runs_root(), f"{lora_stem(name)}-{stamp}-{secrets.token_hex(3)}")
    os.makedirs(path)
    return path
