"""The SD3-family (MMDiT) stage layers against ComfyUI's own MMDiT, and the out-of-place residual guard.

ComfyUI's joint blocks add their residuals out of place today (``x = x + ...``), unlike its Flux
blocks (``img += ...``), but every family's blocks run under the same guard
(training/pipelines/out_of_place.py) so a ComfyUI change to in-place adds cannot silently corrupt
gradients. Here: the staged forward is bitwise ComfyUI's unsplit forward, and a joint block rewritten
with in-place residual adds (the same arithmetic, as ComfyUI writes its Flux blocks) breaks autograd
on its own but trains through the stage layers with exactly the original gradients. The MMDiT
finite-difference gradient check is tests/test_mmdit_grad.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for


def _load_tiny_mmdit(path):
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(str(path))
    assert family_name_for(patcher.model) == "SD3"
    dm = patcher.model.diffusion_model
    assert next(dm.parameters()).dtype == torch.float32
    return dm


def _inputs(h: int, w: int, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, h, w, generator=g)
    t = torch.tensor([700.0, 120.0])[:batch]
    cond = torch.randn(batch, 7, 768, generator=g)
    pooled = torch.randn(batch, 768, generator=g)
    return x, t, cond, pooled


def _run(layers, inputs, checkpoint: bool = False):
    out = inputs
    for layer in layers:
        out = torch.utils.checkpoint.checkpoint(layer, out, use_reentrant=False) if checkpoint else layer(out)
    return out


def _stage_inputs(adapter, x, t, cond, pooled):
    return adapter.first_stage_inputs(Batch(x, t, cond, pooled, options=adapter.options_type()))


@pytest.mark.parametrize("hw", [(8, 8), (7, 5)])
def test_mmdit_stage_layers_equal_comfyui_forward_bitwise(fixture_paths, hw):
    dm = _load_tiny_mmdit(fixture_paths.mmdit)
    adapter = adapter_for("SD3")
    x, t, cond, pooled = _inputs(*hw)
    with torch.no_grad():
        expected = dm(x.clone(), t, y=pooled, context=cond.clone(), transformer_options={})
        got = _run(adapter.stage_layers(dm), _stage_inputs(adapter, x, t, cond, pooled))
    assert got.shape == x.shape
    assert torch.equal(got, expected)
    assert expected.abs().max() > 0


def _rewrite_residual_adds_in_place(dm) -> int:
    """Give every (non pre-only) half of every joint block ComfyUI's ``post_attention`` with ``+=``."""
    from comfy.ldm.modules.diffusionmodules.mmdit import modulate

    count = 0
    for joint in dm.joint_blocks:
        for half in (joint.context_block, joint.x_block):
            if half.pre_only or half.x_block_self_attn:
                continue

            def post_attention(attn, x, gate_msa, shift_mlp, scale_mlp, gate_mlp, half=half):
                x += gate_msa.unsqueeze(1) * half.attn.post_attention(attn)
                x += gate_mlp.unsqueeze(1) * half.mlp(modulate(half.norm2(x), shift_mlp, scale_mlp))
                return x

            half.post_attention = post_attention
            count += 1
    return count


def _lora_like_grads(dm, layers, inputs, checkpoint: bool):
    """Gradients of the latent and of every block's qkv weight for a fixed loss."""
    weights = [j.x_block.attn.qkv.weight for j in dm.joint_blocks]
    dm.requires_grad_(False)
    for w in weights:
        w.requires_grad_(True)
        w.grad = None
    x = inputs[0].clone().requires_grad_(True)
    out = _run(layers, (x, *inputs[1:]), checkpoint=checkpoint)
    out.pow(2).sum().backward()
    return out.detach(), [x.grad, *(w.grad.clone() for w in weights)]


def test_in_place_residual_adds_in_a_joint_block_do_not_corrupt_autograd(fixture_paths):
    adapter = adapter_for("SD3")
    inputs = _stage_inputs(adapter, *_inputs(6, 6))
    reference_dm = _load_tiny_mmdit(fixture_paths.mmdit)
    ref_out, ref_grads = _lora_like_grads(reference_dm, adapter.stage_layers(reference_dm), inputs, checkpoint=False)

    dm = _load_tiny_mmdit(fixture_paths.mmdit)
    assert _rewrite_residual_adds_in_place(dm) == 2 * len(dm.joint_blocks) - 1  # the last text half is pre-only
    layers = adapter.stage_layers(dm)

    # Unguarded, the rewritten block cannot even be back-propagated: the in-place add hits a tensor
    # autograd needs (here the block's input).
    embedded = layers[0](tuple(v.detach().requires_grad_(v.is_floating_point()) for v in inputs))
    x, c, context, _ = embedded
    with pytest.raises(RuntimeError, match="in-place|inplace"):
        _, out = dm.joint_blocks[0](context, x, c=c, use_checkpoint=False, transformer_options={})
        out.sum().backward()

    # Guarded (the stage layers), plain and checkpointed: the same output and gradients, bit for bit.
    for checkpoint in (False, True):
        out, grads = _lora_like_grads(dm, layers, inputs, checkpoint=checkpoint)
        assert torch.equal(out, ref_out)
        for got, ref in zip(grads, ref_grads, strict=True):
            assert torch.equal(got, ref)
    assert all(g.abs().max() > 0 for g in ref_grads)
