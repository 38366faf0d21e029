"""Continuing from an existing LoRA file (the LoRA Adapter's ``init_lora``), for every adapter type.

The file's keys are mapped back onto the trainer's adapter parameters by the save mapping itself
(:func:`~.lora_file.comfy_key_for` of each PEFT parameter gives the key it would be saved under), and each
type's ``from_file`` undoes its ``to_file`` (LoKr with both factors whole: alpha / rank divided back out of
``lokr_w1``). Training starts from the file's exact values as fp32 (a bf16 file's bf16 values, widened).

Policy, chosen so a continued run is exactly the file and nothing is guessed:

- the adapter type is read from the key names and must be the node's ``adapter``;
- rank and alpha are not taken from the file but must equal the node's (the error says which values to
  set): the trainer's layout and its scale come from the node, the file must fit them. A LoRA file
  without ``alpha`` keys means alpha = rank (ComfyUI's rule); a whole-factor LoKr file shows neither
  (its layout and shapes are checked instead);
- every file key must land on a target of this run (another model's LoRA, or a text-encoder part, is an
  error naming the keys), and every target must have its weights in the file (a file trained on fewer
  targets is an error: choose its preset and blocks);
- shapes must equal the trainer's (an error names the key, the file and the expected shape).

The file's content digest is part of the training hash (``LoraSpec.init_lora_digest``); the training
process checks that the file still has it.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..spec.options import LoraSpec
from .keys import COMFY_PREFIX, comfy_key_for
from .kinds import REGISTRY, AdapterKind, adapter_kind, split_adapter_name

MAX_NAMED = 5


class InitLoraError(ValueError):
    """The init LoRA file cannot continue this run; the message says what to change."""


@dataclass(frozen=True)
class InitFile:
    """One LoRA file, read: ``modules`` maps each ComfyUI module path (without ``diffusion_model.``) to its
    ``{ComfyUI suffix: fp32 tensor}`` (``alpha`` included); ``adapter`` is the type its keys show."""

    path: str
    adapter: str
    modules: Mapping[str, Mapping[str, torch.Tensor]]

    def alphas(self) -> set[float]:
        return {float(f["alpha"]) for f in self.modules.values() if "alpha" in f}

    def ranks(self) -> set[int]:
        kind = adapter_kind(self.adapter)
        ranks = (kind.file_rank({s: tuple(t.shape) for s, t in f.items()}) for f in self.modules.values())
        return {r for r in ranks if r is not None}


def file_digest(path: str | Path) -> str:
    """SHA-256 of the whole file (LoRA files are small; every byte counts for the training hash)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def _suffix_owners() -> dict[str, str]:
    """ComfyUI key suffix -> adapter type (``alpha`` is shared and maps to "")."""
    owners = {suffix: kind.name for kind in REGISTRY.values() for suffix in kind.factors.values()}
    owners["alpha"] = ""
    return owners


def _split_key(key: str, owners: Mapping[str, str]) -> tuple[str, str] | None:
    if not key.startswith(COMFY_PREFIX):
        return None
    rest = key[len(COMFY_PREFIX):]
    for suffix in sorted(owners, key=len, reverse=True):
        if rest.endswith("." + suffix):
            return rest[: -len(suffix) - 1], suffix
    return None


_CACHE: dict[tuple[str, int, int], InitFile] = {}


def read_init_file(path: str | Path) -> InitFile:
    """The file's tensors by module, as fp32, and its adapter type; raises :class:`InitLoraError` for keys
    that are not PipeTrainer's ComfyUI format or that mix adapter types. Cached per file version."""
    from safetensors.torch import load_file

    path = str(path)
    stat = os.stat(path)
    cache_key = (path, stat.st_size, stat.st_mtime_ns)
    if cache_key in _CACHE:
        return _CACHE[cache_key]
    owners = _suffix_owners()
    modules: dict[str, dict[str, torch.Tensor]] = {}
    foreign = []
    types: dict[str, list[str]] = {}
    try:
        tensors = load_file(path)
    except Exception as exc:  # safetensors raises its own error type for a file that is not safetensors
        raise InitLoraError(f"init_lora {path} cannot be read as a safetensors LoRA ({exc}): choose another "
                            "file, or 'none'.") from exc
    for key, tensor in tensors.items():
        split = _split_key(key, owners)
        if split is None:
            foreign.append(key)
            continue
        module, suffix = split
        modules.setdefault(module, {})[suffix] = tensor.to(torch.float32)
        if owners[suffix]:
            types.setdefault(owners[suffix], []).append(key)
    if foreign:
        raise InitLoraError(
            f"init_lora {path}: {len(foreign)} keys are not in the format PipeTrainer saves and continues from "
            f"(diffusion_model.<module>.<factor> of {', '.join(REGISTRY)}): {_named(sorted(foreign))}. "
            "Choose a LoRA saved by PipeTrainer (or one with the same key names), or 'none'.")
    if len(types) != 1:
        what = ("mixes adapter types: " + "; ".join(f"{t} ({_named(sorted(k))})" for t, k in sorted(types.items()))
                if types else "holds no adapter weights")
        raise InitLoraError(f"init_lora {path} {what}. Choose a file of one adapter type, or 'none'.")
    init = InitFile(path, next(iter(types)), modules)
    _CACHE.clear()
    _CACHE[cache_key] = init
    return init


