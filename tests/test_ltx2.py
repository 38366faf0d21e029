"""LTX-2 beyond the generic family checks: the joint video + audio latent through the micro-batch builder (one
sigma, the loss over both streams), image-to-video as ComfyUI samples it, the stream presets, refusals."""

from __future__ import annotations

import re

import pytest
import torch
from pipetrainer.tests.family_rows.ltx2 import AUDIO_FRAMES, LATENT, ltx2_kwargs, ltx2_small
from pipetrainer.training.pipelines.base import adapter_for


def _example(audio: bool = True, seed: int = 0):
    from pipetrainer.training.data.micro_batches import Example

    g = torch.Generator().manual_seed(seed)
    extras = {"audio_latent": torch.randn(8, AUDIO_FRAMES, 16, generator=g)} if audio else {}
    return Example(torch.randn(*LATENT, generator=g), torch.randn(7, 16, generator=g), None, extras)


def _builder(model, examples, **options):
    from pipetrainer.training.data.micro_batches import MicroBatches
    from pipetrainer.training.pipelines.ltx2 import LTX2Options
    from pipetrainer.training.spec.options import TimestepSpec

    return MicroBatches(examples, len(examples), 3, model, adapter_for("LTX2"), TimestepSpec(), torch.device("cpu"),
                        family_options=LTX2Options(**options))


def test_the_micro_batch_is_comfyuis_packed_latent_noised_with_one_sigma(comfy_root):
    """The trainer's first-stage latent and target are ComfyUI's packed (video, audio) latent: the audio is
    noised with the video's sigma and the flow target covers both streams."""
    import comfy.utils

    model = ltx2_small().model
    examples = [_example(seed=0), _example(seed=1)]
    builder = _builder(model, examples)
    inputs, target = builder.build(0)
    packed, v_t, a_t = inputs[0], inputs[1], inputs[2]
    n_video, n_audio = 128 * 3 * 4 * 5, 8 * AUDIO_FRAMES * 16
    assert packed.shape == target.shape == (2, 1, n_video + n_audio)
    assert torch.equal(v_t, a_t) and v_t.shape == (2,)
    sigma = v_t.view(-1, 1, 1)  # flow: the timestep is the sigma
    # x0 = noisy - sigma * target on every element: the clean audio comes back from the audio part
    x0 = packed - sigma * target
    shapes = [torch.Size((2, *LATENT)), torch.Size((2, 8, AUDIO_FRAMES, 16))]
    video, audio = comfy.utils.unpack_latents(x0, shapes)
    order = [e.latent for e in examples]
    picked = [next(i for i, lat in enumerate(order) if torch.allclose(lat, video[j], atol=1e-5)) for j in range(2)]
    for j, i in enumerate(picked):
        assert torch.allclose(audio[j], examples[i].extras["audio_latent"], atol=1e-5)


def test_image_to_video_equals_comfyuis_sampling_after_ltxv_img_to_video(comfy_root):
    """First frame clean: the staged forward equals ``apply_model`` with the noise masks ComfyUI's LTX-2 I2V
    graph gives (0 on the first video latent frame, 1 on the audio), and the loss leaves that frame out only."""
    import comfy.utils
    from pipetrainer.training.data.joint_latent import unpack_streams
    from pipetrainer.training.pipelines.base import Batch
    from pipetrainer.training.pipelines.ltx2 import LTX2Options

    model = ltx2_small().model
    adapter = adapter_for("LTX2")
    options = LTX2Options(first_frame_clean=True, frame_rate=24.0)
    builder = _builder(model, [_example()], first_frame_clean=True, frame_rate=24.0)
    inputs, (target, weight) = builder.build(0)
    shapes = [torch.Size((1, *LATENT)), torch.Size((1, 8, AUDIO_FRAMES, 16))]
    w_video, w_audio = unpack_streams(weight.expand_as(target), shapes)
    assert w_video[:, :, 0].eq(0).all() and w_video[:, :, 1:].eq(1).all() and w_audio.eq(1).all()

    g = torch.Generator().manual_seed(5)
    clean, _ = comfy.utils.pack_latents([torch.randn(shapes[0], generator=g), torch.randn(shapes[1], generator=g)])
    noisy = torch.randn(clean.shape, generator=g)
    cond = torch.randn(1, 7, 16, generator=g)
    sigma = torch.tensor([0.6])
    batch = Batch(noisy, sigma, cond, extras={}, options=options, clean=clean, latent_shapes=tuple(shapes))
    out = tuple(adapter.first_stage_inputs(batch))
    given = out[0]
    for layer in adapter.stage_layers(model.diffusion_model):
        out = layer(out)
    v_mask = torch.ones(1, 1, *LATENT[1:])
    v_mask[:, :, 0] = 0.0
    with torch.no_grad():
        theirs = model.apply_model(given, sigma, denoise_mask=v_mask, audio_denoise_mask=torch.ones(1, 1, AUDIO_FRAMES, 16),
                                   **ltx2_kwargs(cond, None, options, {"audio_latent": torch.zeros(shapes[1])}))
    ours = model.model_sampling.calculate_denoised(sigma, out.detach().float(), given)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    assert torch.equal(unpack_streams(given, shapes)[0][:, :, 0], unpack_streams(clean, shapes)[0][:, :, 0])


