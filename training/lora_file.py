"""The LoRA file: ComfyUI key names, metadata and atomic writes.

Keys are ``diffusion_model.<ComfyUI module path>.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha``,
which ComfyUI's ``model_lora_keys_unet`` maps for every architecture. The mapping from a PEFT
parameter name inside a pipeline stage to that key is :func:`comfy_key_for`, and nothing else in the
project builds these strings.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .process_util import process_alive

_PEFT_SUFFIXES = {
    ".lora_A.default.weight": "lora_A.weight",
    ".lora_B.default.weight": "lora_B.weight",
}
COMFY_PREFIX = "diffusion_model."


def comfy_key_for(param_name: str, layer_paths: Mapping[int, Mapping[str, str]]) -> tuple[str, str]:
    """Map a PEFT parameter name in a pipeline module to ``(ComfyUI module key, lora_A/lora_B)``.

    ``param_name`` looks like ``"<layer index>.<attribute>.<inner path>.lora_A.default.weight"``;
    ``layer_paths[layer index][attribute]`` is that attribute's module path in the ComfyUI model.
    """
    match = next(((suffix, kind) for suffix, kind in _PEFT_SUFFIXES.items() if param_name.endswith(suffix)), None)
    if match is None:
        raise ValueError(f"{param_name!r} is not a PEFT LoRA weight (expected lora_A/lora_B.default.weight).")
    suffix, kind = match
    stem = param_name[: -len(suffix)]
    index_str, _, rest = stem.partition(".")
    attr, _, inner = rest.partition(".")
    try:
        base = layer_paths[int(index_str)][attr]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{param_name!r}: no ComfyUI path is known for layer {index_str} attribute {attr!r}.") from exc
    module_path = ".".join(p for p in (base, inner) if p)
    return COMFY_PREFIX + module_path, kind


def lora_state_dict(
    named_lora_params: Mapping[str, torch.Tensor],
    layer_paths: Mapping[int, Mapping[str, str]],
    alpha: float,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """ComfyUI-format tensors (``lora_A``/``lora_B`` per module plus ``alpha``) from PEFT parameters."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named_lora_params.items():
        module_key, kind = comfy_key_for(name, layer_paths)
        out[f"{module_key}.{kind}"] = tensor.detach().to("cpu", dtype).contiguous()
        out[f"{module_key}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def atomic_save(tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, object]) -> Path:
    """Write a safetensors file so that readers see either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    _remove_dead_writers_temp_files(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(dict(tensors), tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a LoRA is a normal shared file
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _remove_dead_writers_temp_files(path: Path) -> None:
    """Delete ``.<name>.<pid>.*.tmp`` files left by writers that were killed mid-save."""
    prefix = f".{path.name}."
    for leftover in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid_text = leftover.name[len(prefix):].split(".", 1)[0]
        if pid_text.isdigit() and not process_alive(int(pid_text)):
            leftover.unlink(missing_ok=True)
