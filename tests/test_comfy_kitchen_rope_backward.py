"""patches/comfy_kitchen_rope_backward.py: the backward of comfy_kitchen's split-half RoPE op (Ernie-Image).

Fails when its target changes: comfy_kitchen registering a formula of its own (drop the patch), the op or
its eager reference going away, or ComfyUI's Ernie-Image attention no longer calling the op in training.
Skips on a ComfyUI without comfy_kitchen (0.3.75), naming it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch


@pytest.fixture
def kitchen(comfy_root):
    pytest.importorskip("comfy_kitchen", reason="this ComfyUI has no comfy_kitchen (added after ComfyUI 0.3.75)")
    assert hasattr(torch.ops.comfy_kitchen, "apply_rope_split_half")


def _freqs(n: int, half: int) -> torch.Tensor:
    """A rotation table shaped ``[1, n, 1, half, 2, 2]`` as ComfyUI's Ernie-Image rope builds it."""
    angle = torch.randn(1, n, 1, half, generator=torch.Generator().manual_seed(1))
    cos, sin = angle.cos(), angle.sin()
    return torch.stack([cos, -sin, sin, cos], dim=-1).reshape(1, n, 1, half, 2, 2)


def test_upstream_op_still_has_no_backward(kitchen):
    """In a fresh Python (nothing registered): backward through the op fails as the patch says."""
    code = textwrap.dedent('''
        import torch, comfy_kitchen
        x = torch.randn(1, 3, 2, 8, requires_grad=True)
        f = torch.ones(1, 3, 1, 4, 2, 2)
        try:
            torch.ops.comfy_kitchen.apply_rope_split_half(x, x, f)[0].sum().backward()
            print("ok")
        except RuntimeError as exc:
            print(str(exc).splitlines()[0])
        ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no autograd formula" in out.stdout, out.stdout


def test_registered_backward_equals_autograd_through_the_eager_reference(kitchen):
    from comfy_kitchen.backends.eager.rope import apply_rope_split_half as reference
    from pipetrainer.patches.comfy_kitchen_rope_backward import enable_split_half_rope_backward

    assert enable_split_half_rope_backward() and enable_split_half_rope_backward()  # idempotent
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, 3, 8, generator=g, requires_grad=True) for _ in range(2))
    freqs = _freqs(5, 4)
    gq, gk = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    out = torch.ops.comfy_kitchen.apply_rope_split_half(q, k, freqs)
    want_out = reference(q, k, freqs)
    assert all(torch.equal(a, b) for a, b in zip(out, want_out, strict=True))  # the forward is untouched
    got = torch.autograd.grad(out, (q, k), (gq, gk))
    want = torch.autograd.grad(want_out, (q, k), (gq, gk))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert a.abs().max() > 0.1
    # only one output used: the other input gets a zero gradient, as autograd gives it
    only_q = torch.autograd.grad(torch.ops.comfy_kitchen.apply_rope_split_half(q, k, freqs)[0].sum(), (q, k),
                                 allow_unused=True)
    torch.testing.assert_close(only_q[0], torch.autograd.grad(reference(q, k, freqs)[0].sum(), q)[0])
    assert only_q[1] is None or not only_q[1].any()


def test_comfyuis_ernie_attention_calls_the_op_in_training(kitchen, monkeypatch):
    """The target: ComfyUI's Ernie-Image attention ropes through ``ck.apply_rope_split_half`` in training mode."""
    import comfy.model_management
    import comfy.ops
    import comfy.quant_ops
    from comfy.ldm.ernie.model import ErnieImageAttention

    calls = []
    original = comfy.quant_ops.ck.apply_rope_split_half
    monkeypatch.setattr(comfy.quant_ops.ck, "apply_rope_split_half", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(comfy.model_management, "in_training", True)
    attn = ErnieImageAttention(16, 2, 8, operations=comfy.ops.disable_weight_init)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    attn(torch.randn(1, 5, 16), image_rotary_emb=_freqs(5, 4))
    assert calls == [1]
