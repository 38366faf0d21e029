"""Family rules in preflight, as pure functions over the real (tiny) models: Wan options against the model
layout and the run's timesteps, Qwen-Image's frames and reference count.

Each rule is held to what would really happen without it: the trainer's own ``family_timesteps`` raising
on an empty expert range, ComfyUI's model classes (only TI2V's ``WAN22`` gives frames their own timestep),
the Qwen-Image embed layer refusing a video latent. The Train node's wiring is in tests/test_preflight.py.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.qwen_image import qwen_image_small
from pipetrainer.tests.family_rows.wan import ROWS as T2V_ROWS
from pipetrainer.tests.family_rows.wan_video import ROWS as VIDEO_ROWS
from pipetrainer.training.pipelines import checks
from pipetrainer.training.spec.options import TimestepSpec

WAN = {row.name: row for row in (*T2V_ROWS, *VIDEO_ROWS)}
LAYOUTS = [("Wan", "T2V"), ("Wan22-I2V", "I2V"), ("Wan21-I2V", "I2V"), ("Wan22-TI2V", "TI2V")]


def _wan(name, comfy_root, fixture_paths):
    return WAN[name].load(comfy_root, fixture_paths).model


@pytest.mark.parametrize(("name", "layout"), LAYOUTS)
def test_first_frame_clean_is_refused_on_models_that_are_not_ti2v(name, layout, comfy_root, fixture_paths):
    import comfy.model_base

    model = _wan(name, comfy_root, fixture_paths)
    problems = checks.family_rule_problems(model, {"first_frame_clean": True}, TimestepSpec())
    # ComfyUI gives frames their own timestep (the clean first frame at 0) only in TI2V's model class
    own_timesteps = type(model).process_timestep is not comfy.model_base.BaseModel.process_timestep
    assert own_timesteps == (layout == "TI2V")
    if layout == "TI2V":
        assert problems == []
    else:
        (problem,) = problems
        assert "first_frame_clean" in problem and f"this {layout} model" in problem, problem
        assert "turn first_frame_clean off" in problem, problem
    assert checks.family_rule_problems(model, {}, TimestepSpec()) == []


@pytest.mark.parametrize(("name", "layout"), LAYOUTS)
def test_expert_is_refused_on_models_that_cannot_be_a14b_experts(name, layout, comfy_root, fixture_paths):
    """TI2V-5B (48 channels) and Wan 2.1 I2V (clip-vision input) are single models; the text- and image-to-video
    layouts without clip vision are the A14B experts' (their width is not checked: the fixtures are tiny)."""
    model = _wan(name, comfy_root, fixture_paths)
    problems = checks.family_rule_problems(model, {"expert": "low_noise"}, TimestepSpec())
    if name in ("Wan22-TI2V", "Wan21-I2V"):
        (problem,) = problems
        assert "expert 'low_noise'" in problem and "set expert to none" in problem, problem
    else:
        assert problems == []


# (expert, expert_boundary, sigma_min, sigma_max, empty): the I2V layout's default boundary is 0.9
RANGES = [
    ("high_noise", 0.0, 0.0, 0.5, True),
    ("low_noise", 0.0, 0.95, 1.0, True),
    ("low_noise", 0.3, 0.295, 1.0, True),  # 0.005 left: narrower than the trainer accepts
    ("high_noise", 0.0, 0.5, 1.0, False),
    ("low_noise", 0.3, 0.28, 1.0, False),
    ("high_noise", 0.95, 0.0, 0.96, False),
]


@pytest.mark.parametrize(("expert", "boundary", "lo", "hi", "empty"), RANGES)
def test_an_empty_expert_range_is_refused_exactly_where_training_would_fail(expert, boundary, lo, hi, empty,
                                                                          comfy_root, fixture_paths):
    from pipetrainer.training.objective.timesteps import family_timesteps
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.wan import WanOptions

    model = _wan("Wan22-I2V", comfy_root, fixture_paths)
    timesteps = TimestepSpec(sigma_min=lo, sigma_max=hi)
    problems = checks.family_rule_problems(model, {"expert": expert, "expert_boundary": boundary}, timesteps)
    try:
        family_timesteps(timesteps, adapter_for("Wan"), model.diffusion_model,
                         WanOptions(expert=expert, expert_boundary=boundary))
        fails = False
    except ValueError:
        fails = True
    assert fails == empty and bool(problems) == empty, problems
    if empty:
        (problem,) = problems
        for fragment in (f"expert '{expert}'", "expert_boundary", f"sigma_min {lo:g}", f"sigma_max {hi:g}",
                         "widen sigma_min/sigma_max"):
            assert fragment in problem, (fragment, problem)


