"""A backward pass for comfy_kitchen's split-half RoPE op, so Ernie-Image can train.

Current ComfyUI's ``ErnieImageAttention`` (``comfy.ldm.ernie.model``) applies its rotary embedding with
``comfy.quant_ops.ck.apply_rope_split_half`` even when ``comfy.model_management.in_training`` is set (its
other branch, the fused RMSNorm + RoPE, is the one the flag turns off). That is comfy_kitchen's
``torch.library.custom_op`` ``comfy_kitchen::apply_rope_split_half``, which registers no autograd formula
(comfy_kitchen 0.2.31: it only samples), so backward through Ernie-Image fails with "no autograd formula
was registered". Here the training process registers one with torch's public API on that op: the op, its
forward and ComfyUI's choice of it stay untouched.

The formula back-propagates through comfy_kitchen's own eager reference of the same op
(``comfy_kitchen.backends.eager.rope.apply_rope_split_half``, the function its registry runs on a CPU).
The rotation is linear in ``xq`` and ``xk``, so its vector-Jacobian product does not depend on where it is
taken: only the frequency table is kept for the backward (no extra copy of q and k per block), and the
product is taken at zeros of the inputs' shapes. The table (built from positions, never trained) gets no
gradient.

Applied by :func:`enable_split_half_rope_backward`, idempotent; the Ernie-Image adapter calls it when it
builds its stage layers (in the ranks and in the tests alike). tests/test_comfy_kitchen_rope_backward.py
fails when comfy_kitchen registers a formula of its own (then this patch should go) or the op changes.
"""

from __future__ import annotations

import torch

OP = "comfy_kitchen::apply_rope_split_half"
_registered = False


def _backward(ctx, grad_q, grad_k):
    from comfy_kitchen.backends.eager.rope import apply_rope_split_half as reference

    (freqs,) = ctx.saved_tensors
    with torch.enable_grad():
        leaves = tuple(torch.zeros(shape, dtype=dtype, device=freqs.device, requires_grad=True)
                       for shape, dtype in ctx.inputs)
        outs = reference(*leaves, freqs)
        used = [(o, leaf, g) for o, leaf, g in zip(outs, leaves, (grad_q, grad_k), strict=True) if g is not None]
        grads = torch.autograd.grad([o for o, _, _ in used], [leaf for _, leaf, _ in used], [g for _, _, g in used])
    by_leaf = {id(leaf): g for (_, leaf, _), g in zip(used, grads, strict=True)}
    return by_leaf.get(id(leaves[0])), by_leaf.get(id(leaves[1])), None


def _setup_context(ctx, inputs, output) -> None:
    xq, xk, freqs = inputs
    ctx.save_for_backward(freqs)
    ctx.inputs = ((xq.shape, xq.dtype), (xk.shape, xk.dtype))


def enable_split_half_rope_backward() -> bool:
    """Register the backward on comfy_kitchen's split-half RoPE op; False when this ComfyUI has no such op
    (ComfyUI 0.3.75 has no comfy_kitchen, and no model that calls it)."""
    global _registered
    if _registered:
        return True
    try:
        import comfy_kitchen  # noqa: F401  (defines the op)
        from comfy_kitchen.backends.eager.rope import apply_rope_split_half  # noqa: F401
    except ImportError:
        return False
    if not hasattr(torch.ops.comfy_kitchen, "apply_rope_split_half"):
        return False
    torch.library.register_autograd(OP, _backward, setup_context=_setup_context)
    _registered = True
    return True
