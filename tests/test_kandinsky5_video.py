"""Kandinsky 5 video beyond the generic row: image-to-video, 1-frame examples, the family's rules and refusals.

The oracles are ComfyUI's own code: the ``Kandinsky5ImageToVideo`` node (with a real narrow ComfyUI VAE of the
same latent geometry: 16 channels, 8x spatial, 4x temporal) followed by ``Kandinsky5.extra_conds`` and
``apply_model``. The generic checks are the row in tests/family_rows/kandinsky5_video.py.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.tests.family_rows.kandinsky5_video import CONTEXT, POOLED, comfy_conds, kandinsky5_video_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for

FAMILY = "Kandinsky5Video"


def _staged(dm, batch):
    adapter = adapter_for(FAMILY)
    out = adapter.first_stage_inputs(batch)
    for layer in adapter.stage_layers(dm):
        out = layer(out)
    return out


def _i2v_node(cond, start=None, length=9, height=48, width=32):
    """``Kandinsky5ImageToVideo``'s (positive conds, empty latent) for a start image (or none)."""
    from comfy_extras.nodes_kandinsky5 import Kandinsky5ImageToVideo
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae

    node = Kandinsky5ImageToVideo.execute([[cond, {}]], [[cond, {}]], tiny_wan21_vae(), width, height, length, 1,
                                          start_image=start)
    positive, _, latent, cond_latent = node.result if hasattr(node, "result") else node
    return positive[0][1], latent["samples"], cond_latent


def test_first_frame_clean_equals_comfyui_after_kandinsky5imagetovideo(comfy_root):
    """The start image's latent over the first frame and the mask channel, as the node's conds give them."""
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.kandinsky5_video import Kandinsky5VideoOptions

    model = kandinsky5_video_small().model
    g = torch.Generator().manual_seed(5)
    cond, pooled = torch.randn(1, 6, CONTEXT, generator=g), torch.randn(1, POOLED, generator=g)
    start = torch.rand(1, 48, 32, 3, generator=g)
    values, empty, cond_latent = _i2v_node(cond, start)
    assert set(values) == {"time_dim_replace", "concat_mask"} and empty.shape == (1, 16, 3, 6, 4)
    # The trainer's clean latent: the clip's first latent frame is the start image's own latent (causal VAE).
    rest = torch.randn(1, 16, 2, 6, 4, generator=g)
    x0 = model.process_latent_in(torch.cat([cond_latent["samples"].float(), rest], dim=2))
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.6])
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    options = Kandinsky5VideoOptions(first_frame_clean=True)
    with torch.no_grad():
        ours = _staged(model.diffusion_model, Batch(noised.network_input, noised.timestep, cond, pooled,
                                                    options=options, clean=x0))
        plain = _staged(model.diffusion_model, Batch(noised.network_input, noised.timestep, cond, pooled))
        theirs = model.apply_model(noised.network_input, sigma, c_crossattn=cond,
                                   **comfy_conds(model, noise, pooled, **values))
    ours_denoised = model.model_sampling.calculate_denoised(sigma, ours.float(), noised.network_input)
    assert torch.allclose(ours_denoised, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    assert (ours - plain)[:, :, 1:].abs().max() > 1e-3  # the clean frame and the mask really reach later frames

    adapter = adapter_for(FAMILY)
    weight = adapter.loss_mask((16, 3, 6, 4), options)
    assert weight.shape == (1, 3, 1, 1) and weight.flatten().tolist() == [0.0, 1.0, 1.0]
    assert adapter.loss_mask((16, 1, 6, 4), options) is None  # an image: text-to-video, nothing clean
    assert adapter.loss_mask((16, 3, 6, 4), Kandinsky5VideoOptions()) is None


def test_text_to_video_input_is_what_the_node_without_a_start_image_gives(comfy_root):
    """Without a start image the node sets no conds: ``concat_cond`` is zero image channels and a zero mask."""
    model = kandinsky5_video_small().model
    g = torch.Generator().manual_seed(6)
    cond, pooled = torch.randn(1, 4, CONTEXT, generator=g), torch.randn(1, POOLED, generator=g)
    values, empty, cond_latent = _i2v_node(cond)
    assert values == {} and cond_latent == {}
    noise = torch.randn(empty.shape, generator=g)
    c_concat = comfy_conds(model, noise, pooled, **values)["c_concat"]
    x, *_ = adapter_for(FAMILY).first_stage_inputs(Batch(noise, torch.ones(1), cond, pooled))
    assert torch.equal(x, torch.cat([noise, c_concat], dim=1))


def test_a_one_frame_example_stays_a_one_frame_video_and_trains_text_to_video(comfy_root):
    """An image latent trains as a 1-frame video (5-D in and out, as ComfyUI's forward on a 5-D latent);
    ``first_frame_clean`` leaves it alone (nothing would be left to learn)."""
    from pipetrainer.training.pipelines.kandinsky5_video import Kandinsky5VideoOptions

    model = kandinsky5_video_small().model
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 16, 1, 6, 4, generator=g)
    cond, pooled = torch.randn(1, 3, CONTEXT, generator=g), torch.randn(1, POOLED, generator=g)
    sigma = torch.tensor([0.4])
    t = model.model_sampling.timestep(sigma).float()
    with torch.no_grad():
        plain = _staged(model.diffusion_model, Batch(x, t, cond, pooled))
        clean = _staged(model.diffusion_model, Batch(x, t, cond, pooled, clean=torch.zeros_like(x),
                                                     options=Kandinsky5VideoOptions(first_frame_clean=True)))
        theirs = model.apply_model(x, sigma, c_crossattn=cond, **comfy_conds(model, x, pooled))
    assert plain.shape == x.shape and torch.equal(plain, clean)
    ours = model.model_sampling.calculate_denoised(sigma, plain.float(), x)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())


