"""A backward pass for ComfyUI's flash-attn op, so ``--use-flash-attention`` can train.

With ``--use-flash-attention`` ComfyUI's models call ``attention_flash``, which runs flash-attn through
a ``torch.library.custom_op`` (``flash_attn_wrapper`` in ``comfy.ldm.modules.attention``; named
``flash_attention::flash_attn`` on 0.3.75, ``comfy::flash_attn`` on current ComfyUI). ComfyUI registers
no autograd formula for it (it only samples), so backward through it fails with "no autograd formula
was registered". Here the training process registers one with torch's public API on ComfyUI's own op
object: ComfyUI's attention functions and its choice of them stay untouched.

The formula recomputes the forward with ``flash_attn_func`` under autograd and back-propagates through
it, which runs flash-attn's own backward kernel: one extra attention forward per backward (a cost
bench/attention.py measures), no dependency on flash-attn's private functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def register_recompute_backward(op: Any, forward: Callable[..., torch.Tensor]) -> None:
    """Give the custom op ``op`` (args ``q, k, v, *options``) the gradient of ``forward(q, k, v, *options)``.

    ``forward`` must compute what the op computes, differentiably; only q, k and v get gradients.
    """

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, *options = inputs
        ctx.save_for_backward(q, k, v)
        ctx.options = tuple(options)

    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
            out = forward(*leaves, *ctx.options)
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (*grads, *([None] * len(ctx.options)))

    op.register_autograd(backward, setup_context=setup_context)


def _flash_forward(flash_attn_func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``flash_attn_func`` called the way ComfyUI's op calls it (0.3.75: dropout, causal; current: + scale)."""

    def forward(q, k, v, dropout_p: float = 0.0, causal: bool = False, softmax_scale: float = -1.0):
        if dropout_p:
            raise ValueError("flash attention with dropout cannot be recomputed exactly for its backward.")
        scale = None if softmax_scale == -1.0 else softmax_scale
        return flash_attn_func(q, k, v, dropout_p=0.0, causal=causal, softmax_scale=scale)

    return forward


def enable_flash_attention_backward() -> bool:
    """Register the backward on ComfyUI's flash op; False when ComfyUI has no such op.

    On a torch without ``torch.library.custom_op`` ComfyUI cannot define the op, and its
    ``attention_flash`` then always falls back to SDPA: the caller says so in the run log.
    """
    import comfy.ldm.modules.attention as attention
    from flash_attn import flash_attn_func

    op = getattr(attention, "flash_attn_wrapper", None)
    if not hasattr(op, "register_autograd"):
        return False
    register_recompute_backward(op, _flash_forward(flash_attn_func))
    return True
