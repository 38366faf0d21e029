"""HunyuanVideo 1.5 beyond the generic row checks: which family claims which model class, what is refused and
why, and a batch of two against ComfyUI's own ``apply_model``.

The generic checks (tests/test_families.py, rows tests/family_rows/hunyuan_video15.py) cover one example with
ByT5 states and one with a text mask.
"""

from __future__ import annotations

import torch
from pipetrainer.tests.family_rows.common import from_config, require_model_class
from pipetrainer.tests.family_rows.hunyuan_video15 import CONTEXT, hunyuan_video15_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for


def _tiny_config(**changes) -> dict:
    config = {"image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "vec_in_dim": None,
              "context_in_dim": CONTEXT, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
              "depth_single_blocks": 0, "axes_dim": [8, 12, 12], "theta": 256, "patch_size": [1, 1, 1],
              "qkv_bias": True, "guidance_embed": False, "byt5": False, "meanflow": False,
              "use_cond_type_embedding": True, "vision_in_dim": 8, "meanflow_sum": True}
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    fields = HunyuanVideoParams.__dataclass_fields__  # 0.3.75 has no meanflow_sum
    return {k: v for k, v in {**config, **changes}.items() if k in fields or k == "image_model"}


def test_15_is_its_own_family_and_the_sr_distilled_model_is_refused_by_name(comfy_root):
    require_model_class("HunyuanVideo15_SR_Distilled")
    import comfy.supported_models
    from pipetrainer.training.pipelines.checks import model_support_problems

    t2v = hunyuan_video15_small(False, 1, 0, seed=5).model
    assert family_name_for(t2v) == "HunyuanVideo15"
    assert model_support_problems(t2v) == []

    sr = from_config(comfy.supported_models.HunyuanVideo15_SR_Distilled, _tiny_config(in_channels=98), seed=6).model
    assert type(sr).__name__ == "HunyuanVideo15_SR_Distilled"
    assert family_name_for(sr) == "HunyuanVideo15"  # a subclass: claimed, then refused with the reason
    [problem] = model_support_problems(sr)
    assert "HunyuanVideo15_SR_Distilled" in problem and "low-resolution video latent" in problem

    meanflow = from_config(comfy.supported_models.HunyuanVideo15, _tiny_config(meanflow=True), seed=7).model
    [problem] = model_support_problems(meanflow)
    assert "MeanFlow" in problem


def test_hunyuan_video_10_no_longer_claims_15(comfy_root):
    require_model_class("HunyuanVideo15")
    import comfy.model_base
    from pipetrainer.training.pipelines.base import model_classes_of

    assert "HunyuanVideo15" in model_classes_of("HunyuanVideo15")
    assert "HunyuanVideo15" not in model_classes_of("HunyuanVideo")
    assert issubclass(comfy.model_base.HunyuanVideo15, comfy.model_base.HunyuanVideo)  # why 1.5 registers itself


def test_a_start_image_cache_is_refused_with_the_reason(comfy_root):
    """Wan's start image (``first_frame``) is not 1.5's; preflight says why and names ``first_frame_alone``
    (tests/test_hunyuan_video15_i2v.py trains 1.5 image-to-video)."""
    from pipetrainer.training.cache.start_image import CONCAT_LATENT
    from pipetrainer.training.pipelines.checks import CachedShapes, extra_problems

    require_model_class("HunyuanVideo15")
    dm = hunyuan_video15_small(True, 1, 0, seed=8).model.diffusion_model
    shapes = CachedShapes(latents={"l0": (32, 3, 5, 7)}, conds={"t0": (6, CONTEXT)}, pooled={"t0": 0},
                          unreadable=(), extras={"l0": {CONCAT_LATENT: (32, 3, 5, 7)}}, items=(("clip.mp4", "l0", "t0"),))
    [problem] = extra_problems(shapes, adapter_for("HunyuanVideo15").extras(dm), "HunyuanVideo15")
    assert "set start_image to first_frame_alone" in problem
    assert "'concat_latent' for clip.mp4" in problem and "set it to none" in problem
    plain = CachedShapes(latents={"l0": (32, 3, 5, 7)}, conds={"t0": (6, CONTEXT)}, pooled={"t0": 0},
                         unreadable=(), items=(("clip.mp4", "l0", "t0"),))
    assert extra_problems(plain, adapter_for("HunyuanVideo15").extras(dm), "HunyuanVideo15") == []


def test_a_batch_of_two_without_a_mask_equals_comfyui(comfy_root):
    from pipetrainer.training.pipelines.hunyuan_video import HunyuanVideoOptions

    model = hunyuan_video15_small(False, 1, 1, seed=9).model
    adapter = adapter_for("HunyuanVideo15")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 2, 3, 5, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    cond = torch.randn(2, 6, CONTEXT, generator=g)
    options = HunyuanVideoOptions(guidance=3.5)
    t = model.model_sampling.timestep(sigma).float()
    out = adapter.first_stage_inputs(Batch(model.model_sampling.calculate_input(sigma, x), t, cond, None,
                                           options=options))
    with torch.no_grad():
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        c_concat = model.concat_cond(noise=x, device=torch.device("cpu"))
        theirs = model.apply_model(x, sigma, c_concat=c_concat, c_crossattn=cond, guidance=torch.full((2,), 3.5))
    ours = model.model_sampling.calculate_denoised(sigma, out.float(), x)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
