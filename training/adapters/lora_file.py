"""The LoRA file: ComfyUI key names, metadata and atomic writes.

Keys are ``diffusion_model.<ComfyUI module path>.<factor>`` plus ``.alpha``, with the factor names
of the adapter type (training/adapters/kinds.py: ``lora_A.weight``/``lora_B.weight`` for LoRA, ``lokr_w1``...
for LoKr, ``hada_w1_a``... for LoHa), which ComfyUI's ``model_lora_keys_unet`` maps for every
architecture. The mapping from a PEFT parameter name inside a pipeline stage to that key is
:func:`comfy_key_for`, and nothing else in the project builds these strings.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..process.process_util import process_alive
from ..spec.options import LoraSpec
from .keys import comfy_key_for
from .kinds import adapter_kind, split_adapter_name

SAVE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_state_dict(
    named_lora_params: Mapping[str, torch.Tensor],
    layer_paths: Mapping[int, Mapping[str, str]],
    alpha: float,
    dtype: torch.dtype = torch.float32,
    lora: LoraSpec | None = None,
) -> dict[str, torch.Tensor]:
    """ComfyUI-format tensors (each factor per module plus ``alpha``) from PEFT parameters.

    ``lora`` gives the adapter type and rank (default: a LoRA of any rank); ``alpha`` is the one written
    (and folded). The type's ``to_file`` works on fp32 copies (scale folding, training/adapters/kinds.py), and
    only then is each tensor cast to ``dtype``, so a bf16 file is exactly torch's rounding of the fp32
    one. ``alpha`` stays fp32."""
    spec = dataclasses.replace(lora, alpha=alpha) if lora is not None else LoraSpec(alpha=alpha)
    kind = adapter_kind(spec.adapter)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_lora_params.items():
        module_key, _ = comfy_key_for(name, layer_paths, spec.adapter)
        factor = split_adapter_name(name)[1]
        modules.setdefault(module_key, {})[factor] = tensor.detach().to("cpu", torch.float32)
    out: dict[str, torch.Tensor] = {}
    for module_key, factors in modules.items():
        for suffix, tensor in kind.to_file(factors, spec).items():
            cast = tensor if suffix == "alpha" else tensor.to(dtype)
            out[f"{module_key}.{suffix}"] = cast.contiguous()
    return out


def stage_lora_tensors(
    stage_module: torch.nn.Module, layer_paths: Mapping[int, Mapping[str, str]], lora: LoraSpec
) -> dict[str, torch.Tensor]:
    """The LoRA file tensors of one pipeline stage (what the engine saves and gathers), in ``lora.save_dtype``.

    ``.alpha`` is the configured alpha, never the rank: ComfyUI scales by ``alpha / rank`` exactly as
    PEFT did during training, so the file applies at the strength that was trained.
    """
    from .inject import named_lora_parameters

    return lora_state_dict(named_lora_parameters(stage_module), layer_paths, lora.alpha,
                           SAVE_TORCH_DTYPES[lora.save_dtype], lora)


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
