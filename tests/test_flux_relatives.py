"""Flux relatives that ComfyUI loads as Flux are refused by name, by the adapter and by preflight.

Current ComfyUI (seen on 0.28) builds LongCat-Image and Ovis-Image with its ``Flux`` class and
marks them only through ``FluxParams`` fields (``txt_ids_dims``, ``txt_norm``, ``yak_mlp``). The
family registry then says "Flux" for Ovis, and the Flux.1 stage layers would run it without those
features: a LoRA trained silently wrong. LongCat-Image is ComfyUI's ``LongCatImage`` model class, which
the LongCat family registers (training/pipelines/longcat_image.py); the Flux adapter still refuses it. Each model here is a tiny state dict in the relative's
exact key layout, loaded by ComfyUI's own detection and loader (what UNETLoader does with a file),
so the test follows whatever ComfyUI decides the model is. ComfyUI 0.3.75 knows neither relative:
there those tests skip, naming the missing ComfyUI feature; the preflight test (a Flux Fill) runs on
both hosts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pipetrainer.devkit.fixtures import flux_params
from pipetrainer.training.pipelines.base import family_name_for
from pipetrainer.training.pipelines.flux import FluxAdapter

# The smallest Flux current ComfyUI detects: it pins the rotary axes [16, 56, 56] and derives the
# head count from the hidden size, so hidden 128 is one head.
_TINY = dict(in_channels=16, out_channels=16, hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1,
             depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
             guidance_embed=False, vec_in_dim=None)


def _needs_fields(*names: str) -> None:
    from comfy.ldm.flux.model import FluxParams

    missing = [n for n in names if n not in {f.name for f in dataclasses.fields(FluxParams)}]
    if missing:
        pytest.skip(f"this ComfyUI's FluxParams has no {', '.join(missing)}: it cannot build this Flux relative "
                    "(added after ComfyUI 0.3.75)")


def _load_as_comfyui_does(**params):
    """A tiny model with these ``FluxParams``, saved-and-loaded through ComfyUI's detection and loader."""
    import comfy.sd
    from comfy.ldm.flux.model import Flux

    torch.manual_seed(0)
    module = Flux(image_model="flux", operations=torch.nn, dtype=torch.float32, **flux_params(**_TINY, **params))
    patcher = comfy.sd.load_diffusion_model_state_dict(module.state_dict())
    assert patcher is not None, "ComfyUI did not detect the tiny Flux relative"
    return patcher


def test_longcat_image_loads_as_its_own_model_class_and_trains_as_the_longcat_family(comfy_root):
    """LongCat-Image is ComfyUI's ``LongCatImage`` (a Flux subclass): the LongCat family takes it, with its
    text rotary positions and rope shifts (tests/family_rows/longcat_image.py checks the forward); a plain
    Flux model with text rotary positions stays refused by the Flux family."""
    _needs_fields("txt_ids_dims")
    from pipetrainer.nodes.checks.preflight import model_support_problems
    from pipetrainer.training.pipelines.base import adapter_for

    # LongCat-Image's layout: a 3584-wide (Qwen2.5-VL) context, no pooled vector, no guidance embedding.
    patcher = _load_as_comfyui_does(context_in_dim=3584, txt_ids_dims=[1, 2])
    dm = patcher.model.diffusion_model
    assert type(patcher.model).__name__ == "LongCatImage"
    assert family_name_for(patcher.model) == "LongCat"  # registered itself, not claimed by Flux as a subclass
    assert list(dm.params.txt_ids_dims) == [1, 2]
    assert len(adapter_for("LongCat").stage_layers(dm)) == 4  # embed, 2 blocks, final
    assert model_support_problems(patcher) == []
    with pytest.raises(NotImplementedError, match=r"txt_ids_dims=\[1, 2\].*own adapter"):
        FluxAdapter().stage_layers(dm)  # the Flux.1 layers would skip LongCat's positions: still refused


