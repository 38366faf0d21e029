"""SD 1.x / 2.x beyond the generic family table: detection of the real layouts, eps or v as ComfyUI decides it, the
relatives that are refused by name, and the registry taking only ComfyUI's plain ``BaseModel`` for this family.

ComfyUI's detection pins SD 1.5 and SD 2.1 at 0.86 B parameters, so the real layouts are built on the meta device
(shapes only) and fed to ComfyUI's own detection; everything numeric runs on the tiny rows of
tests/family_rows/sd1_sd2.py, built with ComfyUI's SD15 / SD20 config classes. The stage layers across stage
boundaries (1 vs 2 stages on gloo ranks) are in tests/test_stage_split.py.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.sd1_sd2 import SD2_UNET, UNET, V_PRED_KEY, sd1_small, sd2_small
from pipetrainer.tests.family_rows.sdxl import sdxl_small

FAMILY = "SD1/SD2"
FULL_SD15 = {  # the shapes of SD 1.5's UNet (v1-inference.yaml), as ComfyUI's detection reads them
    **UNET, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2], "channel_mult": [1, 2, 4, 4],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "transformer_depth_middle": 1, "context_dim": 768, "num_heads": 8, "num_head_channels": -1,
}
X4_UNET = {  # the x4 upscaler's config disables self-attention per level, for its 4 levels
    **SD2_UNET, "in_channels": 7, "channel_mult": [1, 1, 1, 1], "num_res_blocks": [1, 1, 1, 1],
    "transformer_depth": [0, 0, 0, 1], "transformer_depth_output": [0, 0, 0, 0, 0, 0, 1, 1],
}
FULL_SD21 = {**FULL_SD15, "use_linear_in_transformer": True, "context_dim": 1024, "num_heads": -1,
             "num_head_channels": 64}


def _detected(unet: dict, v_spread: float | None = None):
    """ComfyUI's detection and model class on the meta shapes of a full UNet; ``v_spread``: the spread of the
    norm bias ComfyUI's ``SD20.model_type`` reads (a real tensor there: 768-v files have a wide one)."""
    import comfy.model_detection
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    state = UNetModel(**unet, dtype=torch.float16, device="meta", operations=comfy.ops.disable_weight_init).state_dict()
    config = comfy.model_detection.model_config_from_unet(state, "")
    if v_spread is not None:
        state = {**state, V_PRED_KEY: torch.linspace(-1.0, 1.0, 320) * v_spread * 3**0.5}
    return state, config, config.get_model(state, "", device="meta")


@pytest.mark.parametrize("name, unet, v_spread, config_name, millions, kind, context, targets", [
    # 16 transformer layers (6 down, 1 middle, 9 up) x (8 attention + 2 MLP) Linears; all_linear adds the time
    # projection of 22 ResBlocks, and on SD 2.x the linear proj_in / proj_out of the 16 SpatialTransformers
    ("SD 1.5", FULL_SD15, None, "SD15", 859.5, "eps", 768, (128, 160, 182)),
    ("SD 2.1 512", FULL_SD21, 0.01, "SD20", 865.9, "eps", 1024, (128, 160, 214)),
    ("SD 2.1 768-v", FULL_SD21, 0.2, "SD20", 865.9, "v", 1024, (128, 160, 214)),
], ids=["SD15", "SD21_512", "SD21_768v"])
def test_full_size_models_are_detected_and_trainable_on_any_split(comfy_root, name, unet, v_spread, config_name,
                                                                  millions, kind, context, targets):
    import comfy.lora
    import comfy.model_base
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    from pipetrainer.training.model.partition import describe, require_lora_on_every_stage
    from pipetrainer.training.objective.loss import prediction_type
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.pipelines.targets import model_targets

    state, config, model = _detected(unet, v_spread)
    assert type(config).__name__ == config_name and type(model) is comfy.model_base.BaseModel, name
    assert round(sum(v.numel() for v in state.values()) / 1e6, 1) == millions, name
    assert family_name_for(model) == FAMILY and prediction_type(model.model_sampling) == kind, name
    assert checks.model_support_problems(model) == []
    adapter = adapter_for(FAMILY)
    dm = model.diffusion_model
    assert adapter.conditioning_dims(dm) == (context, 0)
    layers = adapter.stage_layers(dm)
    assert len(layers) == 1 + 11 + 1 + 12 + 1 and adapter.layer_layout(dm) == [layer.swappable for layer in layers]

    key_map = comfy.lora.model_lora_keys_unet(model, {})
    counts = []
    for preset in ("attention", "attention_mlp", "all_linear"):
        found = model_targets(dm, adapter.lora_target_regex(preset))
        assert {f"diffusion_model.{p}" for p in found} <= set(key_map)
        counts.append(len(found))
    assert tuple(counts) == targets, (name, counts)

    pipeline = [lambda x: x, *layers]  # the engine puts its input preparation first
    weights = [0] + [sum(p.numel() for p in layer.parameters()) for layer in layers]
    regex = adapter.lora_target_regex("attention")
    for stages in (2, 3, 4):
        for parts in (partition_balanced(weights, stages), partition_uniform(len(pipeline), stages)):
            require_lora_on_every_stage(describe(pipeline, [int(p) for p in parts], regex), "attention")
    # after output 1; after input 11 and output 3 (training/pipelines/sd1_sd2.py: 0.45 / 0.41 B, 0.25 / 0.34 / 0.27 B)
    assert [[int(p) for p in partition_balanced(weights, stages)] for stages in (2, 3)] == [[0, 16, 27], [0, 13, 18, 27]]


