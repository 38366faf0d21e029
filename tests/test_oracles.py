"""Training math against independent oracles: ComfyUI's own sampling code and its own LoRA loader.

"The loss falls" and "1 stage equals 2 stages" hold just as well for a wrong target, a LoRA saved at
the wrong strength or one noise draw reused for every step. These tests compare with what ComfyUI
does at inference instead, so each of those bugs fails here in seconds.
"""

from __future__ import annotations

import itertools

import pytest
import torch


def _family_models():
    """``(config name, family, BaseModel)`` for every ComfyUI model config of a registered family.

    Every config class in ``comfy.supported_models`` (a family's base config and its variants, e.g.
    Flux: dev, schnell, inpaint, Chroma; Wan: 2.1 and 2.2 T2V / I2V), each built by its own
    ``get_model`` with the network creation switched off, so the ``model_sampling`` is exactly the
    object ComfyUI's samplers use for that model. Configs whose model class no family registers are
    left out; the caller checks that every family was reached.
    """
    import comfy.supported_models as sm
    from pipetrainer.training.pipelines.base import UnknownFamilyError, family_name_for

    out = []
    for config_cls in sm.models:
        # Detection fills in the network size; some configs read it at construction (current
        # ComfyUI's Flux2 scales its memory estimate by hidden_size). Any value does here.
        try:
            config = config_cls({"hidden_size": 3072, **config_cls.unet_config, "disable_unet_model_creation": True})
            model = config.get_model({})
        except Exception:  # a config of another kind (needs a state dict, a text encoder...): not ours
            continue
        try:
            out.append((config_cls.__name__, family_name_for(model), model))
        except UnknownFamilyError:
            continue  # a model class PipeTrainer does not train
    return out


def test_comfyui_gets_x0_back_from_the_training_target_for_every_family(comfy_root):
    """Oracle: ``model_sampling.calculate_denoised(sigma, target, noisy)``, how ComfyUI turns the raw
    network output into the denoised latent, must give back the clean latent for every sigma."""
    import comfy.model_base
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.base import known_families, model_classes_of

    models = _family_models()
    on_this_host = {f for f in known_families() if any(hasattr(comfy.model_base, c) for c in model_classes_of(f))}
    assert {family for _, family, _ in models} == on_this_host, models  # a family newer than the host is absent
    sampling_classes = {type(m.model_sampling).__mro__[1].__name__ for _, _, m in models}
    assert {"ModelSamplingDiscreteFlow", "ModelSamplingFlux"} <= sampling_classes
    assert {"WAN21_T2V", "WAN22_T2V"} <= {name for name, _, _ in models}
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.05, 0.35, 0.7, 1.0])
    for name, _, model in models:
        ms = model.model_sampling
        shape = (len(sigma), model.latent_format.latent_channels, 8, 8)
        x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        try:
            noisy, timestep, target = noisy_input_and_target(ms, x0, noise, sigma)
        except NotImplementedError as refused:  # e.g. current ComfyUI's WAN21_FlowRVS (IMG_TO_IMG_FLOW)
            owner = next(c for c in type(ms).__mro__ if "calculate_denoised" in vars(c))
            assert owner.__name__ not in ("CONST", "EPS", "V_PREDICTION"), (name, refused)
            assert owner.__name__ in str(refused), (name, refused)
            continue
        s = sigma.view(-1, 1, 1, 1)
        noised = ms.noise_scaling(s, noise, x0)  # ComfyUI's own noising; the network sees calculate_input of it
        assert torch.allclose(noisy, ms.calculate_input(s, noised), atol=1e-6), name
        assert torch.equal(timestep, ms.timestep(sigma).float()), name  # what BaseModel.apply_model passes
        denoised = ms.calculate_denoised(s, target, noised)
        assert torch.allclose(denoised, x0, atol=1e-5), (name, (denoised - x0).abs().max())


