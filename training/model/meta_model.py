"""A ComfyUI model built on the meta device from its own config class: its real layout, no weights, no memory.

Why: the memory plan of a model of tens of billions of parameters (MiniMax-H3: 33 B) must be checkable on a
machine that cannot hold it. ComfyUI builds every model from a ``supported_models`` config class and its
``unet_config`` (what detection reads from a file's keys and shapes); building that same class with
``device="meta"`` gives every parameter its real shape and dtype (fp32 islands included) and allocates
nothing. The weight dtype is set as ComfyUI's loader sets it for a ``weight_dtype`` choice
(``set_inference_dtype``): an fp8 choice builds fp8 weights with a 16-bit compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def build_on_meta(config_name: str, unet_config: Mapping[str, Any], weight_dtype: torch.dtype = torch.bfloat16,
                  compute_dtype: torch.dtype | None = None) -> Any:
    """ComfyUI's ``BaseModel`` of ``comfy.supported_models.<config_name>`` for ``unet_config``, on the meta device.

    ``compute_dtype`` is ComfyUI's manual-cast dtype (None: compute in ``weight_dtype``; give one for fp8).
    """
    import comfy.supported_models

    config_class = getattr(comfy.supported_models, config_name, None)
    if config_class is None:
        raise ValueError(f"This ComfyUI has no model config {config_name!r} in comfy.supported_models; "
                         "update ComfyUI or pick a model it supports.")
    config = config_class(dict(unet_config))
    config.set_inference_dtype(weight_dtype, compute_dtype)
    return config.get_model({}, device=torch.device("meta"))


def parameter_count(module: torch.nn.Module) -> int:
    """The module's parameters (meta parameters count by their shapes)."""
    return sum(p.numel() for p in module.parameters())


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers in the dtypes they were built in."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