def test_the_rows_are_eps_and_v_as_comfyui_builds_them(comfy_root):
    """ComfyUI's own SD20.model_type makes the v row v-prediction (ModelType and model_sampling), not the test."""
    import comfy.model_base
    from pipetrainer.training.objective.loss import prediction_type

    for model, kind, model_type in ((sd1_small().model, "eps", "EPS"), (sd2_small(False).model, "eps", "EPS"),
                                    (sd2_small(True).model, "v", "V_PREDICTION")):
        assert type(model) is comfy.model_base.BaseModel
        assert model.model_type == getattr(comfy.model_base.ModelType, model_type)
        assert prediction_type(model.model_sampling) == kind


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # ComfyUI's x4 noise schedule
def test_relatives_are_refused_by_name(comfy_root):
    import comfy.supported_models as sm
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.pipelines.base import family_name_for

    relatives = {
        "inpainting": sd1_small(unet={**UNET, "in_channels": 9}).model,  # BaseModel with set_inpaint()
        "SD 2 inpainting": sd2_small(False, unet={**SD2_UNET, "in_channels": 9}).model,
        "InstructPix2Pix": sdxl_small({}, 3, unet={**UNET, "in_channels": 8}, config_class=sm.SD15_instructpix2pix).model,
        "x4 upscaler": sdxl_small({}, 3, unet=X4_UNET, config_class=sm.SD_X4Upscaler).model,
        "unCLIP": sdxl_small({}, 3, unet={**SD2_UNET, "num_classes": "sequential", "adm_in_channels": 2048},
                             config_class=sm.SD21UnclipH).model,
    }
    classes = {name: type(model).__name__ for name, model in relatives.items()}
    assert classes == {"inpainting": "BaseModel", "SD 2 inpainting": "BaseModel",
                       "InstructPix2Pix": "SD15_instructpix2pix", "x4 upscaler": "SD_X4Upscaler",
                       "unCLIP": "SD21UNCLIP"}
    for name, model in relatives.items():
        assert family_name_for(model) == FAMILY, name
        (problem,) = checks.model_support_problems(model)
        assert name.split()[-1] in problem and "Text-to-image SD 1.x / 2.x models" in problem, (name, problem)


def test_only_comfyuis_plain_base_model_is_taken_for_sd1_sd2(comfy_root):
    """ComfyUI builds SD 1.x / 2.x as ``BaseModel`` itself; its other subclasses are their own families (AuraFlow,
    PixArt) or stay unknown models (SDXLRefiner, Stable Zero123, HunyuanDiT, ...), named in the error, instead of
    being trained or refused as SD 1.x."""
    import comfy.model_base
    from pipetrainer.training.pipelines.base import UnknownFamilyError, family_name_for

    assert family_name_for(object.__new__(comfy.model_base.BaseModel)) == FAMILY  # only its class matters here
    for cls in ("AuraFlow", "PixArt"):
        assert family_name_for(object.__new__(getattr(comfy.model_base, cls))) == cls
    for cls in ("SDXLRefiner", "Stable_Zero123", "HunyuanDiT"):
        with pytest.raises(UnknownFamilyError, match=cls):
            family_name_for(object.__new__(getattr(comfy.model_base, cls)))


def test_flow_only_timestep_settings_are_refused_for_eps_and_v_models(comfy_root):
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.spec.options import TimestepSpec

    for model, kind in ((sd1_small().model, "eps-prediction"), (sd2_small(True).model, "v-prediction")):
        assert checks.model_timestep_problems(model, TimestepSpec()) == []
        (problem,) = checks.model_timestep_problems(model, TimestepSpec(shift="fixed"))
        assert f"this {FAMILY} model is {kind}" in problem and "set shift to 'model'" in problem, problem
