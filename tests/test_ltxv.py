"""LTX-Video beyond the generic row checks: the in-place residual guard, first-frame conditioning, the
frame rate, a batch of two without a text mask, and refused relatives.

The oracles are ComfyUI's own code: its ``BasicTransformerBlock`` and ``apply_model`` (with the noise
mask ``LTXVImgToVideo`` makes, brought to the latent's shape by the sampler's ``prepare_mask``, and
``LTXV.process_timestep``), and float64 finite differences through ComfyUI's block. The generic checks
(staged forward, LoRA gradients against finite differences, key map, sigma sampling, preflight; slow
tier: 1 vs 2 pipeline stages bitwise) are the LTXV row of tests/test_families.py
(tests/family_rows/ltxv.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from pipetrainer.tests.family_rows.ltxv import ROWS, ltxv_kwargs
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for, model_classes_of

ROW = ROWS[0]


def _model(comfy_root, fixture_paths):
    model = ROW.load(comfy_root, fixture_paths).model
    assert family_name_for(model) == "LTXV"
    return model


def _staged(adapter, dm, batch):
    out = adapter.first_stage_inputs(batch)
    for layer in adapter.stage_layers(dm):
        out = layer(out)
    return out


def _block_inputs(dm, seed: int = 0):
    """The tuple the first block layer receives, from the embed layer of the real model."""
    adapter = adapter_for("LTXV")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 128, 2, 3, 4, generator=g)
    cond = torch.randn(1, 5, 4096, generator=g)
    embed = adapter.stage_layers(dm)[0]
    with torch.no_grad():
        return embed(adapter.first_stage_inputs(Batch(x, torch.tensor([0.6]), cond, options=adapter.options_type())))


def test_comfyuis_block_updates_the_residual_in_place_and_the_guard_keeps_autograd_right(comfy_root, fixture_paths):
    """ComfyUI's block cannot be back-propagated as written (``x.addcmul_`` on a tensor its norm saved);
    the plain guard refuses it with a clear error; the private guard of the stage layer gives ComfyUI's
    output bit for bit, leaves the stage input untouched, and its gradient with respect to the block's
    input equals float64 finite differences (plain and under non-reentrant checkpointing)."""
    from pipetrainer.training.pipelines.out_of_place import OutOfPlaceResidualAdds

    dm = _model(comfy_root, fixture_paths).diffusion_model
    x, context, t_mod, t_emb, text_mask, sizes = _block_inputs(dm)
    layer = adapter_for("LTXV").stage_layers(dm)[1]
    pe = layer.positions.pe(sizes, 1, x.dtype, x.device)
    block = dm.transformer_blocks[0]

    def comfy_block(residual):
        return block(residual, context=context, attention_mask=None, timestep=t_mod, pe=pe, transformer_options={})

    with torch.no_grad():
        expected = comfy_block(x.clone())
    with pytest.raises(RuntimeError, match="in-place|inplace"):
        comfy_block(x.clone().requires_grad_(True) * 1.0).sum().backward()
    with pytest.raises(RuntimeError, match="private=True"), OutOfPlaceResidualAdds(x):
        comfy_block(x)

    before = x.clone()
    with torch.no_grad():
        got = layer((x, context, t_mod, t_emb, text_mask, sizes))[0]
    assert torch.equal(got, expected) and torch.equal(x, before)

    # float64 finite differences of a fixed loss along a random direction of the block's input
    block.double()
    try:
        args = [t.double() if t.is_floating_point() else t for t in (x, context, t_mod, t_emb)]
        g = torch.Generator().manual_seed(5)
        weight = torch.randn(x.shape, generator=g, dtype=torch.float64)
        direction = torch.randn(x.shape, generator=g, dtype=torch.float64)

        def loss(xin, checkpoint=False):
            inputs = (xin, *args[1:], text_mask, sizes)
            out = torch.utils.checkpoint.checkpoint(layer, inputs, use_reentrant=False) if checkpoint else layer(inputs)
            return (out[0] * weight).sum()

        grads = []
        for checkpoint in (False, True):
            xin = args[0].clone().requires_grad_(True)
            grads.append(torch.autograd.grad(loss(xin, checkpoint), xin)[0])
        assert torch.equal(grads[0], grads[1])
        eps = 1e-6
        with torch.no_grad():
            numeric = (loss(args[0] + eps * direction) - loss(args[0] - eps * direction)) / (2 * eps)
        analytic = (grads[0] * direction).sum()
        assert torch.allclose(analytic, numeric, rtol=1e-6), (analytic.item(), numeric.item())
    finally:
        block.float()


def test_first_frame_clean_equals_comfyui_with_ltxvimgtovideos_noise_mask(comfy_root, fixture_paths):
    """First latent frame clean, its tokens at timestep 0, as ComfyUI samples after LTXVImgToVideo."""
    import comfy.sampler_helpers
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.ltxv import LTXVOptions

    model = _model(comfy_root, fixture_paths)
    adapter = adapter_for("LTXV")
    g = torch.Generator().manual_seed(4)
    x0 = model.process_latent_in(torch.randn(1, 128, 3, 4, 5, generator=g))
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.6])
    cond = torch.randn(1, 7, 4096, generator=g)
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    options = LTXVOptions(first_frame_clean=True)
    batch = Batch(noised.network_input, noised.timestep, cond, options=options, clean=x0)
    with torch.no_grad():
        ours = _staged(adapter, model.diffusion_model, batch)
        plain = _staged(adapter, model.diffusion_model, Batch(noised.network_input, noised.timestep, cond))

    # LTXVImgToVideo's noise mask (strength 1: 0 on the image's latent frame), as the sampler shapes it;
    # the sampler puts the clean latent (LTXV.scale_latent_inpaint: unscaled) where the mask is 0.
    node_mask = torch.ones(1, 1, 3, 1, 1)
    node_mask[:, :, :1] = 0.0
    mask = comfy.sampler_helpers.prepare_mask(node_mask, x0.shape, torch.device("cpu"))
    x_in = noised.network_input * mask + x0 * (1 - mask)
    with torch.no_grad():
        theirs = model.apply_model(x_in, sigma, c_crossattn=cond, denoise_mask=mask,
                                   **ltxv_kwargs(cond, None, options, {}))
    ours_denoised = model.model_sampling.calculate_denoised(sigma, ours.float(), x_in)
    assert torch.allclose(ours_denoised, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    assert (ours - plain).abs().max() > 1e-3  # the clean frame and its timestep really change the output

    weight = adapter.loss_mask((128, 3, 4, 5), options)
    assert weight.shape == (1, 3, 1, 1) and weight.flatten().tolist() == [0.0, 1.0, 1.0]
    assert adapter.loss_mask((128, 1, 4, 5), options) is None  # an image: text-to-image, nothing clean
    assert adapter.loss_mask((128, 3, 4, 5), LTXVOptions()) is None


def test_frame_rate_batch_of_two_without_a_text_mask_equals_comfyui(comfy_root, fixture_paths):
    """The temporal positions follow the frame rate as ComfyUI's ``frame_rate`` cond does (here 23.976,
    not the default 25), in a batch of two at different sigmas with no text mask."""
    from pipetrainer.training.pipelines.ltxv import LTXVOptions

    model = _model(comfy_root, fixture_paths)
    adapter = adapter_for("LTXV")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, 2, 3, 4, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    cond = torch.randn(2, 6, 4096, generator=g)
    t = model.model_sampling.timestep(sigma).float()
    noisy = model.model_sampling.calculate_input(sigma, x)
    outs = {}
    for rate in (23.976, 25.0):
        options = LTXVOptions(frame_rate=rate)
        with torch.no_grad():
            out = _staged(adapter, model.diffusion_model, Batch(noisy, t, cond, options=options))
            theirs = model.apply_model(x, sigma, c_crossattn=cond, **ltxv_kwargs(cond, None, options, {}))
        ours = model.model_sampling.calculate_denoised(sigma, out.float(), x)
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), rate
        outs[rate] = out
    assert (outs[23.976] - outs[25.0]).abs().max() > 1e-6  # the rate really reaches the positions


def test_family_rules(comfy_root, fixture_paths):
    from pipetrainer.training.pipelines.ltxv import LTXVOptions

    dm = _model(comfy_root, fixture_paths).diffusion_model
    adapter = adapter_for("LTXV")
    geometry = adapter.geometry(dm)
    assert geometry.video and geometry.frame_step == 8 and geometry.patch == (1, 1, 1)  # 8k+1 pixel frames
    assert adapter.conditioning_dims(dm) == (4096, 0)
    assert adapter.image_tokens(dm, (128, 3, 5, 7)) == 105 and adapter.image_tokens(dm, (128, 5, 7)) == 35
    assert LTXVOptions(frame_rate=0.0).problems() and not LTXVOptions(frame_rate=24.0).problems()
    meta = adapter.run_metadata(dm, LTXVOptions(frame_rate=24.0, first_frame_clean=True))
    assert meta == {"ltxv.frame_rate": "24.0", "ltxv.first_frame_clean": "true"}


def test_relatives_are_refused_by_name(comfy_root):
    """Anything but LTX-Video's own model (LTX-2, class LTXAV, is a family of its own: LTX2) and LTX layouts with
    cross-attention AdaLN or a text connector."""
    import comfy.ldm.lightricks.model as ltx

    adapter = adapter_for("LTXV")
    assert "LTXAV" not in model_classes_of("LTXV")
    assert "not an LTX-Video model" in adapter.support_problems(torch.nn.Linear(2, 2))[0]
    tiny = {"in_channels": 128, "cross_attention_dim": 64, "attention_head_dim": 2, "num_attention_heads": 32,
            "caption_channels": 64, "num_layers": 1, "device": "meta", "operations": torch.nn}
    assert adapter.support_problems(ltx.LTXVModel(**tiny)) == []
    if not hasattr(ltx, "LTXBaseModel"):  # ComfyUI 0.3.75 has no LTX-2 code
        return
    import comfy.model_base
    import comfy.supported_models
    from pipetrainer.training.pipelines import checks

    config = comfy.supported_models.LTXAV({
        "image_model": "ltxav", "num_layers": 1, "attention_head_dim": 2, "cross_attention_dim": 64,
        "caption_channels": 64, "audio_cross_attention_dim": 64, "audio_attention_head_dim": 2})
    config.set_inference_dtype(torch.float32, None)
    av = comfy.model_base.LTXAV(config, device="meta")  # ComfyUI's own LTX-2 model class, no weights
    assert family_name_for(av) == "LTX2" and checks.model_support_problems(av) == []  # its own family
    assert "LTX-2 audio-video (LTXAV)" in adapter.support_problems(av.diffusion_model)[0]  # never LTX-Video's
    with pytest.raises(NotImplementedError, match="LTXAV"):
        adapter.stage_layers(av.diffusion_model)
    for layout in ({"cross_attention_adaln": True}, {"caption_proj_before_connector": True}):
        problems = adapter.support_problems(ltx.LTXVModel(**{**tiny, **layout}))
        assert problems and "LTX-2 layouts" in problems[0], layout
