"""HunyuanImage 2.1's refusals by name: the refiner (a subclass of ComfyUI's HunyuanImage21 model class, so the
family's registration reaches it) and the MeanFlow distillation. Built from ComfyUI's own config classes, tiny,
in memory; the generic checks of the trainable layouts are the rows in tests/family_rows/hunyuan_image.py."""

from __future__ import annotations

import pytest
from pipetrainer.tests.family_rows.common import from_config, require_model_class
from pipetrainer.training.pipelines.base import adapter_for, family_name_for


def _unet(**overrides) -> dict:
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    unet = {"image_model": "hunyuan_video", "in_channels": 4, "out_channels": 4, "vec_in_dim": None,
            "context_in_dim": 16, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
            "depth_single_blocks": 1, "axes_dim": [16, 16], "theta": 256, "patch_size": [1, 1], "qkv_bias": True,
            "guidance_embed": False, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
            "vision_in_dim": None, "meanflow_sum": False, **overrides}
    return {k: v for k, v in unet.items() if k in HunyuanVideoParams.__dataclass_fields__ or k == "image_model"}


def _refused(patcher, match: str) -> None:
    from pipetrainer.nodes.checks.preflight import model_support_problems

    model = patcher.model
    assert family_name_for(model) == "HunyuanImage"
    adapter = adapter_for("HunyuanImage")
    with pytest.raises(NotImplementedError, match=match):
        adapter.stage_layers(model.diffusion_model)
    problems = model_support_problems(patcher)
    assert len(problems) == 1 and problems == adapter.support_problems(model.diffusion_model)


def test_the_refiner_is_refused_by_name(comfy_root):
    require_model_class("HunyuanImage21Refiner")
    import comfy.supported_models

    patcher = from_config(comfy.supported_models.HunyuanImage21Refiner,
                          _unet(in_channels=8, patch_size=[1, 1, 1], axes_dim=[16, 8, 8]), seed=5)
    assert type(patcher.model).__name__ == "HunyuanImage21Refiner"
    _refused(patcher, r"HunyuanImage 2\.1 Refiner.*not supported")


def test_a_meanflow_distillation_is_refused_by_name(comfy_root):
    require_model_class("HunyuanImage21")
    import comfy.supported_models

    patcher = from_config(comfy.supported_models.HunyuanImage21, _unet(meanflow=True, guidance_embed=True), seed=6)
    _refused(patcher, r"MeanFlow.*next sigma")


def test_the_base_model_is_not_refused(comfy_root):
    """The refusals key on the refiner's and the distillation's features, not on anything every model has."""
    require_model_class("HunyuanImage21")
    import comfy.supported_models

    patcher = from_config(comfy.supported_models.HunyuanImage21, _unet(), seed=7)
    assert adapter_for("HunyuanImage").support_problems(patcher.model.diffusion_model) == []


def test_the_byt5_states_of_quoted_text_reach_the_model_from_the_cache(comfy_root):
    """ComfyUI's HunyuanImage 2.1 text encoder puts ByT5 states (``[1, G, 1472]``) into the conditioning only
    for a caption with quoted text. The cache keeps them beside the cond; a micro-batch of a caption with them
    and one without pads the other with zero tokens, which the first stage masks out as ComfyUI's forward
    never sees them (its own batch of one has exactly its tokens)."""
    import torch
    from pipetrainer.tests.family_rows.hunyuan_image import BYT5, BYT5_WIDTH, hunyuan_image_small
    from pipetrainer.training.cache.encoders import _text_tensors
    from pipetrainer.training.data.micro_batches import Example, MicroBatches
    from pipetrainer.training.spec.options import TimestepSpec

    g = torch.Generator().manual_seed(0)
    quoted = _text_tensors(torch.randn(1, 5, 16, generator=g),
                           {BYT5: torch.randn(1, 3, BYT5_WIDTH, generator=g), "pooled_output": None})
    plain = _text_tensors(torch.randn(1, 4, 16, generator=g), {"pooled_output": None})
    assert quoted[BYT5].shape == (3, BYT5_WIDTH) and BYT5 not in plain

    model = hunyuan_image_small(guidance_embed=True, byt5=True).model
    adapter = adapter_for("HunyuanImage")
    examples = [Example(torch.randn(4, 6, 5, generator=g), entry["cond"], None,
                        extras={k: v for k, v in entry.items() if k != "cond"}) for entry in (quoted, plain)]
    batches = MicroBatches(examples, 2, 0, model, adapter, TimestepSpec(), torch.device("cpu"),
                           family_options=adapter.options_type())
    (x, _, cond, _, keep, byt5), _ = batches.build(0)
    order = [int(c[0, 0] == quoted["cond"][0, 0]) for c in cond]  # which row holds the quoted caption
    q, p = order.index(1), order.index(0)
    assert byt5.shape == (2, 3, BYT5_WIDTH) and torch.equal(byt5[q], quoted[BYT5]) and not byt5[p].any()
    assert keep.shape == (2, 5 + 3)  # text tokens (padded to the longest cond), then the ByT5 tokens
    assert keep[q].tolist() == [1] * 8 and keep[p].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
