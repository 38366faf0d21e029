"""What nodes between the loader and Train LoRA did to the MODEL, beyond weight patches.

The training process rebuilds the model from its recipe, so anything the graph attached to the
ModelPatcher would silently vanish. A ModelSampling* node's ``model_sampling`` patch is recorded and
replayed (training/model/sampling_override.py); stacked LoRAs are replayed by nodes/checks/stacked_loras.py; every
other object patch, wrapper or transformer patch is refused here by name, never dropped. Options that
act only in the sampler (CFG functions) are allowed: training never runs CFG.
"""

from __future__ import annotations

from ...training.model.sampling_override import UnreplayableSampling, describe_sampling
from ...training.spec.options import SamplingOverride

_ADVICE = ("Training cannot replay it: remove that node before 'Train LoRA', or move it after the Train "
           "node's MODEL output to sample with it.")


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _nested_keys(value: object) -> list[str]:
    """The non-empty keys of a ComfyUI wrappers/callbacks dict ({type: {key: [functions]}} or {type: [..]})."""
    if not isinstance(value, dict):
        return []
    return [str(k) for k, v in value.items() if v and (not isinstance(v, dict) or any(v.values()))]


def patch_problems(model) -> list[str]:
    """Every MODEL modification other than weight patches and a replayable sampling, named."""
    problems = []
    for key in sorted(getattr(model, "object_patches", {})):
        if key != "model_sampling":
            problems.append(f"The MODEL has an object patch on {key!r}. {_ADVICE}")
    options = getattr(model, "model_options", {}) or {}
    if options.get("model_function_wrapper") is not None:
        problems.append(f"The MODEL has a model function wrapper ({_name(options['model_function_wrapper'])}). "
                        f"{_ADVICE}")
    transformer = options.get("transformer_options", {}) or {}
    for key in ("patches", "patches_replace"):
        kinds = _nested_keys(transformer.get(key))
        if kinds:
            problems.append(f"The MODEL has transformer {key.replace('_', ' ')} ({', '.join(kinds)}). {_ADVICE}")
    for attr in ("wrappers", "callbacks"):
        kinds = _nested_keys(getattr(model, attr, None)) + _nested_keys(transformer.get(attr))
        if kinds:
            problems.append(f"The MODEL has {attr} ({', '.join(sorted(set(kinds)))}). {_ADVICE}")
    for attr, what in (("hook_patches", "hook patches"), ("injections", "injections"),
                       ("additional_models", "additional models")):
        if getattr(model, attr, None):
            problems.append(f"The MODEL carries {what} ({', '.join(map(str, getattr(model, attr)))}). {_ADVICE}")
    return problems


def sampling_override(model) -> tuple[SamplingOverride | None, list[str]]:
    """The graph's ``model_sampling`` patch as a replayable recipe (or the problem with it)."""
    patched = getattr(model, "object_patches", {}).get("model_sampling")
    if patched is None:
        return None, []
    try:
        return describe_sampling(patched), []
    except UnreplayableSampling as exc:
        return None, [str(exc)]
