"""The SD3/MMDiT family's LoRA gradients equal finite differences, through the stage layers as trained.

The engine runs the family's stage layers after ``_inputs_need_grad``, each under torch's
non-reentrant activation checkpoint, with PEFT LoRA in the blocks' Linears (and whatever residual
guard the adapter applies inside its blocks). Here the same layers, over a small ComfyUI MMDiT in
float64 (ComfyUI's MMDiT runs in fp64 when built with ``torch.nn`` operations), give the same
gradients plain and checkpointed, and those equal central differences of the loss along random
directions of LoRA A and B and of the input latent (measured: within 1e-9 relative; asserted 1e-7).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint
from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora, named_lora_parameters
from pipetrainer.training.loop.engine import _inputs_need_grad
from pipetrainer.training.pipelines.base import Batch
from pipetrainer.training.pipelines.mmdit import MMDiTAdapter
from pipetrainer.training.spec.options import LoraSpec


def _small_mmdit(seed: int = 0):
    """A small ComfyUI MMDiT (depth 2, hidden 128) in float64 with every weight drawn at a visible scale."""
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper

    torch.manual_seed(seed)
    model = OpenAISignatureMMDITWrapper(
        input_size=None, patch_size=2, in_channels=4, out_channels=4, depth=2, adm_in_channels=8,
        num_patches=16 * 16, pos_embed_max_size=16, pos_embed_scaling_factor=None,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 8, "out_features": 128}},
        operations=torch.nn, dtype=torch.float64,
    )
    with torch.no_grad():
        for p in model.parameters():  # ComfyUI zero-inits modulation and final layers; make every path count
            p.normal_(0.0, 0.08)
    return model.eval()


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 6, 6, generator=g, dtype=torch.float64)
    t = torch.tensor([420.0], dtype=torch.float32)  # ComfyUI hands timesteps over as fp32
    context = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
    y = torch.randn(1, 8, generator=g, dtype=torch.float64)
    return x, t, context, y


def _run(layers, inputs, checkpoint: bool):
    """The stage layers in order, as one pipeline stage runs them (optionally checkpointed per layer)."""
    run = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False) if checkpoint else None
    out = inputs
    for layer in layers:
        out = run(layer, out) if run else layer(out)
    return out


@pytest.mark.parametrize("targets", ["attention_mlp", "all_linear"])
def test_mmdit_lora_gradients_match_finite_differences(comfy_root, targets):
    adapter = MMDiTAdapter()
    model = _small_mmdit()
    model.requires_grad_(False)
    layers = adapter.stage_layers(model)
    count = inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex(targets),
                        LoraSpec(rank=2, alpha=4.0), seed=0)
    # 2 blocks of 2 streams x (qkv, proj, fc1, fc2) [+ adaLN], but the last text stream is pre-only (qkv [+ adaLN])
    assert count == {"attention_mlp": 13, "all_linear": 17}[targets]
    stage = torch.nn.ModuleList(layers)
    params = freeze_all_but_lora(stage)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in params:  # fp64 LoRA, and B non-zero so A has a gradient
            p.data = p.data.double()
        for name, p in named_lora_parameters(stage).items():
            if ".lora_B." in name:
                p.normal_(0.0, 0.3, generator=g)
    x, t, context, y = _inputs()
    rest = adapter.first_stage_inputs(Batch(x, t, context, y, options=adapter.options_type()))[1:]

    def grads(checkpoint: bool):
        """(latent gradient, LoRA gradients); the latent enters through the engine's first layer."""
        for p in params:
            p.grad = None
        leaves = _inputs_need_grad((x, *rest))
        _run(layers, leaves, checkpoint).pow(2).sum().backward()
        return leaves[0].grad, [p.grad.clone() for p in params]

    def value(x_value, scale: float = 0.0, deltas=()):
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, d in zip(params, deltas, strict=False):  # no deltas: the LoRA as it is
                p.add_(scale * d)
            out = _run(layers, (x_value, *rest), checkpoint=False).pow(2).sum()
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        return out

    plain_x, plain_w = grads(checkpoint=False)
    ckpt_x, ckpt_w = grads(checkpoint=True)
    assert torch.equal(plain_x, ckpt_x)
    assert all(torch.equal(a, b) for a, b in zip(plain_w, ckpt_w, strict=True))
    assert all(w.dtype == torch.float64 and w.abs().max() > 0 for w in plain_w)

    eps = 1e-6
    directions = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    numeric_w = (value(x, eps, directions) - value(x, -eps, directions)) / (2 * eps)
    analytic_w = sum((gw * d).sum() for gw, d in zip(plain_w, directions, strict=True))
    assert torch.allclose(analytic_w, numeric_w, rtol=1e-7), (analytic_w.item(), numeric_w.item())

    dx = torch.randn(x.shape, generator=g, dtype=torch.float64)
    numeric_x = (value(x + eps * dx) - value(x - eps * dx)) / (2 * eps)
    analytic_x = (plain_x * dx).sum()
    assert torch.allclose(analytic_x, numeric_x, rtol=1e-7), (analytic_x.item(), numeric_x.item())
