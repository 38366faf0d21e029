"""ComfyUI-GGUF Linears that dequantize their frozen weight again in backward instead of keeping it.

Through ComfyUI-GGUF's own forward, autograd keeps each layer's dequantized weight (compute dtype,
2 bytes per weight in bf16) until the backward has passed it: with activation checkpointing that is
every Linear of the block being recomputed, which on Flux-min outweighs the whole Q8_0 file. The
weight is frozen, so the backward needs it only for the input's gradient: the layer's own
``cast_bias_weight`` (same dequantization, same patches) makes it again there, as ComfyUI's own
quantized-training function (``comfy.ops.QuantLinearFunc``) keeps the quantized weight, not a copy.

The patch is set on layer instances, never on the pack's classes: it replaces the instance's
``forward_ggml_cast_weights``, the hook ComfyUI-GGUF's ``GGMLLayer.forward_comfy_cast_weights`` calls for
quantized weights (checked against city96/ComfyUI-GGUF 795e451). When that method no longer calls the
hook, the patch **falls back**: the pack's own forward runs (same results, more memory) and one
``[pipetrainer]`` line says so.
"""

from __future__ import annotations

import functools
import inspect

import torch

TARGET_METHOD = "forward_comfy_cast_weights"
_CALL_SITE = "self.forward_ggml_cast_weights("


class _DequantizedLinear(torch.autograd.Function):
    """``linear(x, W, b)`` of a frozen GGUF Linear whose W is dequantized again for the backward, not kept."""

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


def why_not_applicable(ggml_layer: type) -> str | None:
    """Why replacing ``forward_ggml_cast_weights`` on instances of ``ggml_layer`` would change nothing, or None."""
    method = getattr(ggml_layer, TARGET_METHOD, None)
    try:
        calls = method is not None and _CALL_SITE in inspect.getsource(method)
    except (OSError, TypeError):
        calls = False
    return None if calls else f"ComfyUI-GGUF's {ggml_layer.__name__}.{TARGET_METHOD} no longer calls {_CALL_SITE})"


def dequantize_again_in_backward(diffusion_model: torch.nn.Module, ggml_layer: type) -> int:
    """Route the quantized matmul of every GGUF ``Linear`` through :class:`_DequantizedLinear`; return the
    count (0, with one log line, when this ComfyUI-GGUF no longer calls the hook)."""
    reason = why_not_applicable(ggml_layer)
    if reason is not None:
        print(f"[pipetrainer] GGUF lean-backward patch NOT applied: {reason}. Training runs through "
              "ComfyUI-GGUF's own forward (same results, each dequantized weight kept for the backward: more "
              "memory). Update patches/gguf_lean_backward.py for this ComfyUI-GGUF.", flush=True)
        return 0
    count = 0
    for module in diffusion_model.modules():
        if isinstance(module, ggml_layer) and isinstance(module, torch.nn.Linear):
            module.forward_ggml_cast_weights = functools.partial(_lean_linear_forward, module)
            count += 1
    return count
