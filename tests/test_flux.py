"""The Flux family adapter against ComfyUI's own Flux.

Fast tier: small Flux models built from ComfyUI's ``Flux`` class (too small for ComfyUI's detection,
which pins hidden size 3072, but the same code): the stage layers reproduce ``Flux.forward`` exactly,
and their gradients match finite differences (ComfyUI's blocks add to the residual stream in place,
which autograd mishandles unless :mod:`training.pipelines.out_of_place` steps in).
Slow tier: the smallest detectable Flux (535 M parameters): ComfyUI detects the fixture, the stage
layers with a PEFT LoRA equal ComfyUI's forward with the saved LoRA file loaded by its stock loader,
and the real training process trains it.
"""

from __future__ import annotations

import logging
import math
import re
from contextlib import contextmanager

import pytest
import torch
import torch.utils.checkpoint
from pipetrainer.devkit.fixtures import flux_params
from pipetrainer.tests.helpers import losses
from pipetrainer.training.adapters.inject import inject_lora, named_lora_parameters
from pipetrainer.training.adapters.lora_file import atomic_save, lora_state_dict
from pipetrainer.training.data.micro_batches import load_examples
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for
from pipetrainer.training.pipelines.flux import FluxAdapter, FluxOptions
from pipetrainer.training.pipelines.targets import layer_targets, model_targets
from pipetrainer.training.spec.options import LoraSpec
from safetensors import safe_open
from safetensors.torch import load_file

# ---- helpers ---------------------------------------------------------------------------------

# ComfyUI's guidance when a graph sets none (model_base.Flux.extra_conds): the fidelity oracles use it.
COMFY_DEFAULT = FluxOptions(guidance=3.5)


def _small_flux(dtype: torch.dtype, guidance_embed: bool, depth: int = 2, depth_single: int = 2, seed: int = 0):
    """A small ComfyUI Flux with initialised weights (torch.nn layers initialise themselves)."""
    from comfy.ldm.flux.model import Flux

    torch.manual_seed(seed)
    model = Flux(operations=torch.nn, dtype=dtype, **flux_params(
        in_channels=4, out_channels=4, vec_in_dim=8, context_in_dim=8, hidden_size=64, mlp_ratio=2.0,
        num_heads=2, depth=depth, depth_single_blocks=depth_single, axes_dim=[8, 12, 12], theta=10000,
        patch_size=2, qkv_bias=True, guidance_embed=guidance_embed,
    ))
    with torch.no_grad():
        for p in model.parameters():  # larger than default init so every path matters numerically
            p.normal_(0.0, 0.2)
    return model.eval()


def _small_inputs(dtype: torch.dtype, h: int, w: int, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, h, w, generator=g, dtype=dtype)
    t = torch.rand(batch, generator=g, dtype=torch.float32)
    context = torch.randn(batch, 5, 8, generator=g, dtype=dtype)
    y = torch.randn(batch, 8, generator=g, dtype=dtype)
    return x, t, context, y


def _run_layers(layers, inputs, checkpoint: bool = False):
    """Run stage layers in order, as a pipeline does (optionally each under non-reentrant checkpoint)."""
    out = inputs
    for layer in layers:
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(layer, out, use_reentrant=False)
        else:
            out = layer(out)
    return out


@contextmanager
def _captured_warnings():
    """Collect ComfyUI's warning log lines (its loaders log, they do not raise, on key problems)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


def _load_flux(path):
    import comfy.sd

    with _captured_warnings() as warnings:
        patcher = comfy.sd.load_diffusion_model(str(path))
    return patcher, warnings


# ---- fast tier: small ComfyUI Flux ----------------------------------------------------------


def test_flux_is_a_registered_family():
    assert isinstance(adapter_for("Flux"), FluxAdapter)


@pytest.mark.parametrize("guidance_embed", [False, True])
@pytest.mark.parametrize("hw", [(8, 8), (7, 5)])
def test_small_flux_stage_layers_equal_comfyui_forward(comfy_root, guidance_embed, hw):
    """Bit-identical to ComfyUI's Flux.forward, including odd latent sizes (padding and crop)."""
    model = _small_flux(torch.float32, guidance_embed)
    x, t, context, y = _small_inputs(torch.float32, *hw)
    adapter = FluxAdapter()
    guidance = adapter.first_stage_inputs(Batch(x, t, context, y, options=COMFY_DEFAULT))[-1]
    assert torch.equal(guidance, torch.full((x.shape[0],), COMFY_DEFAULT.guidance))
    with torch.no_grad():
        expected = model(x.clone(), t, context.clone(), y=y, guidance=guidance.clone())
        got = _run_layers(adapter.stage_layers(model), adapter.first_stage_inputs(Batch(x, t, context, y, options=COMFY_DEFAULT)))
    assert got.shape == x.shape
    assert torch.equal(got, expected)