def test_stream_presets_select_one_stream_each(comfy_root):
    from pipetrainer.training.pipelines.targets import model_targets

    dm = ltx2_small().model.diffusion_model
    adapter = adapter_for("LTX2")
    video = set(model_targets(dm, adapter.lora_target_regex("video")))
    audio = set(model_targets(dm, adapter.lora_target_regex("audio")))
    both = set(model_targets(dm, adapter.lora_target_regex("attention_mlp")))
    assert video and audio and not video & audio and video | audio == both
    writes_audio = re.compile(r"\.(audio_attn[12]|audio_ff|video_to_audio_attn)\.")  # modules updating the audio stream
    assert all(writes_audio.search(p) for p in audio) and not any(writes_audio.search(p) for p in video)
    with pytest.raises(ValueError, match="video, audio"):
        adapter.lora_target_regex("text")


def test_stream_presets_are_offered_and_refused_for_families_without_streams():
    from pipetrainer.training.pipelines.targets import preset_problems, preset_regex, run_target_regex
    from pipetrainer.training.spec.choices import STREAM_TARGET_PRESETS
    from pipetrainer.training.spec.options import LoraSpec

    ltx2, ltxv = adapter_for("LTX2"), adapter_for("LTXV")
    assert set(ltx2.stream_presets) == set(STREAM_TARGET_PRESETS)
    assert preset_problems(ltx2, "audio") == [] and preset_problems(ltxv, "attention") == []
    (problem,) = preset_problems(ltxv, "audio")
    assert "LTXV" in problem and "'audio'" in problem and "attention_mlp" in problem
    with pytest.raises(ValueError, match="no 'video' LoRA target preset"):
        run_target_regex(ltxv, None, LoraSpec(targets="video"))
    assert preset_regex(ltxv, "video") == ltxv.lora_target_regex("all_linear")  # estimates go on; preflight says why
    assert preset_regex(ltx2, "video") == ltx2.lora_target_regex("video")


def test_a_clip_without_its_audio_latent_is_refused_with_what_to_do(comfy_root):
    model = ltx2_small().model
    with pytest.raises(ValueError, match="audio VAE"):
        _builder(model, [_example(audio=False)]).build(0)


def test_captions_of_different_token_counts_batch_as_each_is_sampled_alone(comfy_root):
    """Two captions of 7 and 4 tokens in one micro-batch: each row of the staged prediction is ComfyUI's
    ``apply_model`` of that example alone with its own caption (the shorter one's padding never reaches the
    embeddings connectors, which append their registers after the caption)."""
    import comfy.utils
    from pipetrainer.training.data.micro_batches import stack_text
    from pipetrainer.training.pipelines.base import Batch
    from pipetrainer.training.pipelines.ltx2 import LTX2Options

    model = ltx2_small().model
    adapter = adapter_for("LTX2")
    options = LTX2Options()
    g = torch.Generator().manual_seed(11)
    one = [torch.Size((1, *LATENT)), torch.Size((1, 8, AUDIO_FRAMES, 16))]
    packed = [comfy.utils.pack_latents([torch.randn(s, generator=g) for s in one])[0] for _ in range(2)]
    conds = [torch.randn(7, 16, generator=g), torch.randn(4, 16, generator=g)]
    sigma = torch.tensor([0.7, 0.3])
    two = tuple(torch.Size((2, *s[1:])) for s in one)
    batch = Batch(torch.cat(packed), sigma, stack_text(conds, 7), options=options, latent_shapes=two,
                  text_lengths=(7, 4))
    out = tuple(adapter.first_stage_inputs(batch))
    for layer in adapter.stage_layers(model.diffusion_model):
        out = layer(out)
    for i in range(2):
        with torch.no_grad():
            theirs = model.apply_model(packed[i], sigma[i:i + 1], **ltx2_kwargs(
                conds[i][None], None, options, {"audio_latent": torch.zeros(one[1])}))
        ours = model.model_sampling.calculate_denoised(sigma[i:i + 1], out[i:i + 1].detach().float(), packed[i])
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item()), (i, (ours - theirs).abs().max())