def test_family_rules_and_registry(comfy_root):
    from pipetrainer.tests.family_rows.kandinsky5_image import kandinsky5_image_small
    from pipetrainer.training.pipelines.kandinsky5_video import Kandinsky5VideoOptions

    model = kandinsky5_video_small().model
    dm, adapter = model.diffusion_model, adapter_for(FAMILY)
    assert family_name_for(model) == FAMILY and type(model).__name__ == "Kandinsky5"
    assert family_name_for(kandinsky5_image_small().model) == "Kandinsky5Image"  # the subclass stays images
    geometry = adapter.geometry(dm)
    assert geometry.video and geometry.frame_step == 4 and geometry.patch == (1, 2, 2)
    assert adapter.conditioning_dims(dm) == (CONTEXT, POOLED)
    assert adapter.image_tokens(dm, (16, 3, 6, 10)) == 45 and adapter.image_tokens(dm, (16, 6, 10)) == 15
    assert adapter.run_metadata(dm, Kandinsky5VideoOptions(first_frame_clean=True)) == {
        "kandinsky5.first_frame_clean": "true"}
    assert adapter.run_metadata(dm, Kandinsky5VideoOptions()) == {}
    with pytest.raises(ValueError, match="DualCLIPLoader type kandinsky5"):
        adapter.first_stage_inputs(Batch(torch.zeros(1, 16, 3, 6, 4), torch.ones(1), torch.zeros(1, 2, CONTEXT)))
    with pytest.raises(ValueError, match="needs the clean latent"):
        adapter.first_stage_inputs(Batch(torch.zeros(1, 16, 3, 6, 4), torch.ones(1), torch.zeros(1, 2, CONTEXT),
                                         torch.zeros(1, POOLED), options=Kandinsky5VideoOptions(True)))


@pytest.mark.parametrize(("visual_embed_dim", "out_dim", "blocks", "message"), [
    (64, 16, 2, "takes 16 input channels per pixel; ComfyUI's Kandinsky5 video class feeds 33"),
    (132, 8, 2, "predicts 8 channels for 16 latent channels"),
    (132, 16, 0, "no visual transformer blocks"),
])
def test_layouts_comfyuis_video_class_cannot_run_are_refused_by_name(visual_embed_dim, out_dim, blocks, message,
                                                                      comfy_root):
    import torch.nn as nn

    require_model_class("Kandinsky5")
    from comfy.ldm.kandinsky5.model import Kandinsky5

    dm = Kandinsky5(in_visual_dim=16, out_visual_dim=out_dim, in_text_dim=8, in_text_dim2=8, time_dim=16, model_dim=32,
                    ff_dim=64, visual_embed_dim=visual_embed_dim, num_text_blocks=1, num_visual_blocks=blocks,
                    axes_dims=(4, 6, 6), device="meta", operations=nn)
    problems = adapter_for(FAMILY).support_problems(dm)
    assert len(problems) == 1 and message in problems[0], problems
    with pytest.raises(NotImplementedError, match=message.split(";")[0]):
        adapter_for(FAMILY).stage_layers(dm)
    assert adapter_for(FAMILY).support_problems(nn.Linear(2, 2))[0].startswith("Linear is not ComfyUI's Kandinsky5")