def test_small_flux_guidance_changes_output_only_with_guidance_embed(comfy_root):
    x, t, context, y = _small_inputs(torch.float32, 6, 6)
    adapter = FluxAdapter()
    for guidance_embed in (False, True):
        layers = adapter.stage_layers(_small_flux(torch.float32, guidance_embed))
        inputs = adapter.first_stage_inputs(Batch(x, t, context, y, options=COMFY_DEFAULT))
        other = (*inputs[:-1], torch.full_like(inputs[-1], 1.0))
        with torch.no_grad():
            same = torch.equal(_run_layers(layers, inputs), _run_layers(layers, other))
        assert same != guidance_embed


def test_small_flux_without_pooled_vector_uses_zeros_like_comfyui(comfy_root):
    model = _small_flux(torch.float32, guidance_embed=False)
    x, t, context, _ = _small_inputs(torch.float32, 6, 6)
    adapter = FluxAdapter()
    with torch.no_grad():
        expected = model(x.clone(), t, context.clone(), y=None)
        got = _run_layers(adapter.stage_layers(model), adapter.first_stage_inputs(Batch(x, t, context, None, options=COMFY_DEFAULT)))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("depths", [(2, 2), (1, 0), (0, 1)])
def test_small_flux_gradients_match_finite_differences(comfy_root, depths):
    """Autograd through the stage layers, plain and checkpointed, equals central differences in fp64.

    Plain autograd would raise if any tensor saved for backward were modified in place; under
    non-reentrant checkpointing ComfyUI's in-place residual adds gave gradients off by 1e5x here.
    The steps are not tiny because ComfyUI computes the rotary embedding in fp32 even for fp64 models;
    at these steps central differences agree with autograd to ~2e-6 relative.
    """
    model = _small_flux(torch.float64, guidance_embed=True, depth=depths[0], depth_single=depths[1])
    adapter = FluxAdapter()
    layers = adapter.stage_layers(model)
    x, t, context, y = _small_inputs(torch.float64, 6, 6, batch=1)
    blocks = [*model.double_blocks, *model.single_blocks]
    weight = blocks[0].img_attn.qkv.weight if depths[0] else blocks[0].linear1.weight
    model.requires_grad_(False)
    weight.requires_grad_(True)
    rest = (t, context, y, torch.full((1,), COMFY_DEFAULT.guidance, dtype=torch.float64))

    def grads(checkpoint: bool):
        weight.grad = None
        x_in = x.clone().requires_grad_(True)
        _run_layers(layers, (x_in, *rest), checkpoint=checkpoint).pow(2).sum().backward()
        return x_in.grad, weight.grad.clone()

    def value(x_value, weight_value):
        with torch.no_grad():
            saved = weight.detach().clone()
            weight.copy_(weight_value)
            out = _run_layers(layers, (x_value, *rest)).pow(2).sum()
            weight.copy_(saved)
        return out

    grad_x, grad_w = grads(checkpoint=False)
    ckpt_x, ckpt_w = grads(checkpoint=True)
    assert torch.equal(grad_x, ckpt_x) and torch.equal(grad_w, ckpt_w)

    g = torch.Generator().manual_seed(3)
    dx = torch.randn(x.shape, generator=g, dtype=torch.float64)
    dw = torch.randn(weight.shape, generator=g, dtype=torch.float64)
    eps_x, eps_w = 1e-3, 1e-4
    w0 = weight.detach().clone()
    numeric_x = (value(x + eps_x * dx, w0) - value(x - eps_x * dx, w0)) / (2 * eps_x)
    numeric_w = (value(x, w0 + eps_w * dw) - value(x, w0 - eps_w * dw)) / (2 * eps_w)
    assert torch.allclose((grad_x * dx).sum(), numeric_x, rtol=1e-4)
    assert torch.allclose((grad_w * dw).sum(), numeric_w, rtol=1e-4)


def test_small_flux_stage_tuples_follow_the_pipeline_rules(comfy_root):
    """Float tensors crossing layers carry gradients; positions and sizes are integers."""
    model = _small_flux(torch.float32, guidance_embed=False)
    model.requires_grad_(False)
    adapter = FluxAdapter()
    layers = adapter.stage_layers(model)
    x, t, context, y = _small_inputs(torch.float32, 6, 6)
    out = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in adapter.first_stage_inputs(Batch(x, t, context, y, options=COMFY_DEFAULT)))
    for layer in layers[:-1]:
        out = layer(out)
        assert isinstance(out, tuple)
        for v in out:
            assert v.requires_grad if v.is_floating_point() else v.dtype == torch.int64
    assert len(out) == 3  # the last block hands the final layer only (img, vec, hw)


