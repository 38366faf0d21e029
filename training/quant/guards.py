"""Host-specific guards around ComfyUI's quantized layers, applied once the training model is loaded."""

from __future__ import annotations

import logging

import torch
from torch import nn

from .layers import fixed_compute_dtype, is_comfy_quant_linear

log = logging.getLogger(__name__)


def set_float_weights_trainable(module: nn.Module, trainable: bool) -> int:
    """``requires_grad_`` on every floating-point parameter; return how many were left out.

    ``module.requires_grad_(True)`` raises on integer weights (ComfyUI-GGUF's uint8 ``GGMLTensor``)
    and on ComfyUI's ``QuantizedTensor`` wrappers: only plain floating-point tensors can require grad,
    and only those matter to DeepSpeed's parameter-count partitioning anyway (so the quantized
    weights of a GGUF or per-layer-quantized base are not counted there; their biases and norms are).
    """
    skipped = 0
    for p in module.parameters():
        if p.dtype.is_floating_point and type(p.data) is torch.Tensor:
            p.requires_grad_(trainable)
        else:
            skipped += 1
    return skipped


def force_full_precision_matmul(diffusion_model: nn.Module) -> int:
    """On ComfyUI 0.3.75, make its per-layer-quantized Linears dequantize and run a full-precision matmul.

    There, on a device with fp8 compute, the layer wraps its input in a ``QuantizedTensor`` and runs an
    fp8 matmul that has no backward: the gradient to earlier layers (and to their LoRAs) would be cut.
    Current ComfyUI trains through its own autograd function instead, and has no such switch. The layer
    reads ``_full_precision_mm`` per instance (ComfyUI sets it from the device at load time); the frozen
    fp8 weights stay fp8, only the matmul is done in the compute dtype. Returns how many were switched.
    """
    import comfy.ops

    if hasattr(comfy.ops, "QuantLinearFunc"):  # current ComfyUI: its own backward
        return 0
    switched = 0
    for module in diffusion_model.modules():
        if is_comfy_quant_linear(module) and not getattr(module, "_full_precision_mm", True):
            module._full_precision_mm = True
            switched += 1
    if switched:
        log.warning("This ComfyUI (0.3.x) has no backward for fp8 matmuls: %d fp8 layers compute in full "
                    "precision while training (the weights stay fp8). Update ComfyUI for fp8-compute training.",
                    switched)
    return switched


def match_fixed_compute_dtypes(diffusion_model: nn.Module) -> int:
    """On ComfyUI 0.3.75, let per-layer-quantized Linears take inputs in the training compute dtype.

    Those layers dequantize to the dtype ComfyUI chose at load time (fp32 on CPU) whatever the input
    is, so a bf16 input fails in the matmul. A forward pre-hook casts the input to that dtype and a
    forward hook casts the output back (the matmul runs in the load-time dtype; the weights stay fp8).
    Hooks on the instances, not changes to ComfyUI's class. Returns how many layers got them.
    """
    count = 0
    for module in diffusion_model.modules():
        dtype = fixed_compute_dtype(module) if is_comfy_quant_linear(module) else None
        if dtype is None:
            continue
        seen: list[torch.dtype] = []

        def cast_in(_module, args, dtype=dtype, seen=seen):
            seen[:] = [args[0].dtype]
            return (args[0].to(dtype), *args[1:])

        def cast_out(_module, _args, output, seen=seen):
            return output.to(seen[0]) if seen else output

        module.register_forward_pre_hook(cast_in)
        module.register_forward_hook(cast_out)
        count += 1
    return count
