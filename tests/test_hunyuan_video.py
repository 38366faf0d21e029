"""HunyuanVideo beyond the generic row checks: no text mask, batches of two, and refused relatives.

The generic checks (tests/test_families.py, row tests/family_rows/hunyuan_video.py) run with a text
mask; here the maskless path (ComfyUI passes no mask at all) and a batch of two are compared with
ComfyUI's own ``apply_model`` too.
"""

from __future__ import annotations

import torch
from pipetrainer.tests.family_rows.hunyuan_video import ROWS
from pipetrainer.training.pipelines.base import Batch, adapter_for

ROW = ROWS[0]


def test_without_a_text_mask_and_in_a_batch_of_two_equals_comfyui(comfy_root, fixture_paths):
    from pipetrainer.training.pipelines.hunyuan_video import HunyuanVideoOptions

    model = ROW.load(comfy_root, fixture_paths).model
    adapter = adapter_for("HunyuanVideo")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 2, 4, 6, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    cond, pooled = torch.randn(2, 6, 768, generator=g), torch.randn(2, 768, generator=g)
    options = HunyuanVideoOptions(guidance=3.5)
    t = model.model_sampling.timestep(sigma).float()
    out = adapter.first_stage_inputs(Batch(model.model_sampling.calculate_input(sigma, x), t, cond, pooled,
                                           options=options))
    with torch.no_grad():
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        theirs = model.apply_model(x, sigma, c_crossattn=cond, y=pooled, guidance=torch.full((2,), 3.5))
    ours = model.model_sampling.calculate_denoised(sigma, out.float(), x)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())


def test_odd_channel_layouts_and_15_relatives_are_refused_by_name(comfy_root):
    import dataclasses

    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams

    base = {"in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 64, "hidden_size": 128,
            "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 0, "axes_dim": [16, 56, 56],
            "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True, "guidance_embed": False, "byt5": False,
            "meanflow": False, "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}
    fields = {f.name for f in dataclasses.fields(HunyuanVideoParams)}

    def problems(**changes):
        config = {k: v for k, v in {**base, **changes}.items() if k in fields}
        dm = HunyuanVideo(image_model="hunyuan_video", device="meta", operations=torch.nn, **config)
        return adapter_for("HunyuanVideo").support_problems(dm)

    assert problems() == []
    assert problems(in_channels=32) == problems(in_channels=33) == []  # SkyReels I2V, HunyuanVideoI2V
    assert "concatenated input channels" in problems(in_channels=24)[0]
    assert "1.5" in problems(use_cond_type_embedding=True)[0]
    assert "MeanFlow" in problems(meanflow=True)[0]