def test_flux_lora_presets_select_comfyui_linears(comfy_root):
    model = _small_flux(torch.float32, guidance_embed=False, depth=1, depth_single=1)
    adapter = FluxAdapter()
    layers = adapter.stage_layers(model)

    def selected(preset):
        regex = adapter.lora_target_regex(preset)
        names = {path for layer in layers for path in layer_targets(layer, regex).values()}
        assert names == set(model_targets(model, regex))  # the stage layers and the whole model agree
        return names

    attention = {f"double_blocks.0.{s}_attn.{p}" for s in ("img", "txt") for p in ("qkv", "proj")}
    attention |= {"single_blocks.0.linear1", "single_blocks.0.linear2"}
    mlp = {f"double_blocks.0.{s}_mlp.{i}" for s in ("img", "txt") for i in (0, 2)}
    modulation = {"double_blocks.0.img_mod.lin", "double_blocks.0.txt_mod.lin", "single_blocks.0.modulation.lin"}
    assert selected("attention") == attention
    assert selected("attention_mlp") == attention | mlp
    assert selected("all_linear") == attention | mlp | modulation


def test_flux_relatives_are_refused_with_a_clear_error(comfy_root):
    from comfy.ldm.flux.model import Flux

    flux2 = Flux(operations=torch.nn, **flux_params(
        in_channels=4, out_channels=4, vec_in_dim=None, context_in_dim=8, hidden_size=64, mlp_ratio=2.0,
        num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 8, 8, 8], theta=10000, patch_size=2,
        qkv_bias=False, guidance_embed=False, global_modulation=True,
    ))
    with pytest.raises(NotImplementedError, match="Flux.2"):
        FluxAdapter().stage_layers(flux2)
    fill = Flux(operations=torch.nn, **flux_params(
        in_channels=8, out_channels=4, vec_in_dim=8, context_in_dim=8, hidden_size=64, mlp_ratio=2.0,
        num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2,
        qkv_bias=True, guidance_embed=True,
    ))
    with pytest.raises(NotImplementedError, match="Fill"):
        FluxAdapter().stage_layers(fill)
    with pytest.raises(NotImplementedError, match="cannot train"):
        FluxAdapter().stage_layers(torch.nn.Linear(2, 2))


# ---- slow tier: the smallest Flux ComfyUI detects ----------------------------------------------


@pytest.mark.slow
def test_min_flux_fixture_is_detected_as_flux_without_key_problems(flux_path):
    patcher, warnings = _load_flux(flux_path)
    model = patcher.model
    assert type(model).__name__ == "Flux"
    assert family_name_for(model) == "Flux"
    cfg = model.model_config.unet_config
    assert (cfg["hidden_size"], cfg["depth"], cfg["depth_single_blocks"], cfg["guidance_embed"]) == (3072, 1, 1, False)
    assert (cfg["context_in_dim"], cfg["vec_in_dim"]) == (768, 768)
    assert not [w for w in warnings if "missing" in w or "unexpected" in w], warnings
    with safe_open(str(flux_path), "pt") as f:
        assert f.get_slice("img_in.weight").get_dtype() == "BF16"


def _demo_example(demo_cache, model):
    example = load_examples(demo_cache.items[:1])[0]
    x0 = model.process_latent_in(example.latent.float()[None])
    return x0, example.cond.float()[None], example.pooled.float()[None]


