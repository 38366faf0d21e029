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
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .process_util import process_alive
from .spec import LoraSpec

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


def stage_lora_tensors(
    stage_module: torch.nn.Module, layer_paths: Mapping[int, Mapping[str, str]], lora: LoraSpec
) -> dict[str, torch.Tensor]:
    """The LoRA file tensors of one pipeline stage (what the engine saves and gathers).

    ``.alpha`` is the configured alpha, never the rank: ComfyUI scales by ``alpha / rank`` exactly as
    PEFT did during training, so the file applies at the strength that was trained.
    """
    from .lora_inject import named_lora_parameters

    return lora_state_dict(named_lora_parameters(stage_module), layer_paths, lora.alpha)


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


def step_lora_name(lora_output: str | Path, run_dir: str | Path, step: int) -> str:
    """``<lora name>-<run id>-step<N>.safetensors``: the file name of one save of one run.

    The run id is the run dir's name without the ``<lora name>-`` it starts with (the node layer
    names run dirs ``<lora name>-<time>-<random>``), so names of two runs never collide and sort by
    run, then step."""
    stem = Path(lora_output).stem
    run = Path(run_dir).name
    run_id = run[len(stem) + 1:] if run.startswith(stem + "-") and len(run) > len(stem) + 1 else run
    return f"{stem}-{run_id}-step{step:07d}.safetensors"


def link_or_copy(source: str | Path, target: str | Path) -> Path:
    """Make ``target`` a second name of the finished file ``source``, atomically.

    A hard link costs no disk and keeps the content even when ``source`` is later replaced (an
    atomic save makes a new file) or deleted; across file systems, or where links are not allowed,
    it is a copy. Readers of ``target`` see nothing or the complete file."""
    source, target = Path(source), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _remove_dead_writers_temp_files(path: Path) -> None:
    """Delete ``.<name>.<pid>.*.tmp`` files left by writers that were killed mid-save."""
    prefix = f".{path.name}."
    for leftover in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid_text = leftover.name[len(prefix):].split(".", 1)[0]
        if pid_text.isdigit() and not process_alive(int(pid_text)):
            leftover.unlink(missing_ok=True)


def family_metadata(adapter: object, diffusion_model: object, options: object) -> dict[str, str]:
    """LoRA metadata of the family's typed options: ``family_options`` (JSON) plus what the adapter's
    optional ``run_metadata(diffusion_model, options)`` adds (e.g. ``wan.expert``, ``wan.expert_boundary``)."""
    import dataclasses

    out = {}
    if dataclasses.is_dataclass(options) and dataclasses.fields(options):
        out["family_options"] = json.dumps(dataclasses.asdict(options), sort_keys=True)
    run_metadata = getattr(adapter, "run_metadata", None)
    if run_metadata is not None:
        out.update(run_metadata(diffusion_model, options))
    return out