def init_problems(init: InitFile, lora: LoraSpec, target_paths: Collection[str],
                  model_linears: Collection[str] = ()) -> list[str]:
    """Every reason ``init`` cannot start a run of ``lora`` whose targets are ``target_paths`` (ComfyUI
    module paths); ``model_linears``: all Linear paths of the model, to tell "other targets" from "other
    model". Shapes are checked when the values are copied (:func:`load_init_values`)."""
    where = f"init_lora {init.path}"
    problems = []
    if init.adapter != lora.adapter:
        return [f"{where} is a {init.adapter} file (its keys are {', '.join(adapter_kind(init.adapter).factors.values())}"
                f"), but the LoRA Adapter's adapter is {lora.adapter!r}: set adapter to {init.adapter!r}."]
    targets = set(target_paths)
    unmapped = sorted(m for m in init.modules if m not in targets)
    if unmapped:
        keys = [f"{COMFY_PREFIX}{m}.{next(iter(init.modules[m]))}" for m in unmapped]
        other_targets = [m for m in unmapped if m in set(model_linears)]
        hint = (f"{len(other_targets)} of them are Linears of this model outside targets {lora.targets!r}"
                f"{' and blocks ' + repr(lora.blocks) if lora.blocks.strip() else ''}: choose the preset and blocks "
                "the file was trained with" if other_targets
                else "they name no Linear of this model: the file is a LoRA for another model")
        problems.append(f"{where}: {len(unmapped)} of its modules map to no target of this run ({_named(keys)}); "
                        f"{hint}.")
    missing = sorted(t for t in targets if t not in init.modules)
    if missing:
        problems.append(f"{where} has no weights for {len(missing)} of this run's {len(targets)} targets "
                        f"({_named(missing)}): choose the targets preset and blocks the file was trained with.")
    ranks = init.ranks()
    if ranks and ranks != {lora.rank}:
        problems.append(f"{where} has rank {', '.join(map(str, sorted(ranks)))}, the LoRA Adapter {lora.rank}: set "
                        f"rank to {min(ranks)} (a continued run keeps the file's rank).")
    kind = adapter_kind(lora.adapter)
    alphas = init.alphas()
    if not alphas and kind.name == "lora" and ranks:
        alphas = set(map(float, ranks))  # ComfyUI: no alpha key means alpha = rank (scale 1)
    if alphas and any(not math.isclose(a, lora.alpha, rel_tol=1e-6) for a in alphas):
        problems.append(f"{where} has alpha {', '.join(f'{a:g}' for a in sorted(alphas))}, the LoRA Adapter "
                        f"{lora.alpha:g}: set alpha to {min(alphas):g} (the file's weights assume its scale).")
    return problems


def check_init_lora(init: InitFile, lora: LoraSpec, diffusion_model: nn.Module, target_regex: str) -> None:
    """Raise :class:`InitLoraError` with every problem of ``init`` for this run (the training process, on
    every rank, over the whole model: a stage sees only its own targets)."""
    from ..pipelines.targets import model_targets
    from ..quant.layers import is_linear_like

    if lora.init_lora_digest and file_digest(init.path) != lora.init_lora_digest:
        raise InitLoraError(f"init_lora {init.path} changed since the graph was queued: queue the graph again.")
    linears = [n for n, m in diffusion_model.named_modules() if n and is_linear_like(m)]
    problems = init_problems(init, lora, model_targets(diffusion_model, target_regex), linears)
    if problems:
        raise InitLoraError("\n".join(problems))


def load_init_values(layers: Collection[tuple[int, nn.Module]], init: InitFile, lora: LoraSpec) -> int:
    """Copy the file's values into the adapters of ``(layer index, layer)`` (after injection); return how
    many tensors were set. A layout or shape that differs from the trainer's is an :class:`InitLoraError`
    naming the key, the file and the expected shape."""
    kind = adapter_kind(lora.adapter)
    modules: dict[str, dict[str, nn.Parameter]] = {}
    for index, layer in layers:
        paths = {index: getattr(layer, "comfy_paths", {})}
        for name, param in layer.named_parameters(prefix=str(index)):
            split = split_adapter_name(name)
            if split is None:
                continue
            module_key, _ = comfy_key_for(name, paths, lora.adapter)
            modules.setdefault(module_key[len(COMFY_PREFIX):], {})[split[1]] = param
    count = 0
    for path, params in modules.items():
        if path not in init.modules:
            raise InitLoraError(f"init_lora {init.path} has no weights for {path}: choose the targets preset and "
                                "blocks the file was trained with.")
        values = kind.from_file(init.modules[path], lora)
        _check_layout(kind, init, path, params, values, lora)
        with torch.no_grad():
            for factor, param in params.items():
                param.data = param.data.float() if param.dtype != torch.float32 else param.data
                param.copy_(values[factor])
                count += 1
    return count


def _check_layout(kind: AdapterKind, init: InitFile, path: str, params: Mapping[str, nn.Parameter],
                  values: Mapping[str, torch.Tensor], lora: LoraSpec) -> None:
    if set(values) != set(params):
        file_keys = ", ".join(f"{kind.factors[f]}" for f in sorted(values))
        want = ", ".join(f"{kind.factors[f]}" for f in sorted(params))
        raise InitLoraError(
            f"init_lora {init.path}: {COMFY_PREFIX}{path} has {file_keys}, but at rank {lora.rank}"
            f"{f' and factor {lora.factor}' if kind.name == 'lokr' else ''} the trainer's {kind.name} has {want}: "
            "set the rank (and factor) the file was trained with.")
    for factor, param in params.items():
        if tuple(values[factor].shape) != tuple(param.shape):
            raise InitLoraError(
                f"init_lora {init.path}: key {COMFY_PREFIX}{path}.{kind.factors[factor]} has shape "
                f"{list(values[factor].shape)}, expected {list(param.shape)} (rank {lora.rank}): the file is for "
                "another model or another rank.")
