"""Training sigmas: drawn as the model samples, as the user set, and as a ModelSampling* node changed them.

Oracles are ComfyUI's own objects, not our formulas: the ``sigmas`` buffer a ComfyUI sampling class
fills on a uniform timestep grid (its inference schedule), ComfyUI's ModelSampling* nodes, and
``comfy.model_sampling.time_snr_shift``. Quantiles are compared on 40,000 seeded draws, where the
sampling error of a quantile is about 0.005; a wrong shift moves the median by 0.1 to 0.25.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from pipetrainer.training.objective.timesteps import sample_sigmas
from pipetrainer.training.pipelines.base import Batch
from pipetrainer.training.spec.options import SamplingOverride, TimestepSpec
from pipetrainer.training.spec.run_spec import RunSpec

N = 40_000
QUANTILES = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
TOLERANCE = 0.012


def _quantiles(values: torch.Tensor) -> torch.Tensor:
    return torch.quantile(values.double(), QUANTILES.double())


def _draw(spec: TimestepSpec, model_sampling, tokens: int = 0, seed: int = 0) -> torch.Tensor:
    return sample_sigmas(N, spec, torch.Generator().manual_seed(seed), model_sampling, tokens)


def _sampling_of(config_class: str, unet_config: dict, model_type: str):
    """The model_sampling object ComfyUI builds for a model config, as ``BaseModel.__init__`` does."""
    import comfy.model_base
    import comfy.supported_models

    if not hasattr(comfy.supported_models, config_class):  # a family newer than this ComfyUI
        pytest.skip(f"this ComfyUI has no comfy.supported_models.{config_class}")
    config = getattr(comfy.supported_models, config_class)(unet_config)
    return comfy.model_base.model_sampling(config, getattr(comfy.model_base.ModelType, model_type))


# One row per registered family: ComfyUI's config class and the model type its model_base class uses.
FAMILY_SAMPLING = {
    "SD3": ("SD3", {"in_channels": 16, "pos_embed_scaling_factor": None}, "FLOW"),
    "Flux": ("Flux", {"image_model": "flux", "guidance_embed": True}, "FLUX"),
    "Flux2": ("Flux2", {"image_model": "flux2", "hidden_size": 6144}, "FLUX"),  # mu 2.02
    "Chroma": ("Chroma", {"image_model": "chroma"}, "FLUX"),  # mu 1.15, as Flux
    "Wan": ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v"}, "FLOW"),  # shift 8.0
    "WanVace": ("WAN21_Vace", {"image_model": "wan2.1", "model_type": "vace"}, "FLOW"),  # shift 8.0, as Wan 2.1
    "WanS2V": ("WAN22_S2V", {"image_model": "wan2.1", "model_type": "s2v"}, "FLOW"),  # shift 8.0 (current ComfyUI only)
    "HunyuanVideo": ("HunyuanVideo", {"image_model": "hunyuan_video"}, "FLOW"),  # shift 7.0
    "HunyuanVideo15": ("HunyuanVideo15", {"image_model": "hunyuan_video", "vision_in_dim": 1152}, "FLOW"),  # shift 7.0
    "Lumina2": ("Lumina2", {"image_model": "lumina2"}, "FLOW"),  # shift 6.0 (Z-Image's config: 3.0)
    "QwenImage": ("QwenImage", {"image_model": "qwen_image"}, "FLUX"),  # mu 1.15
    "SDXL": ("SDXL", {"model_channels": 320, "adm_in_channels": 2816}, "EPS"),  # 1000 discrete steps
    "SD1/SD2": ("SD15", {"model_channels": 320}, "EPS"),  # the same 1000 steps (SD 2.x v too)
    "LTXV": ("LTXV", {"image_model": "ltxv"}, "FLUX"),  # mu 2.37
    "LTX2": ("LTXAV", {"image_model": "ltxav"}, "FLUX"),  # LTXV's mu 2.37 (current ComfyUI only)
    "MiniMaxH3": ("MiniMaxH3", {"image_model": "minimax_h3"}, "FLOW_AV"),  # video shift 12, audio 3 (current only)
    "AuraFlow": ("AuraFlow", {"cond_seq_dim": 2048}, "FLOW"),  # shift 1.73
    "PixArt": ("PixArtSigma", {"image_model": "pixart_sigma"}, "EPS"),  # 1000 steps, sqrt_linear betas
    "Krea2": ("Krea2", {"image_model": "krea2"}, "FLUX"),  # mu 1.15 (current ComfyUI only)
    "MageFlow": ("MageFlow", {"image_model": "mage_flow"}, "FLOW"),  # shift 6.0 (current ComfyUI only)
    "CosmosPredict2": ("CosmosT2IPredict2", {"image_model": "cosmos_predict2", "in_channels": 16},
                       "FLOW_COSMOS"),  # its log-spaced EDM table, 0.002..80 (current ComfyUI only)
    "Anima": ("Anima", {"image_model": "anima"}, "FLOW"),  # shift 3.0, multiplier 1 (current ComfyUI only)
    "ErnieImage": ("ErnieImage", {"image_model": "ernie"}, "FLOW"),  # shift 3.0, multiplier 1000 (current ComfyUI only)
    "Ideogram4": ("Ideogram4", {"image_model": "ideogram4"}, "FLOW"),  # shift 1.0, multiplier 1 (current ComfyUI only)
    "LongCat": ("LongCatImage", {"image_model": "flux", "guidance_embed": False}, "FLUX"),  # mu 1.15 (current ComfyUI only)
    "HunyuanImage": ("HunyuanImage21", {"image_model": "hunyuan_video", "vec_in_dim": None}, "FLOW"),  # shift 5.0
    "HiDream": ("HiDream", {"image_model": "hidream"}, "FLOW"),  # shift 1.0 (its config sets none; workflows add 3-6)
    "Omnigen2": ("Omnigen2", {"image_model": "omnigen2"}, "FLOW"),  # shift 2.6
    "Kandinsky5Image": ("Kandinsky5Image", {"image_model": "kandinsky5"}, "FLOW"),  # shift 3.0 (current ComfyUI only)
    "Kandinsky5Video": ("Kandinsky5", {"image_model": "kandinsky5"}, "FLOW"),  # shift 10.0 (current ComfyUI only)
}


def test_every_registered_family_has_a_sampling_row():
    from pipetrainer.training.pipelines.base import known_families

    assert set(known_families()) <= set(FAMILY_SAMPLING)


@pytest.mark.parametrize("family", sorted(FAMILY_SAMPLING))
def test_default_sigmas_follow_the_models_own_inference_schedule(comfy_root, family):
    """Uniform + the model's shift = the distribution of the sigmas ComfyUI's schedule visits."""
    ms = _sampling_of(*FAMILY_SAMPLING[family])
    expected = _quantiles(_schedule_position(ms, ms.sigmas))  # ComfyUI's schedule on a uniform timestep grid
    got = _quantiles(_schedule_position(ms, _draw(TimestepSpec(), ms)))
    assert torch.allclose(got, expected, atol=TOLERANCE), (family, got, expected)


def _schedule_position(ms, sigmas: torch.Tensor) -> torch.Tensor:
    """Sigmas as the model's own timestep over its largest (in [0, 1]): equal to the sigma on flow models,
    the discrete step / 999 on eps and v models, whose sigmas span 0.03..15 and so need a common scale."""
    return ms.timestep(sigmas.double()).double() / float(ms.timestep(ms.sigma_max.double()))


def test_flux_trains_with_its_effective_shift_not_mu(comfy_root):
    """Flux stores mu = 1.15; its schedule is time_snr_shift(e^1.15 ~ 3.16), far from a shift of 1.15."""
    import comfy.model_sampling

    ms = _sampling_of(*FAMILY_SAMPLING["Flux"])
    median = float(_quantiles(_draw(TimestepSpec(), ms))[2])
    assert median == pytest.approx(float(comfy.model_sampling.time_snr_shift(math.exp(1.15), 0.5)), abs=TOLERANCE)
    assert abs(median - float(comfy.model_sampling.time_snr_shift(1.15, 0.5))) > 0.2


def test_logit_normal_fixed_and_no_shift(comfy_root):
    import comfy.model_sampling

    ms = _sampling_of(*FAMILY_SAMPLING["SD3"])
    normal = torch.distributions.Normal(0.0, 1.0)
    z = normal.icdf(QUANTILES.double())
    for mean, std in ((0.0, 1.0), (0.5, 0.8)):
        spec = TimestepSpec(distribution="logit_normal", logit_mean=mean, logit_std=std, shift="none")
        assert torch.allclose(_quantiles(_draw(spec, ms)), torch.sigmoid(mean + std * z), atol=TOLERANCE)
    fixed = TimestepSpec(shift="fixed", shift_value=5.0)
    expected = torch.tensor([comfy.model_sampling.time_snr_shift(5.0, float(q)) for q in QUANTILES])
    assert torch.allclose(_quantiles(_draw(fixed, ms)).float(), expected, atol=TOLERANCE)
    # logit-normal combines with a shift: the shift maps the logit-normal draw.
    both = TimestepSpec(distribution="logit_normal", shift="fixed", shift_value=3.0)
    expected = torch.tensor([comfy.model_sampling.time_snr_shift(3.0, float(v)) for v in torch.sigmoid(z)])
    assert torch.allclose(_quantiles(_draw(both, ms)).float(), expected, atol=TOLERANCE)


@pytest.mark.parametrize("side", [512, 1024])
def test_resolution_shift_equals_comfyuis_model_sampling_flux_node(comfy_root, fixture_paths, side):
    """ComfyUI's ModelSamplingFlux node at width x height gives the same schedule as the resolution shift."""
    from comfy_extras.nodes_model_advanced import ModelSamplingFlux
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    model = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]
    patched = ModelSamplingFlux().patch(model, 1.15, 0.5, side, side)[0]
    oracle = patched.object_patches["model_sampling"]
    latent = (16, side // 8, side // 8)
    tokens = _adapter("SD3").image_tokens(model.model.diffusion_model, latent)
    assert tokens == (side // 16) ** 2
    got = _quantiles(_draw(TimestepSpec(shift="resolution"), model.model.model_sampling, tokens))
    assert torch.allclose(got, _quantiles(oracle.sigmas), atol=TOLERANCE)


def test_sigma_bounds_condition_the_distribution(comfy_root):
    ms = _sampling_of(*FAMILY_SAMPLING["SD3"])
    spec = TimestepSpec(sigma_min=0.875)  # a Wan 2.2 T2V high-noise expert's range
    got = _draw(spec, ms)
    assert float(got.min()) >= 0.875 and float(got.max()) <= 1.0
    reference = _draw(TimestepSpec(), ms, seed=1)
    reference = reference[reference >= 0.875]
    assert torch.allclose(_quantiles(got), _quantiles(reference), atol=TOLERANCE)
    low = _draw(TimestepSpec(sigma_max=0.875), ms)
    assert float(low.max()) <= 0.875
    with pytest.raises(ValueError, match="widen the range"):
        sample_sigmas(4, TimestepSpec(shift="fixed", shift_value=0.01, sigma_min=0.99), torch.Generator(), ms)


def test_same_seed_same_sigmas_other_seed_other_sigmas(comfy_root):
    ms = _sampling_of(*FAMILY_SAMPLING["SD3"])
    spec = TimestepSpec(sigma_max=0.9)
    a, b, c = (sample_sigmas(8, spec, torch.Generator().manual_seed(s), ms) for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_timestep_spec_reports_every_problem():
    problems = TimestepSpec(distribution="beta", shift="cosmic", logit_std=0.0, shift_value=-1.0,
                            sigma_min=0.6, sigma_max=0.5).problems()
    text = "\n".join(problems)
    for fragment in ("distribution 'beta'", "shift 'cosmic'", "logit_std", "shift_value", "sigma_min and sigma_max"):
        assert fragment in text, fragment
    assert "narrower than 0.01" in "\n".join(TimestepSpec(sigma_min=0.5, sigma_max=0.505).problems())


# ---- a ModelSampling* node before Train LoRA ---------------------------------------------------

def _adapter(family: str):
    from pipetrainer.training.pipelines.base import adapter_for

    return adapter_for(family)


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


def _patched(model, node: str, *args):
    import comfy_extras.nodes_model_advanced as advanced

    node_class = getattr(advanced, node)
    method = getattr(node_class, node_class.FUNCTION)
    return method(node_class(), model, *args)[0]


@pytest.mark.parametrize(("node", "args"), [("ModelSamplingSD3", (5.0,)), ("ModelSamplingAuraFlow", (2.0,)),
                                            ("ModelSamplingFlux", (1.15, 0.5, 768, 512))])
def test_a_model_sampling_node_reaches_the_training_process(tiny_model, node, args):
    """The node's patch is recorded in the spec and the training process's model samples like it."""
    from pipetrainer.nodes.checks.graph_patches import patch_problems, sampling_override
    from pipetrainer.training.model.model_source import load_model

    patched = _patched(tiny_model, node, *args)
    override, problems = sampling_override(patched)
    assert problems == [] and patch_problems(patched) == []
    recipe = dataclasses.replace(tiny_model.attachments["pipetrainer.recipe"], sampling=override)
    rebuilt = load_model(recipe).model.model_sampling
    oracle = patched.object_patches["model_sampling"]
    assert torch.allclose(rebuilt.sigmas, oracle.sigmas, rtol=1e-6, atol=1e-7)
    got = _quantiles(_draw(TimestepSpec(), rebuilt))
    assert torch.allclose(got, _quantiles(oracle.sigmas), atol=TOLERANCE)
    assert not torch.allclose(got, _quantiles(tiny_model.model.model_sampling.sigmas), atol=TOLERANCE)


def test_the_spec_carries_the_override_and_it_changes_the_training_hash(tiny_model, tmp_path):
    from pipetrainer.nodes.checks.graph_patches import sampling_override

    override, _ = sampling_override(_patched(tiny_model, "ModelSamplingSD3", 5.0))
    spec = RunSpec.from_json(_spec_json(tiny_model, tmp_path, override))
    assert spec.model.sampling == override
    plain = RunSpec.from_json(_spec_json(tiny_model, tmp_path, None))
    assert plain.model.sampling is None and plain.training_hash() != spec.training_hash()


def _spec_json(model, tmp_path, override: SamplingOverride | None) -> str:
    from pipetrainer.training.spec.options import CacheItem, LoraSpec, OptimizerSpec, TrainSpec

    recipe = dataclasses.replace(model.attachments["pipetrainer.recipe"], sampling=override)
    item = CacheItem(str(tmp_path / "l.safetensors"), str(tmp_path / "t.safetensors"), "a.png", "a")
    spec = RunSpec(model=recipe, items=(item,), lora=LoraSpec(), optimizer=OptimizerSpec(),
                   train=TrainSpec(timesteps=TimestepSpec(distribution="logit_normal", sigma_min=0.1)),
                   run_dir=str(tmp_path), lora_output=str(tmp_path / "x.safetensors"), comfyui_path=str(tmp_path))
    text = spec.to_json()
    assert RunSpec.from_json(text) == spec
    return text


def test_other_sampling_and_model_patches_are_refused_by_name(tiny_model):
    from pipetrainer.nodes.checks.graph_patches import patch_problems, sampling_override

    _, problems = sampling_override(_patched(tiny_model, "ModelSamplingDiscrete", "v_prediction", False))
    assert len(problems) == 1 and "cannot replay" in problems[0] and "ModelSamplingDiscrete" in problems[0]

    def wrapper(apply_model, args):
        return apply_model(args["input"], args["timestep"], **args["c"])

    wrapped = tiny_model.clone()
    wrapped.set_model_unet_function_wrapper(wrapper)
    wrapped.add_object_patch("diffusion_model.final_layer", torch.nn.Identity())
    wrapped.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    text = "\n".join(patch_problems(wrapped))
    for fragment in ("model function wrapper (", "wrapper)", "'diffusion_model.final_layer'", "transformer patches (attn1_patch)",
                     "remove that node before 'Train LoRA'"):
        assert fragment in text, (fragment, text)
    assert patch_problems(tiny_model) == []


def test_the_train_node_refuses_a_patched_model_before_starting(tiny_model, demo_cache, tmp_path):
    from pipetrainer.nodes.train import PipeTrainerTrain
    from pipetrainer.training.spec.choices import SpecError
    from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

    wrapped = tiny_model.clone()
    wrapped.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    settings = dict(steps=2, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
                    gradient_checkpointing=True, pipeline_stages=1, partition_method="parameters")
    with pytest.raises(SpecError, match="attn1_patch"):
        PipeTrainerTrain.build_spec(wrapped, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(), "x", **settings)
    patched = _patched(tiny_model, "ModelSamplingSD3", 6.0)
    spec = PipeTrainerTrain.build_spec(patched, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(), "x",
                                       **settings, guidance=2.0)
    assert spec.model.sampling is not None and dict(spec.model.sampling.parameters)["shift"] == 6.0
    assert spec.family_options == {}  # SD3 takes no guidance


# ---- per-family options ------------------------------------------------------------------------

def test_flux_guidance_is_a_typed_option_that_reaches_the_model_input():
    from pipetrainer.training.pipelines.flux import FluxOptions
    from pipetrainer.training.pipelines.options import options_from_inputs, parse_family_options

    adapter = _adapter("Flux")
    assert adapter.options_type().guidance == 1.0
    options, problems = parse_family_options("Flux", adapter.options_type, {"guidance": 2})
    assert problems == [] and options == FluxOptions(guidance=2.0)
    x = torch.zeros(2, 16, 4, 4)
    guidance = adapter.first_stage_inputs(Batch(x, torch.zeros(2), torch.zeros(2, 3, 8), None, options=options))[-1]
    assert torch.equal(guidance, torch.full((2,), 2.0))
    _, problems = parse_family_options("Flux", adapter.options_type, {"guidance": "high", "cfg": 1.0})
    text = "\n".join(problems)
    assert "take no option 'cfg'" in text and "'guidance' must be a float" in text
    _, problems = parse_family_options("Flux", adapter.options_type, {"guidance": -1.0})
    assert problems == ["Flux: guidance must be between 0 and 100 (got -1.0)."]
    assert options_from_inputs(adapter.options_type, {"guidance": 1.5, "steps": 3}) == {"guidance": 1.5}
    _, problems = parse_family_options("SD3", _adapter("SD3").options_type, {"guidance": 1.0})
    assert problems == ["SD3 models take no option 'guidance' (their options: none)."]