@pytest.mark.slow
def test_min_flux_stage_layers_with_lora_equal_comfyui_with_the_saved_lora(flux_path, demo_cache, tmp_path):
    """PEFT LoRA in the stage layers == ComfyUI's stock LoRA loader on the saved file.

    Tolerance: |diff| <= 1e-4 * max|reference|. The two sides differ only in where the LoRA enters
    (ComfyUI merges ``W + s*B@A`` into the weights, PEFT adds ``s*B(A x)``): fp32 rounding, measured
    5e-6 at max|reference| 3.4 (1.6e-6 relative). The LoRA itself moves the output by ~0.17, and is
    asserted to move it by over 10x the tolerance, so the comparison cannot pass without the LoRA.
    """
    import comfy.lora
    import comfy.sd
    import comfy.utils

    lora = LoraSpec(rank=4, alpha=8.0, targets="all_linear")
    sigma = torch.tensor([0.7])
    g = torch.Generator().manual_seed(11)
    patcher, _ = _load_flux(flux_path)
    model, dm = patcher.model, patcher.model.diffusion_model
    original_keys = set(dm.state_dict())
    x0, cond, pooled = _demo_example(demo_cache, model)
    odd = torch.randn(1, 16, 9, 7, generator=g)  # padding and crop path
    noisy = [model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1), torch.randn(c.shape, generator=g), c)
             for c in (x0, odd)]
    timestep = model.model_sampling.timestep(sigma).float()
    # The conditioning exactly as ComfyUI's samplers build it from a CLIP-L CONDITIONING.
    conds = model.extra_conds(noise=x0, device=torch.device("cpu"), cross_attn=cond, pooled_output=pooled)
    assert conds["guidance"].cond.item() == COMFY_DEFAULT.guidance  # compared at ComfyUI's default

    def comfy_forward(n):
        return dm(n.clone(), timestep, context=conds["c_crossattn"].cond, y=conds["y"].cond,
                  guidance=conds["guidance"].cond, transformer_options={})

    with torch.no_grad():
        base = [comfy_forward(n) for n in noisy]

    # Adapter side: stage layers over the model, LoRA injected with PEFT, random non-zero lora_B.
    adapter = adapter_for(family_name_for(model))
    layers = list(enumerate(adapter.stage_layers(dm), start=1))
    count = inject_lora(layers, adapter.lora_target_regex(lora.targets), lora, seed=0)
    assert count == 13  # double block: 4 attention, 4 MLP, 2 modulation Linears; single block: 3
    params = named_lora_parameters(torch.nn.ModuleDict({str(i): m for i, m in layers}))
    with torch.no_grad():
        for name, p in params.items():
            if ".lora_B." in name:
                p.normal_(0.0, 0.01, generator=g)
        ours = [_run_layers([m for _, m in layers], adapter.first_stage_inputs(Batch(n, timestep, cond, pooled, options=COMFY_DEFAULT)))
                for n in noisy]
    tensors = lora_state_dict(params, {i: m.comfy_paths for i, m in layers}, lora.alpha)
    lora_path = atomic_save(tensors, tmp_path / "flux-lora.safetensors", {"family": "Flux"})

    # ComfyUI side: the same model with its original Linears back, the file through the stock loader.
    _restore_base_layers(dm)
    assert set(dm.state_dict()) == original_keys
    sd = comfy.utils.load_torch_file(str(lora_path), safe_load=True)
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    with _captured_warnings() as warnings:
        patches = comfy.lora.load_lora(sd, key_map)
    assert not [w for w in warnings if "lora key not loaded" in w], warnings
    assert len(patches) == count and all(k.startswith("diffusion_model.") for k in patches)
    with torch.no_grad():
        with_lora, _ = comfy.sd.load_lora_for_models(patcher, None, sd, 1.0, 0)
        with_lora.patch_model()
        try:
            reference = [comfy_forward(n) for n in noisy]
        finally:
            with_lora.unpatch_model()
    for got, ref, plain in zip(ours, reference, base, strict=True):
        assert got.shape == ref.shape
        scale = ref.abs().max().item()
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4 * scale, (diff, scale)
        assert (ref - plain).abs().max().item() > 10 * 1e-4 * scale


def _restore_base_layers(root: torch.nn.Module) -> None:
    """Undo PEFT injection: put each wrapped Linear (its ``base_layer``, weights untouched) back in place."""
    from peft.tuners.lora import LoraLayer

    wrapped = [name for name, m in root.named_modules() if isinstance(m, LoraLayer)]
    for name in wrapped:
        parent, _, attr = name.rpartition(".")
        holder = root.get_submodule(parent)
        setattr(holder, attr, getattr(holder, attr).get_base_layer())


@pytest.mark.slow
def test_min_flux_trains_in_the_real_training_process(balanced_flux_one_stage, balanced_flux_path):
    """The balanced Flux-min (2 double blocks; its 1-stage run is also the oracle of the 2-stage memory
    test in test_stage_memory.py). Single-block LoRA keys are checked against ComfyUI's loader above."""
    spec, events = balanced_flux_one_stage
    setup = next(e for e in events if e["type"] == "setup")
    assert setup["family"] == "Flux"
    values = losses(events)
    assert len(values) == 3 and all(math.isfinite(v) for v in values), values

    saved = load_file(spec.lora_output)
    with safe_open(str(balanced_flux_path), "pt") as f:
        model_keys = set(f.keys())
    pattern = re.compile(
        r"diffusion_model\.double_blocks\.[01]\.(img|txt)_attn\.(qkv|proj)\.(lora_A\.weight|lora_B\.weight|alpha)"
    )
    assert saved and all(pattern.fullmatch(k) for k in saved), sorted(saved)
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in saved}
    assert len(modules) == 8
    assert all(f"{m.removeprefix('diffusion_model.')}.weight" in model_keys for m in modules)
    with safe_open(spec.lora_output, "pt") as f:
        assert f.metadata()["family"] == "Flux"
    assert any(v.abs().max() > 0 for k, v in saved.items() if k.endswith("lora_B.weight"))