def test_ovis_image_loads_as_flux_and_is_refused_by_name(comfy_root):
    _needs_fields("txt_ids_dims", "txt_norm", "yak_mlp")
    from pipetrainer.nodes.checks.preflight import model_support_problems

    # Ovis-Image's layout: a text RMSNorm (txt_norm.*) and gated MLPs (*_mlp.gate_proj); ComfyUI's
    # detection then also sets its text rotary positions.
    patcher = _load_as_comfyui_does(context_in_dim=64, txt_norm=True, yak_mlp=True)
    dm = patcher.model.diffusion_model
    assert family_name_for(patcher.model) == "Flux"
    assert dm.params.txt_norm and dm.txt_norm is not None and list(dm.params.txt_ids_dims) == [1, 2]
    with pytest.raises(NotImplementedError, match=r"Ovis-Image.*txt_norm.*own adapter"):
        FluxAdapter().stage_layers(dm)
    problems = model_support_problems(patcher)
    assert len(problems) == 1 and "Ovis-Image" in problems[0]


def test_a_plain_flux1_of_the_same_size_is_not_refused(comfy_root):
    """The refusals key on the relatives' features, not on anything every tiny Flux has."""
    from comfy.ldm.flux.model import FluxParams
    from pipetrainer.nodes.checks.preflight import model_support_problems

    if "txt_ids_dims" not in {f.name for f in dataclasses.fields(FluxParams)}:
        pytest.skip("this ComfyUI's Flux detection pins 24 heads (as 0.3.75 does): no tiny Flux loads")
    patcher = _load_as_comfyui_does(context_in_dim=64)
    assert type(patcher.model).__name__ == "Flux"
    assert len(FluxAdapter().stage_layers(patcher.model.diffusion_model)) == 4  # embed, 2 blocks, final
    assert model_support_problems(patcher) == []


def test_other_non_flux1_features_are_refused_and_named(comfy_root):
    """A relative not known by name (here: only Ovis's gated MLP) is still refused, naming the field."""
    _needs_fields("yak_mlp")
    from comfy.ldm.flux.model import Flux

    module = Flux(image_model="flux", operations=torch.nn, **flux_params(**_TINY, context_in_dim=64, yak_mlp=True))
    with pytest.raises(NotImplementedError, match="differs from Flux.1 in yak_mlp.*own adapter"):
        FluxAdapter().stage_layers(module)


def test_preflight_reports_a_refused_flux_model_instead_of_raising(comfy_root, tmp_path):
    """The Train node's preflight lists the adapter's refusal with the other problems (on every host).

    A Flux Fill (image conditioning concatenated to the latent) is a model of the registered Flux
    family that the adapter refuses; it is built with ComfyUI's own Flux config and model_base class.
    """
    from types import SimpleNamespace

    import comfy.model_patcher
    import comfy.supported_models
    from pipetrainer.nodes.checks.preflight import model_support_problems, train_problems
    from pipetrainer.training.spec.options import LoraSpec, TrainSpec

    config = comfy.supported_models.Flux(flux_params(
        image_model="flux", in_channels=8, out_channels=4, vec_in_dim=8, context_in_dim=8, hidden_size=64,
        mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000,
        patch_size=2, qkv_bias=True, guidance_embed=True))
    config.set_inference_dtype(torch.float32, None)
    patcher = comfy.model_patcher.ModelPatcher(config.get_model({}), torch.device("cpu"), torch.device("cpu"))
    assert family_name_for(patcher.model) == "Flux"
    refusal = model_support_problems(patcher)
    assert len(refusal) == 1 and "Fill" in refusal[0]
    problems = train_problems(patcher, SimpleNamespace(items=(), report=None), LoraSpec(), TrainSpec(), str(tmp_path))
    assert refusal[0] in problems
    assert any("dataset" in p.lower() for p in problems if p != refusal[0])  # reported together, not instead
