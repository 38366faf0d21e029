"""The family test table: every trainable family is one row, and every row inherits every generic check.

A row says how to get a small ComfyUI model of the family (the tier is in its ``tier``), an example
latent (odd sizes, so padding and cropping are exercised) and the extra conditioning ComfyUI hands the
model. The checks compare with ComfyUI's own code, never with our formulas:

- the staged forward equals ComfyUI's unsplit ``BaseModel.apply_model``;
- autograd through the LoRA equals central finite differences (plain and checkpointed);
- every LoRA preset selects Linears, the same ones in the stage layers and in the whole model;
- every key the trainer saves is consumed by ComfyUI's key map (``comfy.lora.model_lora_keys_unet``),
  and ComfyUI's LoRA loader applying the file reproduces the trainer's forward;
- the default sigma sampling follows the model's ``model_sampling`` schedule;
- preflight's view of the model (``layer_layout``, geometry) agrees with the stage layers;
- slow tier: 2 training steps in 1 and in 2 pipeline stages of the real process tree are bitwise equal.

Adding a family: one module in training/pipelines/, one module of rows in tests/family_rows/, one workflow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from pipetrainer.tests.family_rows import Row, all_rows
from pipetrainer.tests.family_rows.common import cache_items, collect_warnings, joined_streams
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for, known_families
from pipetrainer.training.spec.choices import TARGET_PRESETS
from pipetrainer.training.spec.options import LoraSpec

ROWS = all_rows()
BY_NAME = {row.name: row for row in ROWS}


def test_every_registered_family_has_a_row():
    assert set(known_families()) == {row.family for row in ROWS}


# ---- models ----------------------------------------------------------------------------------


RTOL = 5e-3


def _load(row: Row, comfy_root: Path, fixture_paths):
    """A fresh ModelPatcher of the row's model (the LoRA checks change modules, so never shared)."""
    return row.load(comfy_root, fixture_paths)


@pytest.fixture(params=[row.name for row in ROWS])
def row(request) -> Row:
    return BY_NAME[request.param]


# ---- one example -------------------------------------------------------------------------------


def _example(row: Row, model, seed: int = 0):
    """``(noisy, sigma, cond, pooled, Noised, extras, clean, latent_shapes)`` of one seeded example, built as the
    trainer builds it (a model taking several latents as one, LTX-2, gets them packed: ``latent_shapes``)."""
    from pipetrainer.training.objective.loss import noisy_input_and_target

    adapter = adapter_for(row.family)
    dm = model.diffusion_model
    context, pooled_dim = adapter.conditioning_dims(dm)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(1, *row.latent, generator=g)
    x0 = model.process_latent_in(raw)
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.7])
    cond = torch.randn(1, row.tokens, context, generator=g)
    pooled = torch.randn(1, pooled_dim, generator=g) if pooled_dim else None
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    noisy = model.model_sampling.noise_scaling(sigma.view(-1, *[1] * (x0.ndim - 1)), noise, x0)
    extras = row.extras(model, x0, g)
    assert set(extras) <= set(adapter.extras(dm)), sorted(extras)
    x0, shapes = joined_streams(adapter, model, raw, x0, extras)
    if shapes:  # the packed latent, noised as one (as ComfyUI's sampler and the trainer do)
        noise = torch.randn(x0.shape, generator=g)
        noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
        noisy = model.model_sampling.noise_scaling(sigma.view(-1, *[1] * (x0.ndim - 1)), noise, x0)
    return noisy, sigma, cond, pooled, noised, extras, x0, shapes


def _staged(adapter, layers, noised, cond, pooled, options, extras, clean, checkpoint: bool = False, shapes=()):
    batch = Batch(noised.network_input, noised.timestep, cond, pooled, extras=extras, options=options, clean=clean,
                  latent_shapes=shapes)
    out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in adapter.first_stage_inputs(batch))
    for layer in layers:
        out = torch.utils.checkpoint.checkpoint(layer, out, use_reentrant=False) if checkpoint else layer(out)
    return out


def _comfy_denoised(model, noisy, sigma, cond, pooled, row: Row, options, extras) -> torch.Tensor:
    # a row's kwargs may replace c_crossattn by what the model's extra_conds makes of the cond (LTX-2's connectors)
    kwargs = {"c_crossattn": cond, **row.comfy_kwargs(cond, pooled, options, extras)}
    with torch.no_grad():
        return model.apply_model(noisy, sigma, **kwargs)


def _with_lora(adapter, layers, preset: str, rank: int = 4, alpha: float = 2.0, seed: int = 3):
    """PEFT LoRA in the stage layers (as the trainer injects it), with seeded non-zero B."""
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora, named_lora_parameters

    lora = LoraSpec(rank=rank, alpha=alpha, targets=preset)
    indexed = list(enumerate(layers, start=1))
    count = inject_lora(indexed, adapter.lora_target_regex(preset), lora, seed=seed)
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in indexed})  # named like a PipelineModule
    freeze_all_but_lora(stage)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_lora_parameters(stage).items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lora, indexed, stage, count