@pytest.mark.parametrize("model_type", ["EPS", "V_PREDICTION"])
def test_eps_and_v_targets_denoise_to_x0_through_comfyuis_own_sampling(comfy_root, model_type):
    """Oracle for SD-style UNets: with ComfyUI's discrete eps / v ``model_sampling`` (SD1.5's schedule),
    the network sees ``calculate_input`` of ComfyUI's noising, and ``calculate_denoised`` of the
    target gives back x0 at every sigma, from nearly clean to the schedule's largest."""
    import comfy.model_base
    import comfy.supported_models
    from pipetrainer.training.objective.loss import noisy_input_and_target, prediction_type

    config = comfy.supported_models.SD15({})
    ms = comfy.model_base.model_sampling(config, getattr(comfy.model_base.ModelType, model_type))
    assert prediction_type(ms) == {"EPS": "eps", "V_PREDICTION": "v"}[model_type]
    g = torch.Generator().manual_seed(4)
    sigma = torch.tensor([0.03, 0.5, 2.0, float(ms.sigma_max)])
    x0, noise = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    network_input, timestep, target = noisy_input_and_target(ms, x0, noise, sigma)
    s = sigma.view(-1, 1, 1, 1)
    noisy = ms.noise_scaling(s, noise, x0)
    assert torch.allclose(network_input, ms.calculate_input(s, noisy), atol=1e-6)
    assert not torch.allclose(network_input, noisy, atol=1e-3)  # eps/v models see a scaled input
    assert torch.equal(timestep, ms.timestep(sigma).float())
    denoised = ms.calculate_denoised(s, target, noisy)
    assert torch.allclose(denoised, x0, atol=1e-4), (denoised - x0).abs().max()


def test_unsupported_prediction_types_are_refused_by_name(comfy_root):
    """EDM and x0 prediction denoise differently from eps/v: refused, never trained against a wrong target."""
    import comfy.model_sampling as cms
    from pipetrainer.training.objective.loss import prediction_type

    for kind in (cms.EDM, cms.X0):
        sampling = type("Sampling", (cms.ModelSamplingDiscrete, kind), {})()
        with pytest.raises(NotImplementedError, match="prediction is not supported"):
            prediction_type(sampling)
    assert prediction_type(type("Sampling", (cms.ModelSamplingContinuousEDM, cms.V_PREDICTION), {})()) == "v"


def test_the_loss_mask_leaves_masked_elements_out_and_averages_the_rest():
    from pipetrainer.training.objective.loss import mse_loss

    prediction, target = torch.zeros(2, 3, 4, 1, 1), torch.ones(2, 3, 4, 1, 1)
    target[:, :, 0] = 10.0  # a clean first frame the family leaves out of the loss
    weight = torch.ones(1, 1, 4, 1, 1)
    weight[:, :, 0] = 0.0
    assert mse_loss(prediction, (target, weight)).item() == 1.0
    assert mse_loss(prediction, target).item() == pytest.approx((100 + 3) / 4)


