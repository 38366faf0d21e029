"""Helpers shared by the precision, quantized-file and GGUF tests on the tiny MMDiT (SD3 family).

The trainer's side is the stage layers over a replayed base with the LoRA injected as the engine
injects it; ComfyUI's side is a second load of the same base with the stock LoRA loader
(:func:`trainer_vs_comfyui`). Inputs are built with the model's own ``model_sampling``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pipetrainer.training.adapters.inject import inject_lora, named_lora_parameters
from pipetrainer.training.adapters.keys import comfy_key_for
from pipetrainer.training.adapters.lora_file import lora_state_dict
from pipetrainer.training.pipelines.base import Batch, adapter_for
from pipetrainer.training.spec.options import LoraSpec

ADAPTER = "SD3"
LINEARS = 37  # the tiny MMDiT's Linear layers in its blocks (4 blocks; the last text stream is pre-only)
TARGETED = {"attention_mlp": 29, "all_linear": LINEARS}


def comfy_compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI computes this model in (its BaseModel._apply_model casts inputs to it)."""
    return model.manual_cast_dtype or model.get_dtype()


def with_lora(patcher, lora: LoraSpec):
    """``(adapter, [(index, layer)], stage)``: the stage layers over the patcher's model with the LoRA
    injected (PEFT's, or ours on ComfyUI's per-layer-quantized Linear), as the engine builds them."""
    adapter = adapter_for(ADAPTER)
    layers = list(enumerate(adapter.stage_layers(patcher.model.diffusion_model), start=1))
    count = inject_lora(layers, adapter.lora_target_regex(lora.targets), lora, seed=0)
    assert count == TARGETED[lora.targets]
    return adapter, layers, torch.nn.ModuleDict({str(i): layer for i, layer in layers})


def run_layers(layers, inputs):
    """The stage layers in order, as one pipeline stage runs them."""
    out = inputs
    for _, layer in layers:
        out = layer(out)
    return out


def random_batch(seed: int = 0, tokens: int = 77):
    """``(x0, cond, pooled, noise, sigma)`` shaped like the tiny MMDiT's 64 px CLIP-L inputs, batch 2."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, tokens, 768, generator=g),
            torch.randn(2, 768, generator=g), torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.8]))


def model_inputs(model, x0, cond, pooled, noise, sigma):
    """``(noisy, timestep, cond, pooled)`` in ComfyUI's compute dtype, built with the model's own sampling."""
    dtype = comfy_compute_dtype(model)
    noisy = model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
    return noisy.to(dtype), model.model_sampling.timestep(sigma).float(), cond.to(dtype), pooled.to(dtype)


def storage(weight: torch.Tensor) -> torch.Tensor:
    """The bytes a weight holds: ComfyUI's ``QuantizedTensor`` keeps them in ``_qdata``."""
    data = getattr(weight, "_qdata", None)
    return weight.data if data is None else data


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for exact comparisons of any dtype (fp8, GGML blocks included)."""
    return storage(t).detach().contiguous().reshape(-1).view(torch.uint8)


def lora_layers(stage) -> dict[str, torch.nn.Module]:
    """``{name: LoRA-wrapped layer}`` (PEFT's LoraLayer or our QuantLinearLora)."""
    from peft.tuners.lora import LoraLayer
    from pipetrainer.training.quant.layers import QuantLinearLora

    return {n: m for n, m in stage.named_modules() if isinstance(m, (LoraLayer, QuantLinearLora))}


def unmapped_keys(tensors: dict[str, torch.Tensor], patcher) -> set[str]:
    """LoRA file keys ComfyUI's key map for this model does not take (its loader would skip them)."""
    import comfy.lora

    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    stems = {k.rsplit(".", 2)[0] if k.endswith((".lora_A.weight", ".lora_B.weight")) else k.rsplit(".", 1)[0]
             for k in tensors}
    return {s for s in stems if s not in key_map}


def trainer_vs_comfyui(ours, load_theirs: Callable[[], object], lora: LoraSpec,
                       tensors: dict[str, torch.Tensor] | None, batch):
    """``(max|trainer - ComfyUI| / scale, max|ComfyUI with - without LoRA| / scale, LoRA tensors, trainer output)``.

    Trainer: the stage layers over ``ours`` (a replayed base) with the LoRA holding ``tensors`` (None:
    random B ~ N(0, 0.5), whose tensors are returned). ComfyUI: ``load_theirs()``, a second load of the
    same base (as the graph's loader returns it), with the tensors through its stock LoRA loader; each
    side's inputs are built in its own compute dtype.
    """
    import comfy.sd

    adapter, layers, stage = with_lora(ours, lora)
    params = named_lora_parameters(stage)
    paths = {i: layer.comfy_paths for i, layer in layers}
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in params.items():
            if tensors is None:
                if ".lora_B." in name:
                    p.normal_(0.0, 0.5, generator=g)
            else:
                key, kind = comfy_key_for(name, paths)
                p.copy_(tensors[f"{key}.{kind}"])
    if tensors is None:
        tensors = lora_state_dict(params, paths, lora.alpha)
    noisy, timestep, cond, pooled = model_inputs(ours.model, *batch)
    with torch.no_grad():
        got = run_layers(layers, adapter.first_stage_inputs(Batch(noisy, timestep, cond, pooled,
                                                                  options=adapter.options_type())))
    theirs = load_theirs()
    dm = theirs.model.diffusion_model
    noisy, timestep, cond, pooled = model_inputs(theirs.model, *batch)
    with torch.no_grad():
        plain = dm(noisy, timestep, context=cond, y=pooled).float()
        patched, _ = comfy.sd.load_lora_for_models(theirs, None, tensors, 1.0, 0)
        patched.patch_model()
        try:
            reference = dm(noisy, timestep, context=cond, y=pooled).float()
        finally:
            patched.unpatch_model()
    scale = reference.abs().max().item()
    diff = (got.float() - reference).abs().max().item() / scale
    return diff, (reference - plain).abs().max().item() / scale, tensors, got


def train_steps(patcher, adapter, layers, params, steps: int, compute: torch.dtype | None = None) -> list[float]:
    """``steps`` AdamW steps (lr 3e-2) through the stage layers on one fixed batch (8 text tokens, since
    CPU bf16 and fp8 casts are slow); returns the losses. Each step checks that every LoRA parameter got a
    finite gradient; with ``compute``, also that the output is in it and the gradients are fp32."""
    from pipetrainer.training.loop.engine import _inputs_need_grad
    from pipetrainer.training.objective.loss import mse_loss

    optimizer = torch.optim.AdamW(params, lr=3e-2, weight_decay=0.0)
    x0, cond, pooled, noise, sigma = random_batch(tokens=8)
    noisy, timestep, cond, pooled = model_inputs(patcher.model, x0, cond, pooled, noise, sigma)
    inputs = adapter.first_stage_inputs(Batch(noisy, timestep, cond, pooled, options=adapter.options_type()))
    values = []
    for _ in range(steps):
        out = run_layers(layers, _inputs_need_grad(inputs))
        assert compute is None or out.dtype == compute
        loss = mse_loss(out, noise - x0)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        assert compute is None or all(p.grad.dtype == torch.float32 for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        values.append(loss.item())
    return values
