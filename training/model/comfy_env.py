"""Make ComfyUI's model code importable in a process that is not the ComfyUI server.

The training process (and tests, and fixture builders) import ``comfy.*`` from the ComfyUI tree named
in the spec. ComfyUI reads its command-line options from ``comfy.cli_args.args`` at import of
``comfy.model_management`` (and of ``comfy.ldm.modules.attention``, which picks the attention function
from them). So the switches the ComfyUI process was launched with (``--cpu``, the attention backend,
precision and memory flags; see training/model/launch_settings.py) are set there, as the flags would, before
that import: ComfyUI's own switches, no patching of its functions.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def use_comfyui(comfyui_path: str | Path, device: str = "cpu", comfy_args: Mapping[str, Any] | None = None) -> list[str]:
    """Put a ComfyUI tree on ``sys.path`` and set its args before ``comfy.model_management`` loads.

    ``device`` sets ``--cpu``; ``comfy_args`` (attribute -> value, from
    :func:`training.launch_settings.plan_rank_args`) sets the rest. Returns the names of truthy
    settings this ComfyUI version has no option for (not applied; the caller says so in the run log).
    Without ``comfy_args`` a second call after ComfyUI loaded is a no-op; with them it is an error,
    because settings applied after that import would silently not take effect.
    """
    root = str(Path(comfyui_path).resolve())
    if not (Path(root) / "comfy" / "model_management.py").exists():
        raise FileNotFoundError(f"{root} is not a ComfyUI folder (no comfy/model_management.py).")
    if root not in sys.path:
        sys.path.insert(0, root)
    if "comfy.model_management" in sys.modules:
        if comfy_args:
            raise RuntimeError("comfy.model_management is already imported: ComfyUI launch settings must be "
                               "applied before it (use_comfyui first).")
        return []
    import comfy.cli_args

    args = comfy.cli_args.args
    unknown = []
    for name, value in {**(comfy_args or {}), "cpu": device == "cpu"}.items():
        if not hasattr(args, name):
            if value:
                unknown.append(name)
            continue
        setattr(args, name, _fast_features(value) if name == "fast" else value)
    return unknown


def _fast_features(names: Iterable[str]) -> set:
    """``--fast`` names as ComfyUI's ``PerformanceFeature`` set (what its parser makes of the flag)."""
    from comfy.cli_args import PerformanceFeature

    known = {f.value: f for f in PerformanceFeature}
    return {known[n] for n in names if n in known}


def comfy_args_report(names: Iterable[str]) -> dict[str, Any]:
    """The current values of these ``comfy.cli_args.args`` attributes, JSON-ready (for the run log)."""
    import comfy.cli_args

    out = {}
    for name in names:
        value = getattr(comfy.cli_args.args, name, None)
        if isinstance(value, (set, frozenset, list, tuple)):
            value = sorted(str(getattr(v, "value", v)) for v in value)
        out[name] = value
    return out


def attention_in_use() -> str:
    """The name of the attention function ComfyUI's models call (``optimized_attention``)."""
    import comfy.ldm.modules.attention as attention

    return attention.optimized_attention.__name__


def enable_comfy_training_mode() -> None:
    """Tell ComfyUI's model code that it runs under autograd, as ComfyUI's own trainer does.

    Why: on current ComfyUI (seen on 0.28) RoPE (Flux, Wan, Qwen-Image, Lumina 2 / Z-Image, Chroma,
    HunyuanVideo) runs through a ``comfy_kitchen`` custom op that has no autograd formula, so a
    backward pass through any RoPE model fails, unless ``comfy.model_management.in_training`` is True:
    then ComfyUI takes its plain-PyTorch path. ComfyUI's ``TrainLoraNode`` sets the flag around its
    training loop; a training process does nothing but train (and sample previews, which the flag
    leaves correct), so it sets it once, after :func:`use_comfyui` and after the rank has picked its
    GPU (importing ``comfy.model_management`` probes the current device). ComfyUI 0.3.75 has no such
    flag and reads none: the attribute is then unused and harmless.
    """
    import comfy.model_management

    comfy.model_management.in_training = True