# ---- generic checks ----------------------------------------------------------------------------


def test_staged_forward_equals_comfyuis_unsplit_forward(row, comfy_root, fixture_paths):
    patcher = _load(row, comfy_root, fixture_paths)
    model = patcher.model
    assert family_name_for(model) == row.family
    adapter = adapter_for(row.family)
    options = adapter.options_type()
    noisy, sigma, cond, pooled, noised, extras, clean, shapes = _example(row, model)
    with torch.no_grad():
        out = _staged(adapter, adapter.stage_layers(model.diffusion_model), noised, cond, pooled, options, extras, clean,
                      shapes=shapes)
    assert out.shape == noisy.shape
    ours = model.model_sampling.calculate_denoised(sigma, out.float(), noisy)
    theirs = _comfy_denoised(model, noisy, sigma, cond, pooled, row, options, extras)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()


def test_lora_gradients_match_finite_differences(row, comfy_root, fixture_paths):
    """Autograd on every LoRA parameter (plain and under non-reentrant checkpointing, which the engine
    uses) equals the central difference of the loss along a random direction.

    The models are fp32 (ComfyUI casts some inputs to fp32 itself, so fp64 is not an option): at
    eps 1e-2 forward rounding leaves the central difference good to ~1e-3 relative; RTOL allows 5x
    that. Wrong gradients (in-place residual adds under checkpointing, a lost LoRA scale) are off by
    factors, not per mille."""
    from pipetrainer.training.adapters.inject import named_lora_parameters

    model = _load(row, comfy_root, fixture_paths).model
    adapter = adapter_for(row.family)
    options = adapter.options_type()
    _, sigma, cond, pooled, noised, extras, clean, shapes = _example(row, model, seed=1)
    layers = adapter.stage_layers(model.diffusion_model)
    _, _, stage, _ = _with_lora(adapter, layers, "attention_mlp")
    params = list(named_lora_parameters(stage).values())

    def loss(checkpoint=False):
        out = _staged(adapter, layers, noised, cond, pooled, options, extras, clean, checkpoint, shapes)
        return (out - noised.target).pow(2).mean()

    plain = torch.autograd.grad(loss(), params)
    checked = torch.autograd.grad(loss(checkpoint=True), params)
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
    g = torch.Generator().manual_seed(9)
    direction = [torch.randn(p.shape, generator=g) for p in params]
    eps = 1e-2

    def shifted(sign):
        with torch.no_grad():
            for p, d in zip(params, direction, strict=True):
                p.add_(sign * eps * d)
            value = loss().double()
            for p, d in zip(params, direction, strict=True):
                p.sub_(sign * eps * d)
        return value

    numeric = (shifted(1) - shifted(-1)) / (2 * eps)
    analytic = sum((gr.double() * d.double()).sum() for gr, d in zip(plain, direction, strict=True))
    assert abs(numeric) > 1e-6
    assert torch.allclose(analytic, numeric, rtol=RTOL), (analytic.item(), numeric.item())


def test_every_preset_has_targets_and_stage_layers_agree_with_the_model(row, comfy_root, fixture_paths):
    from pipetrainer.training.pipelines.targets import layer_targets, model_targets

    model = _load(row, comfy_root, fixture_paths).model
    adapter = adapter_for(row.family)
    dm = model.diffusion_model
    layers = adapter.stage_layers(dm)
    sizes = []
    for preset in TARGET_PRESETS:
        regex = adapter.lora_target_regex(preset)
        in_layers = [p for layer in layers for p in layer_targets(layer, regex).values()]
        assert in_layers, preset
        assert len(in_layers) == len(set(in_layers)) and set(in_layers) == set(model_targets(dm, regex)), preset
        sizes.append(len(in_layers))
    assert sizes == sorted(sizes)  # attention <= attention_mlp <= all_linear
    assert adapter.layer_layout(dm) == [layer.swappable for layer in layers]  # preflight's view of the layers


