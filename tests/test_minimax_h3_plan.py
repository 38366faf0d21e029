"""MiniMax-H3's stage split and memory plan on its real layout (issue #25), built on the meta device.

The model is ComfyUI's own: ``supported_models.MiniMaxH3`` builds ``model_base.MiniMaxH3`` on the meta device
(training/model/meta_model.py), so every tensor has its real shape and dtype and nothing is allocated. The
oracles: the published size (33 B parameters), ComfyUI's own detection (a file of these shapes detects as this
config), the model's own bytes (the stages' bytes add up to them, whatever the stage count and weight dtype)
and the planner's own estimate (the number it picks fits the stated GPU; one block fewer does not).
bench/minimax_h3_plan.py prints the same figures.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.nodes.checks.memory import hidden_width, stage_boundaries, stage_weights, tensor_bytes
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.training.model.meta_model import build_on_meta, parameter_count
from pipetrainer.training.offload.memory_plan import GIB, GpuBudget, Margin, Workload, plan_blocks_to_swap, stage_need
from pipetrainer.training.spec.options import LoraSpec

REAL_PARAMETERS = 33_122_992_896  # hidden 5376, 50 blocks, 2 refiner blocks, Qwen3-VL 5120-wide text
LORA = LoraSpec(rank=16, alpha=16.0, targets="attention_mlp")
WEIGHTS = {"bf16": (torch.bfloat16, None), "fp8": (torch.float8_e4m3fn, torch.bfloat16)}


@pytest.fixture(scope="module", params=sorted(WEIGHTS))
def real(request, comfy_root):
    """(diffusion model, layout, the engine's layer list) of the real config with bf16 or fp8 weights."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from pipetrainer.training.pipelines.minimax_h3 import MiniMaxH3Adapter

    dm = build_on_meta("MiniMaxH3", {"image_model": "minimax_h3"}, *WEIGHTS[request.param]).diffusion_model
    layout = MiniMaxH3Adapter()
    return dm, layout, [None, *layout.stage_layers(dm)]


def _held(layers, stages: int):
    return stage_weights(layers, stage_boundaries(layers, stages, "parameters"), 2,
                         r"blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))", LORA)


def test_the_real_layout_has_the_published_size_and_detects_as_itself(real):
    dm, layout, layers = real
    assert next(dm.parameters()).device.type == "meta"
    assert parameter_count(dm) == REAL_PARAMETERS
    assert abs(parameter_count(dm) - 33e9) < 0.5e9  # "33 B parameters"
    assert sum(parameter_count(layer) for layer in layers[1:]) == REAL_PARAMETERS  # every tensor in one layer
    assert layout.layer_layout(dm) == [layer.swappable for layer in layers[1:]]
    assert sum(layout.layer_layout(dm)) == 50
    import comfy.model_detection

    config = comfy.model_detection.detect_unet_config(dm.state_dict(), "")
    assert config["image_model"] == "minimax_h3"
    assert (config["num_layers"], config["hidden_size"], config["num_attention_heads"], config["ffn_hidden_size"],
            config["text_dim"]) == (50, 5376, 56, 14336, 5120)


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_the_stages_bytes_add_up_to_the_model_and_split_by_parameters(real, stages):
    dm, _, layers = real
    model_bytes = sum(tensor_bytes(t, 2) for t in (*dm.parameters(), *dm.buffers()))
    held = _held(layers, stages)
    assert len(held) == stages and sum(h.layers for h in held) == len(layers)
    assert sum(sum(h.block_bytes) + h.rest_bytes for h in held) == model_bytes
    assert sum(h.blocks for h in held) == 50
    fp8 = next(dm.blocks[0].parameters()).dtype == torch.float8_e4m3fn
    assert model_bytes == pytest.approx((33.14e9 if fp8 else 66.25e9), rel=1e-3)
    totals = [sum(h.block_bytes) + h.rest_bytes for h in held]
    # DeepSpeed's balanced split: no stage is more than about one block heavier than another
    assert max(totals) - min(totals) <= 1.5 * max(held[-1].block_bytes)


@pytest.mark.parametrize(("size", "stages", "gib", "expected"), [
    ((640, 352, 124), 1, 24, 44),
    ((640, 352, 124), 2, 24, 17),
    ((640, 352, 124), 4, 24, 0),
    ((1344, 768, 124), 1, 80, 23),
])
def test_the_planner_picks_the_fewest_swapped_blocks_that_fit(real, size, stages, gib, expected):
    """bf16 weights: the number from bench/minimax_h3_plan.py; it fits the stated free memory and one fewer does
    not (fp8: whatever it picks obeys the same two rules, and never more than bf16 needs)."""
    dm, layout, layers = real
    held = _held(layers, stages)
    work = Workload(tokens=layout.tokens(dm, *size), hidden=hidden_width(layers), stages=stages)
    gpu = GpuBudget(f"{gib} GiB GPU", gib * GIB)
    plan = plan_blocks_to_swap(held, [gpu] * stages, work)
    assert plan.problem is None
    n = plan.blocks_to_swap
    if next(dm.blocks[0].parameters()).dtype == torch.bfloat16:
        assert n == expected
    else:
        assert n <= expected
    needs = [stage_need(s, h, work, Margin(), n).total for s, h in enumerate(held)]
    assert max(needs) <= gpu.available_bytes
    if n > 0:
        assert max(stage_need(s, h, work, Margin(), n - 1).total for s, h in enumerate(held)) > gpu.available_bytes


def test_the_tokens_follow_comfyuis_h3_latent(real):
    """1344x768, 124 frames: 37 latent frames of 24 x 42 patches, 207 audio frames x 2 channels, 256 text."""
    dm, layout, _ = real
    assert layout.tokens(dm, 1344, 768, 124) == 37 * 24 * 42 + 2 * 207 + 256
    assert layout.tokens(dm, 1344, 768, 120) == layout.tokens(dm, 1344, 768, 124)  # snapped up to 17k + 5
