"""GGUF models through ComfyUI-GGUF's own reader and layers, imported from the user's custom_nodes folder.

ComfyUI-GGUF is on no package registry: users clone it into ``custom_nodes``. The graph's loader ran
from that folder, and the node layer records it in the recipe. The training process imports only the
pack's model modules (``ops``, ``loader``, ``dequant``: they need torch, ``gguf`` and ComfyUI's model
code) under a private package name, never its node module (which needs ComfyUI's server). The
weights stay ``GGMLTensor`` (quantized bytes) in its ``nn.Linear`` subclasses, which dequantize per
layer in the forward; PEFT's LoRA wraps them like any Linear.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

GGUF_REPO = "https://github.com/city96/ComfyUI-GGUF"
_PACKAGE = "pipetrainer_comfyui_gguf"


def missing_gguf_message(where: str) -> str:
    return (f"ComfyUI-GGUF was not found at {where}. Install it into ComfyUI's custom_nodes folder "
            f"(git clone {GGUF_REPO}, then pip install gguf) and restart ComfyUI.")


def import_gguf_pack(folder: str | Path) -> ModuleType:
    """ComfyUI-GGUF's package (its ``__init__`` not run) from ``folder``; its submodules import from it."""
    folder = Path(folder)
    if not (folder / "ops.py").is_file() or not (folder / "loader.py").is_file():
        raise FileNotFoundError(missing_gguf_message(str(folder)))
    package = sys.modules.get(_PACKAGE)
    if package is None or Path(package.__path__[0]) != folder:
        spec = importlib.util.spec_from_file_location(_PACKAGE, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = package  # the submodules' relative imports resolve through it
    return package


def gguf_module(folder: str | Path, name: str) -> ModuleType:
    import_gguf_pack(folder)
    return importlib.import_module(f"{_PACKAGE}.{name}")


def load_gguf_model(path: str, folder: str, compute_dtype: torch.dtype):
    """A ModelPatcher for a GGUF diffusion model, built as ComfyUI-GGUF's ``UnetLoaderGGUF`` builds it.

    Same reader (``gguf_sd_loader``), same operations (``GGMLOps``, default dequant/patch dtypes) and
    ComfyUI's ``load_diffusion_model_state_dict``; ``dtype`` is the compute dtype, which is what the
    non-quantized weights (norms, biases) are stored in.
    """
    import comfy.sd

    ops_module, loader = gguf_module(folder, "ops"), gguf_module(folder, "loader")
    ops = ops_module.GGMLOps()
    ops.Linear.dequant_dtype = None
    ops.Linear.patch_dtype = None
    sd = loader.gguf_sd_loader(path)
    for tensor in sd.values():  # the mark makes its layer add a meta "temp.weight" (a VRAM estimate) to
        if getattr(tensor, "is_largest_weight", False):  # every state_dict, which checkpoint saving cannot copy
            tensor.is_largest_weight = False
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops,
                                                                          "dtype": compute_dtype})
    if patcher is None:
        raise ValueError(f"ComfyUI could not detect the model type of {path}.")
    dequantize_again_in_backward(patcher.model.diffusion_model, ops_module.GGMLLayer)
    return patcher


class _DequantizedLinear(torch.autograd.Function):
    """``linear(x, W, b)`` of a frozen GGUF Linear whose W is dequantized again for the backward, not kept.

    Through ComfyUI-GGUF's own forward, autograd keeps each layer's dequantized weight (compute dtype,
    2 bytes per weight in bf16) until the backward has passed it: with activation checkpointing that is
    every Linear of the block being recomputed, which on Flux-min outweighs the whole Q8_0 file. The
    weight is frozen, so the backward needs it only for the input's gradient: the layer's own
    ``cast_bias_weight`` (same dequantization, same patches) makes it again there, as ComfyUI's own
    quantized-training function (``comfy.ops.QuantLinearFunc``) keeps the quantized weight, not a copy.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        weight, bias = layer.cast_bias_weight(x)
        ctx.layer, ctx.dtype = layer, weight.dtype
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        weight, _ = ctx.layer.cast_bias_weight(dtype=ctx.dtype, device=grad.device)
        return grad.to(weight.dtype).matmul(weight).to(grad.dtype), None


def _lean_linear_forward(layer: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return _DequantizedLinear.apply(x, layer)


def dequantize_again_in_backward(diffusion_model: torch.nn.Module, ggml_layer: type) -> int:
    """Route the quantized matmul of every GGUF ``Linear`` through :class:`_DequantizedLinear`; return the count.

    Set on the instances (ComfyUI-GGUF's ``forward_ggml_cast_weights`` hook, which its forward calls for
    quantized weights only), never on the pack's classes.
    """
    count = 0
    for module in diffusion_model.modules():
        if isinstance(module, ggml_layer) and isinstance(module, torch.nn.Linear):
            module.forward_ggml_cast_weights = functools.partial(_lean_linear_forward, module)
            count += 1
    return count