def test_saved_lora_is_consumed_by_comfyui_and_reproduces_the_trainers_forward(row, comfy_root, fixture_paths):
    import comfy.lora
    import comfy.sd
    from pipetrainer.training.adapters.lora_file import stage_lora_tensors

    trainer = _load(row, comfy_root, fixture_paths)
    reference = _load(row, comfy_root, fixture_paths)
    reference.model.diffusion_model.load_state_dict(trainer.model.diffusion_model.state_dict())  # equal weights
    adapter = adapter_for(row.family)
    options = adapter.options_type()
    noisy, sigma, cond, pooled, noised, extras, clean, shapes = _example(row, trainer.model, seed=2)
    layers = adapter.stage_layers(trainer.model.diffusion_model)
    lora, indexed, stage, count = _with_lora(adapter, layers, "all_linear")
    with torch.no_grad():
        out = _staged(adapter, layers, noised, cond, pooled, options, extras, clean, shapes=shapes)
    ours = trainer.model.model_sampling.calculate_denoised(sigma, out.float(), noisy)
    tensors = stage_lora_tensors(stage, {i: layer.comfy_paths for i, layer in indexed}, lora)

    key_map = comfy.lora.model_lora_keys_unet(reference.model, {})
    modules = {k.rsplit(".", 2)[0] if ".lora_" in k else k.rsplit(".", 1)[0] for k in tensors}
    assert len(modules) == count and modules <= set(key_map), sorted(modules - set(key_map))
    with collect_warnings() as warnings:
        patches = comfy.lora.load_lora(tensors, key_map)
    assert not [w for w in warnings if "not loaded" in w], warnings
    assert len(patches) == count

    base = _comfy_denoised(reference.model, noisy, sigma, cond, pooled, row, options, extras)
    patched, _ = comfy.sd.load_lora_for_models(reference, None, tensors, 1.0, 0)
    patched.patch_model()
    try:
        applied = _comfy_denoised(patched.model, noisy, sigma, cond, pooled, row, options, extras)
    finally:
        patched.unpatch_model()
    scale = applied.abs().max().item()
    diff = (ours - applied).abs().max().item()
    assert diff <= 1e-4 * scale, (diff, scale)
    assert (applied - base).abs().max().item() > 10 * 1e-4 * scale  # the LoRA really acts


def test_default_sigmas_follow_the_models_schedule(row, comfy_root, fixture_paths):
    from pipetrainer.training.objective.timesteps import sample_sigmas
    from pipetrainer.training.spec.options import TimestepSpec

    ms = _load(row, comfy_root, fixture_paths).model.model_sampling
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)

    def position(sigmas):  # the sigma on flow models; the discrete step / 999 on eps and v models
        return ms.timestep(sigmas.double()).double() / float(ms.timestep(ms.sigma_max.double()))

    got = torch.quantile(position(sample_sigmas(40_000, TimestepSpec(), torch.Generator().manual_seed(0), ms)), q)
    assert torch.allclose(got, torch.quantile(position(ms.sigmas), q), atol=0.012), got


def test_preflight_reads_the_family_rules_without_building_stage_layers(row, comfy_root, fixture_paths, monkeypatch):
    from pipetrainer.training.pipelines import checks

    model = _load(row, comfy_root, fixture_paths).model
    adapter = adapter_for(row.family)
    layouts = [False, *adapter.layer_layout(model.diffusion_model)]
    monkeypatch.setattr(type(adapter), "stage_layers", lambda *a: pytest.fail("preflight built stage layers"))
    inputs = checks.model_inputs(model)
    assert inputs.family == row.family and inputs.latent_channels == model.latent_format.latent_channels
    if row.model_path is not None:  # in-memory models may be narrower than their family's latent format
        assert inputs.latent_channels == row.latent[0]
    assert inputs.geometry.video == (len(row.latent) == 4)
    assert checks.model_support_problems(model) == [] and checks.block_layout(model) == layouts
    assert checks.lora_parameter_count(model, 4, "attention") > 0


# ---- slow tier: the real process tree ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", [row.name for row in ROWS if row.model_path is not None])
def test_two_steps_in_one_and_two_stages_are_bitwise_equal(name, comfy_root, fixture_paths, tmp_path):
    from safetensors.torch import load_file

    row = BY_NAME[name]
    path = row.model_path(comfy_root, fixture_paths)
    items = cache_items(row, _load(row, comfy_root, fixture_paths).model, tmp_path / "cache")
    runs = []
    for stages in (1, 2):
        # Uniform: the tiny models' embedders hold most parameters (Wan's 4096-wide text embedding), so a
        # parameter-balanced split would leave stage 0 without a block; uniform puts a block boundary
        # inside the transformer, where the block tuples cross it.
        spec = make_spec(path, items, tmp_path / f"run{stages}", comfy_root, steps=2, pipeline_stages=stages,
                         partition_method="uniform", lora=LoraSpec(rank=4, alpha=4.0, targets="attention_mlp"))
        code, events = run_training(spec)
        assert code == 0, [e for e in events if e["type"] == "error"]
        assert next(e for e in events if e["type"] == "setup")["family"] == row.family
        runs.append((losses(events), load_file(spec.lora_output)))
    (one_losses, one), (two_losses, two) = runs
    assert len(one_losses) == 2 and one_losses == two_losses
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert any(v.abs().max() > 0 for k, v in one.items() if k.endswith("lora_B.weight"))