def test_options_that_do_not_parse_are_left_to_the_train_node(comfy_root, fixture_paths):
    model = _wan("Wan22-TI2V", comfy_root, fixture_paths)
    assert checks.family_rule_problems(model, {"expert": "middle"}, TimestepSpec()) == []
    assert checks.model_timestep_problems(model, TimestepSpec(shift="fixed", sigma_min=0.5)) == []  # flow: fine


def _shapes(latents: dict[str, tuple[int, ...]], extras: dict | None = None) -> checks.CachedShapes:
    items = tuple((source, f"{source}#l", f"{source}#t") for source in latents)
    return checks.CachedShapes({f"{s}#l": shape for s, shape in latents.items()}, {f"{s}#t": (5, 32) for s in latents},
                               {f"{s}#t": 0 for s in latents}, (), {f"{s}#l": e for s, e in (extras or {}).items()},
                               items)


def test_qwen_image_refuses_video_latents_as_its_embed_layer_would(comfy_root):
    from pipetrainer.training.pipelines.base import adapter_for

    model = qwen_image_small().model
    shapes = _shapes({"still.png": (16, 1, 8, 8), "clip.mp4": (16, 3, 8, 8)})
    (problem,) = checks.family_rule_problems(model, {}, TimestepSpec(), shapes)
    assert "clip.mp4" in problem and "still.png" not in problem and "max_frames to 1" in problem, problem
    assert checks.family_rule_problems(model, {}, TimestepSpec(), _shapes({"still.png": (16, 1, 8, 8)})) == []
    embed = adapter_for("QwenImage").stage_layers(model.diffusion_model)[0]
    with pytest.raises(ValueError, match="image latents"):  # what training would hit without the rule
        embed((torch.zeros(1, 16, 3, 8, 8), torch.zeros(1), torch.zeros(1, 5, 3584)))


def test_qwen_image_edit_takes_three_references_like_text_encode_qwen_image_edit_plus(comfy_root):
    import inspect

    from comfy_extras import nodes_qwen

    takes = inspect.signature(nodes_qwen.TextEncodeQwenImageEditPlus.execute).parameters
    assert [p for p in takes if p.startswith("image")] == ["image1", "image2", "image3"]
    model = qwen_image_small().model
    inputs = checks.model_inputs(model)
    refs = {f"reference_{i}": (16, 8, 8) for i in range(4)}
    shapes = _shapes({"edit.png": (16, 1, 8, 8)}, {"edit.png": refs})
    problems = checks.extra_problems(shapes, inputs.extras, "QwenImage")
    assert len(problems) == 1 and "'reference_3'" in problems[0] and "would ignore" in problems[0], problems
    assert "takes only reference_0, reference_1, reference_2" in problems[0]


def test_reference_audio_a_model_would_ignore_is_refused_before_step_0(comfy_root):
    """MiniMax-H3's reference audio in a cache trained with an edit model that has no use for it."""
    inputs = checks.model_inputs(qwen_image_small().model)
    shapes = _shapes({"clip.png": (16, 1, 8, 8)}, {"clip.png": {"reference_0": (16, 8, 8), "ref_audio_0": (32, 2, 5)}})
    problems = checks.extra_problems(shapes, inputs.extras, "QwenImage")
    assert len(problems) == 1 and "reference or guide media" in problems[0] and "'ref_audio_0'" in problems[0], problems
    assert "remove the audio files and videos" in problems[0]


@pytest.mark.parametrize("row", ["WanVace", "WanS2V"])
def test_expert_is_refused_on_the_single_model_wan_relatives(row, comfy_root, fixture_paths):
    """Wan 2.1 VACE and Wan 2.2 S2V are one model for every noise level: an A14B expert range is refused by name."""
    from pipetrainer.tests.family_rows import all_rows

    (found,) = [r for r in all_rows() if r.name == row]
    model = found.load(comfy_root, fixture_paths).model
    (problem,) = checks.family_rule_problems(model, {"expert": "high_noise"}, TimestepSpec())
    assert "expert 'high_noise'" in problem and "one model for every noise level" in problem, problem
    assert checks.family_rule_problems(model, {}, TimestepSpec()) == []
