"""A backward pass for comfy_kitchen's fused RMSNorm + split-half RoPE op, so Cosmos Predict2, Anima and MiniMax-H3
can train (H3's attention calls the op when ``comfy.model_management.in_training`` is set).

Current ComfyUI's Cosmos Predict2 attention (``comfy.ldm.cosmos.predict2.Attention.compute_qkv``) normalises and
ropes its self-attention queries and keys with ``comfy.quant_ops.ck.rms_rope_split_half`` whether or not
``comfy.model_management.in_training`` is set. That is comfy_kitchen's ``torch.library.custom_op``
``comfy_kitchen::rms_rope_split_half``, which registers no autograd formula (it only samples), so backward through
Cosmos Predict2 (and Anima, the same DiT) fails with "no autograd formula was registered". Here the training
process registers one with torch's public API on that op: the op, its forward and ComfyUI's choice of it stay
untouched.

The formula back-propagates through comfy_kitchen's own eager reference of the same op
(``comfy_kitchen.backends.eager.rope.rms_rope_split_half``, the function its registry runs on a CPU). The RMSNorm
makes the op nonlinear in ``q`` and ``k``, so both are kept for the backward (the reference is recomputed there,
one block at a time); the norm scales and the frequency table get their gradients too (a pipeline stage that receives the table
from an earlier one gets a gradient for every tensor it was sent).

Applied by :func:`enable_rms_rope_backward`, idempotent; the Cosmos Predict2, Anima and MiniMax-H3 adapters call it when they
build their stage layers (in the ranks and in the tests alike). tests/test_comfy_kitchen_rms_rope_backward.py
fails when comfy_kitchen registers a formula of its own (then this patch should go) or the op changes.
"""

from __future__ import annotations

import torch

OP = "comfy_kitchen::rms_rope_split_half"
_registered = False


def _backward(ctx, grad_q, grad_k):
    from comfy_kitchen.backends.eager.rope import rms_rope_split_half as reference

    q, k, freqs, q_scale, k_scale = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [q.detach().requires_grad_(), k.detach().requires_grad_(), freqs.detach().requires_grad_(),
                  q_scale.detach().requires_grad_()]
        if ctx.has_k_scale:
            leaves.append(k_scale.detach().requires_grad_())
        outs = reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4] if ctx.has_k_scale else None,
                         ctx.epsilon, ctx.rot_dim)
        used = [(o, g) for o, g in zip(outs, (grad_q, grad_k), strict=True) if g is not None]
        grads = torch.autograd.grad([o for o, _ in used], leaves, [g for _, g in used], allow_unused=True)
    grad_q_in, grad_k_in, grad_freqs, grad_q_scale, *rest = grads
    return grad_q_in, grad_k_in, grad_freqs, grad_q_scale, (rest[0] if ctx.has_k_scale else None), None, None


def _setup_context(ctx, inputs, output) -> None:
    q, k, freqs, q_scale, k_scale, epsilon, rot_dim = inputs
    ctx.has_k_scale = k_scale is not None
    ctx.save_for_backward(q, k, freqs, q_scale, k_scale if k_scale is not None else q_scale)
    ctx.epsilon, ctx.rot_dim = epsilon, rot_dim


def enable_rms_rope_backward() -> bool:
    """Register the backward on comfy_kitchen's fused RMSNorm + split-half RoPE op; False when this ComfyUI has
    no such op (ComfyUI 0.3.75 has no comfy_kitchen, and no Cosmos Predict2 attention that calls it)."""
    global _registered
    if _registered:
        return True
    try:
        import comfy_kitchen  # noqa: F401  (defines the op)
        from comfy_kitchen.backends.eager.rope import rms_rope_split_half  # noqa: F401
    except ImportError:
        return False
    if not hasattr(torch.ops.comfy_kitchen, "rms_rope_split_half"):
        return False
    torch.library.register_autograd(OP, _backward, setup_context=_setup_context)
    _registered = True
    return True