def test_the_saved_lora_applies_in_comfyui_at_the_trained_strength(fixture_paths, caplog):
    """rank 4, alpha 1 (scale 1/4): ComfyUI's LoRA loader on the base model must reproduce the forward of
    the PEFT-injected stage layers, with the tensors built by the function the engine saves with."""
    import comfy.lora
    import comfy.sd
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora, named_lora_parameters
    from pipetrainer.training.adapters.lora_file import stage_lora_tensors
    from pipetrainer.training.loop.engine import _inputs_need_grad
    from pipetrainer.training.pipelines.base import Batch, adapter_for
    from pipetrainer.training.spec.options import LoraSpec

    lora = LoraSpec(rank=4, alpha=1.0, targets="all_linear")
    trainer_model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    comfy_model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    adapter = adapter_for("SD3")
    dm = trainer_model.model.diffusion_model
    indexed = [(i + 1, layer) for i, layer in enumerate(adapter.stage_layers(dm))]  # layer 0: input prep
    assert inject_lora(indexed, adapter.lora_target_regex(lora.targets), lora, seed=5) > 0
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in indexed})  # named like a PipelineModule
    freeze_all_but_lora(stage)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in named_lora_parameters(stage).items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    tensors = stage_lora_tensors(stage, {i: layer.comfy_paths for i, layer in indexed}, lora)

    ms = trainer_model.model.model_sampling
    context, pooled_dim = adapter.conditioning_dims(dm)
    noisy = torch.randn(1, 16, 16, 16, generator=g)
    cond, pooled = torch.randn(1, 7, context, generator=g), torch.randn(1, pooled_dim, generator=g)
    sigma = torch.tensor([0.6])
    x = _inputs_need_grad(adapter.first_stage_inputs(Batch(noisy, ms.timestep(sigma).float(), cond, pooled,
                                                           options=adapter.options_type())))
    with torch.no_grad():
        for _, layer in indexed:
            x = layer(x)
    trained = x

    def comfy_velocity(patcher) -> torch.Tensor:
        with torch.no_grad():
            denoised = patcher.model.apply_model(noisy, sigma, c_crossattn=cond, y=pooled)
        return (noisy - denoised) / sigma  # flow models: denoised = x - sigma * v

    with caplog.at_level("WARNING"):
        patched, _ = comfy.sd.load_lora_for_models(comfy_model, None, tensors, 1.0, 0)
    assert "lora key not loaded" not in caplog.text
    patched.patch_model()
    try:
        applied = comfy_velocity(patched)
    finally:
        patched.unpatch_model()
    base = comfy_velocity(comfy_model)
    max_diff = (trained - applied).abs().max().item()
    assert max_diff <= 1e-4, max_diff
    assert (base - applied).abs().max().item() > 100 * max(max_diff, 1e-6)  # the LoRA really acts


@pytest.fixture(scope="module")
def tiny_sd3(fixture_paths):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model


def _micro_batches(model, replica: int, replicas: int):
    """Four identical examples: whatever differs between micro-batches is noise and sigma alone."""
    from pipetrainer.training.data.micro_batches import Example, MicroBatches
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import TrainSpec

    g = torch.Generator().manual_seed(3)
    example = Example(torch.randn(16, 8, 8, generator=g), torch.randn(5, 768, generator=g), torch.randn(768, generator=g))
    adapter = adapter_for("SD3")
    return MicroBatches([example] * 4, 2, 11, model, adapter, TrainSpec().timesteps, torch.device("cpu"),
                        replica=replica, replicas=replicas, family_options=adapter.options_type())


def test_every_micro_batch_and_replica_draws_its_own_noise_and_sigma(tiny_sd3):
    """With identical examples, the target (noise - x0) differs iff the noise does, and the network
    timestep (monotone in sigma) iff sigma does."""
    built = {(replica, micro): _micro_batches(tiny_sd3, replica, 2).build(micro)
             for replica in (0, 1) for micro in (0, 1, 2)}
    for (a, (inputs_a, target_a)), (b, (inputs_b, target_b)) in itertools.combinations(built.items(), 2):
        assert not torch.equal(target_a, target_b), f"micro-batches {a} and {b} (replica, micro) share noise"
        assert not torch.equal(inputs_a[1], inputs_b[1]), f"micro-batches {a} and {b} (replica, micro) share sigmas"
    for inputs, target in built.values():
        assert not torch.equal(target[0], target[1]) and inputs[1][0] != inputs[1][1]  # items of one batch too


def test_a_rebuilt_micro_batch_is_identical(tiny_sd3):
    """Stages build the same micro-batch independently, and resume rebuilds it: it must not drift."""
    first, again = _micro_batches(tiny_sd3, 1, 2), _micro_batches(tiny_sd3, 1, 2)
    a, b = first.build(4), again.build(4)
    c = first.build(4)
    for x, y in ((a, b), (a, c)):
        assert all(torch.equal(u, v) for u, v in zip(x[0], y[0], strict=True)) and torch.equal(x[1], y[1])
