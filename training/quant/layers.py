"""ComfyUI's quantized Linear layers that are not ``nn.Linear``, and the LoRA that wraps them.

ComfyUI's per-layer quantization (``comfy.ops.mixed_precision_ops``: scaled-fp8 and mixed-precision
files on current ComfyUI, ``_quantization_metadata`` files on 0.3.75) builds its ``Linear`` as a plain
``nn.Module`` holding a ``QuantizedTensor`` weight, so PEFT matches nothing there. The class is made
anew by every ``mixed_precision_ops`` call, so it is recognised by its place in ComfyUI (a
``comfy.ops.CastWeightBiasOp`` named ``MixedPrecisionOps.Linear``), never patched.

:class:`QuantLinearLora` is the project's LoRA for those layers. It mirrors PEFT's ``LoraLayer``
layout (``base_layer``, ``lora_A.default``, ``lora_B.default``), so parameter names, freezing,
initialisation and the saved key names (training/adapters/lora_file.py) are the same as for PEFT's layers, and
it computes what PEFT's ``Linear`` computes: the base layer's output (ComfyUI's own forward and
backward) plus ``scaling * B(A(dropout(x)))`` in the LoRA's fp32, cast back to the output's dtype.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def is_comfy_quant_linear(module: nn.Module) -> bool:
    """True for ComfyUI's per-layer-quantization ``Linear`` (a plain ``nn.Module``, not ``nn.Linear``)."""
    ops = sys.modules.get("comfy.ops")
    if ops is None or isinstance(module, nn.Linear):
        return False
    return (isinstance(module, ops.CastWeightBiasOp) and type(module).__qualname__.endswith("MixedPrecisionOps.Linear")
            and hasattr(module, "in_features") and hasattr(module, "out_features"))


def is_linear_like(module: nn.Module) -> bool:
    """A layer that takes a LoRA: ``nn.Linear`` (PEFT) or ComfyUI's quantized Linear (:class:`QuantLinearLora`)."""
    return isinstance(module, nn.Linear) or is_comfy_quant_linear(module)


def fixed_compute_dtype(layer: nn.Module) -> torch.dtype | None:
    """The one input dtype a per-layer-quantized Linear of this ComfyUI computes in, or None if any.

    On 0.3.75 the layer dequantizes to the compute dtype ComfyUI chose at load time (fp32 on CPU)
    whatever its input is, so an input in another training dtype must be cast to it (and the output
    back: training/quant/guards.py). Current ComfyUI casts to the input's dtype itself (and has
    ``QuantLinearFunc``).
    """
    ops = sys.modules.get("comfy.ops")
    if ops is None or hasattr(ops, "QuantLinearFunc"):
        return None
    return getattr(layer, "factory_kwargs", {}).get("dtype")


class QuantLinearLora(nn.Module):
    """A LoRA adapter named ``default`` around a quantized ComfyUI Linear, laid out like PEFT's."""

    adapter = "default"

    def __init__(self, base_layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.lora_A = nn.ModuleDict({self.adapter: nn.Linear(self.in_features, rank, bias=False, dtype=torch.float32)})
        self.lora_B = nn.ModuleDict({self.adapter: nn.Linear(rank, self.out_features, bias=False, dtype=torch.float32)})
        self.lora_dropout = nn.ModuleDict({self.adapter: nn.Dropout(dropout) if dropout > 0 else nn.Identity()})
        self.scaling = {self.adapter: alpha / rank}

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        dtype = result.dtype
        a, b = self.lora_A[self.adapter], self.lora_B[self.adapter]
        lora_x = self.lora_dropout[self.adapter](x.to(a.weight.dtype))
        return (result + b(a(lora_x)) * self.scaling[self.adapter]).to(dtype)


def wrap_quant_linears(layer: nn.Module, names: list[str], rank: int, alpha: float, dropout: float) -> int:
    """Replace each named ComfyUI quantized Linear in ``layer`` by a :class:`QuantLinearLora` around it."""
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, attr, QuantLinearLora(getattr(parent, attr), rank, alpha, dropout))
    return len(names)
