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


def keep_earlier_lora(lora_output: str, step_dir: str) -> str:
    """Before a run replaces ``<loras>/<name>.safetensors``: where the earlier LoRA stays, as a line for the
    node ("" when there is none yet).

    Each run's final file also has a name in ``step_dir`` (training/loop/engine.py links it there as
    ``<name>-<run>-step<N>``), so replacing the first name loses nothing; the line says where it is. A file
    without such a name (put there by hand, or by a version before them) gets one now, a hard link (else a
    copy) ``<name>-earlier-<its date>.safetensors``, before anything can replace it."""
    from ...training.adapters.lora_file import link_or_copy

    if not os.path.isfile(lora_output):
        return ""
    kept = _same_file_in(step_dir, lora_output)
    if kept is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.stat(lora_output).st_mtime))
        kept = os.path.join(step_dir, f"{lora_stem(os.path.basename(lora_output))}-earlier-{stamp}.safetensors")
        if not os.path.isfile(kept):
            link_or_copy(lora_output, kept)
    shown = os.path.relpath(kept, os.path.dirname(lora_output)).replace(os.sep, "/")
    return (f"this run's {os.path.basename(lora_output)} replaces an earlier run's; that LoRA stays in the LoRA "
            f"list as {shown}.")


def _same_file_in(folder: str, path: str) -> str | None:
    """A name of ``path``'s file (a hard link) in ``folder``, or None."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        candidate = os.path.join(folder, name)
        try:
            if name.endswith(".safetensors") and os.path.samefile(candidate, path):
                return candidate
        except OSError:
            continue
    return None
