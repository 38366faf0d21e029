"""ComfyUI's key for each adapter weight: the one mapping from a PEFT parameter in a pipeline layer to
``diffusion_model.<ComfyUI module path>.<factor>``.

Saving (training/adapters/lora_file.py) and continuing from a file (training/adapters/init_lora.py) both
use it, so a file this project writes always maps back to the layers it came from."""

from __future__ import annotations

from collections.abc import Mapping

from .kinds import adapter_kind, split_adapter_name

COMFY_PREFIX = "diffusion_model."


def comfy_key_for(param_name: str, layer_paths: Mapping[int, Mapping[str, str]],
                  adapter: str = "lora") -> tuple[str, str]:
    """Map a PEFT parameter name in a pipeline module to ``(ComfyUI module key, factor's ComfyUI name)``.

    ``param_name`` looks like ``"<layer index>.<attribute>.<inner path>.lora_A.default.weight"`` (or
    ``...lokr_w1.default`` for LoKr); ``layer_paths[layer index][attribute]`` is that attribute's
    module path in the ComfyUI model.
    """
    kind = adapter_kind(adapter)
    split = split_adapter_name(param_name)
    if split is None or split[1] not in kind.factors:
        raise ValueError(f"{param_name!r} is not a PEFT {adapter} weight (expected <module>.<one of "
                         f"{', '.join(kind.factors)}>.default).")
    stem, factor = split
    index_str, _, rest = stem.partition(".")
    attr, _, inner = rest.partition(".")
    try:
        base = layer_paths[int(index_str)][attr]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{param_name!r}: no ComfyUI path is known for layer {index_str} attribute {attr!r}.") from exc
    module_path = ".".join(p for p in (base, inner) if p)
    return COMFY_PREFIX + module_path, kind.factors[factor]
