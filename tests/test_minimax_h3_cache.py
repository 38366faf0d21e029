"""MiniMax-H3's data in the cache and the trainer: clips cut to its VAE's 17k + 5 frames, each clip's sound encoded
with its own stereo audio VAE at 32 kHz and cut to the audio length ComfyUI's H3 nodes give a clip of as many
frames, the audio carried in the packed latent as the sampler carries it, and micro-batches of captions of
different lengths.

The frame rule is read from ComfyUI's own H3 video VAE object (``comfy.sd.VAE`` built on the meta device: 2.6 B
parameters, no weights needed for its rule); the audio VAE is ComfyUI's ``MiniMaxH3AudioVAE`` class at a tiny width
with seeded weights (its loader detects only the full size, 151 M parameters). Current ComfyUI only.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pipetrainer.tests.family_rows.common import require_model_class


@pytest.fixture(scope="module")
def h3_video_vae(comfy_root):
    """ComfyUI's VAE object of MiniMax-H3's video VAE, on the meta device (its rules, not its weights)."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    import comfy.ldm.minimax.vae
    import comfy.ops
    import comfy.sd

    with torch.device("meta"):
        state = comfy.ldm.minimax.vae.MiniMaxH3VideoVAE(operations=comfy.ops.disable_weight_init).state_dict()
        return comfy.sd.VAE(sd=state)


@pytest.fixture(scope="module")
def h3_audio_vae(comfy_root):
    """A VAE object as 'Load VAE' gives it around ComfyUI's MiniMaxH3AudioVAE, at a tiny width, seeded."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    from pipetrainer.devkit.fixtures import _randomize_scaled

    model = MiniMaxH3AudioVAE(encoder_dim=2, latent_dim=16, decoder_dim=8).float().eval()
    state = {k: v.float() for k, v in model.state_dict().items()}
    model.load_state_dict(_randomize_scaled(state, 5))
    with torch.no_grad():
        model.latents_mean.copy_(torch.linspace(-0.1, 0.1, model.latents_mean.numel()))
        model.latents_std.copy_(torch.linspace(0.5, 1.5, model.latents_std.numel()))
    return SimpleNamespace(first_stage_model=model, vae_dtype=torch.float32)


def test_h3_clips_are_cut_to_the_frame_counts_its_vae_encodes_whole(h3_video_vae):
    from comfy_extras.nodes_minimax_h3 import align_frame_count
    from pipetrainer.training.cache.buckets import frame_bucket
    from pipetrainer.training.cache.encoders import ComfyEncoders

    encoders = ComfyEncoders(h3_video_vae, None)  # what the Cache node builds around the VAE it is given
    usable, step = encoders.usable_frames, encoders.frame_step
    assert usable is not None and step == 4  # its index formula (4) would cut 4k+1 frames
    got = {n: frame_bucket(n, 200, step, usable) for n in (1, 4, 5, 9, 21, 22, 30, 40, 121)}
    assert got == {1: 1, 4: 1, 5: 5, 9: 5, 21: 5, 22: 22, 30: 22, 40: 39, 121: 107}
    assert all(align_frame_count(f) == f for f in got.values() if f >= 5)  # what ComfyUI's H3 nodes sample
    assert frame_bucket(121, 60, step, usable) == 56  # max_frames bounds it


def test_a_step_rule_vae_keeps_its_buckets(comfy_root):
    """Wan's VAE (ComfyUI's object, on the meta device): its own functions give its 4k+1 rule, so nothing changes."""
    import comfy.ldm.wan.vae
    import comfy.sd
    from pipetrainer.training.cache.encoders import vae_usable_frames

    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=comfy.ldm.wan.vae.WanVAE(dim=96, z_dim=16).state_dict())
    assert callable(vae.downscale_ratio[0]) and vae_usable_frames(vae) is None


def _pcm(n: int, rate: int, channels: int) -> np.ndarray:
    t = np.arange(n) / rate
    tones = [0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.sin(2 * np.pi * 1000 * t)]
    return np.stack(tones[:channels]).astype(np.float32)


def test_the_cached_audio_latent_is_h3s_encode_of_the_kept_span(h3_audio_vae, tmp_path):
    from comfy_extras.nodes_minimax_h3 import temporal_shape
    from pipetrainer.tests.test_audio_data import FPS, write_clip
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.clip_sound import AUDIO_LATENT, ClipSound
    from pipetrainer.training.data.dataset import ImageEntry

    model = h3_audio_vae.first_stage_model
    sound = ClipSound(h3_audio_vae)
    assert (sound.codec.rate, sound.codec.channels) == (32000, 2)
    frames = 22
    bucket = Bucket(64, 64, frames)
    clip = ImageEntry(str(write_clip(tmp_path / "tone.mov", seconds=1.5, signal=_pcm(48000, 32000, 2), sr=32000)), "")
    samples, rate = sound.waveform(clip, bucket, float(FPS))
    assert rate == 32000 and samples.shape == (2, round(frames / FPS * 32000))
    latent = sound.encode(clip, bucket, float(FPS))[AUDIO_LATENT]
    audio_t = temporal_shape(frames)[2]  # EmptyMiniMaxH3LatentAV's audio length for this clip
    assert latent.shape == (32, 2, audio_t) == (32, 2, 37)
    with torch.no_grad():
        theirs = model.encode(samples[None])[0, ..., :audio_t]  # what VAE.encode runs on the same samples
    assert torch.equal(latent, theirs)
    assert not torch.allclose(sound.codec.encode(samples.flip(0), rate, frames, float(FPS)), latent)  # stereo counts
    mono = samples[:1]  # replicated to stereo, as ComfyUI's VAE pads the channels
    assert torch.equal(sound.codec.encode(mono, rate, frames, float(FPS)),
                       sound.codec.encode(mono.expand(2, -1), rate, frames, float(FPS)))


def test_h3_refuses_a_dataset_frame_rate_it_never_samples(h3_audio_vae):
    from pipetrainer.training.cache.clip_sound import ClipSound

    sound = ClipSound(h3_audio_vae)
    assert sound.problems(24.0) == []
    (problem,) = sound.problems(16.0)
    assert "fps to 24" in problem and "16" in problem
    assert ClipSound().problems(16.0) == []  # no audio VAE: nothing to refuse


def test_the_trainer_carries_h3s_audio_as_comfyuis_sampler_does(comfy_root):
    """ModelSamplingAV carries the audio scaled by video shift / audio shift (12 / 3) in the packed latent the sampler
    noises (``MiniMaxH3.process_latent_in`` with the sampler's ``latent_shapes``); the trainer's packed latent must be
    that one, or the model's forward, which undoes the carry, sees an audio latent 4x off."""
    from pipetrainer.tests.family_rows.minimax_h3 import LATENT, h3_small
    from pipetrainer.training.data.joint_latent import join_latent, pack_streams, unpack_streams

    model = h3_small().model
    g = torch.Generator().manual_seed(3)
    video, audio = torch.randn(1, *LATENT, generator=g), torch.randn(1, 32, 2, 3, generator=g)
    packed, shapes = join_latent(model, video, [audio])
    assert shapes == pack_streams([video, audio])[1]
    v, a = unpack_streams(packed, shapes)
    assert model.model_sampling.audio_scale == 4.0
    assert torch.equal(v, video) and torch.equal(a, audio * 4.0)
    assert model.latent_shapes is None  # the model is left as the trainer found it


def test_a_micro_batch_of_captions_of_two_lengths_trains_each_as_sampled_alone(comfy_root):
    """ComfyUI's H3 takes batch size 1, and its packed sequence holds the caption at its own length. A micro-batch
    of two examples (7 and 4 caption tokens, sigmas 0.7 and 0.3, the shorter caption zero-padded as the trainer
    stacks text) gives each example what ``apply_model`` gives it alone."""
    from pipetrainer.tests.family_rows.minimax_h3 import LATENT, TEXT_DIM, h3_kwargs, h3_small
    from pipetrainer.training.data.joint_latent import join_latent, pack_streams, unpack_streams
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    model = h3_small().model
    adapter = adapter_for("MiniMaxH3")
    g = torch.Generator().manual_seed(11)
    video, audio = torch.randn(2, *LATENT, generator=g), torch.randn(2, 32, 2, 3, generator=g)
    x0, shapes = join_latent(model, video, [audio])
    sigma = torch.tensor([0.7, 0.3])
    noised = noisy_input_and_target(model.model_sampling, x0, torch.randn(x0.shape, generator=g), sigma)
    conds = [torch.randn(1, 7, TEXT_DIM, generator=g), torch.randn(1, 4, TEXT_DIM, generator=g)]
    stacked = torch.cat([conds[0], torch.cat([conds[1], torch.zeros(1, 3, TEXT_DIM)], dim=1)])
    batch = Batch(noised.network_input, noised.timestep, stacked, latent_shapes=shapes, text_lengths=(7, 4),
                  options=adapter.options_type())
    out = adapter.first_stage_inputs(batch)
    with torch.no_grad():
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
    streams = unpack_streams(out, shapes)
    for i in range(2):
        one = pack_streams([s[i:i + 1] for s in unpack_streams(noised.network_input, shapes)])[0]
        alone = [torch.Size((1, *s[1:])) for s in shapes]
        kwargs = h3_kwargs(conds[i], None, None, {"audio_latent": audio[i:i + 1]})
        with torch.no_grad():
            theirs = model.diffusion_model(unpack_streams(one, alone), model.model_sampling.timestep(sigma[i:i + 1]),
                                           kwargs["c_crossattn"], minimax_payload=kwargs["minimax_payload"])
        for ours, ref in zip((s[i:i + 1] for s in streams), theirs, strict=True):
            assert torch.allclose(ours, ref, rtol=0, atol=1e-6 * ref.abs().max().item()), (i, (ours - ref).abs().max())


def test_condition_latents_reach_the_model_in_float32_under_a_bf16_compute_dtype(comfy_root):
    """``MiniMaxH3.extra_conds`` keeps the keyframe and reference latents float32 (its payload skips
    ``_apply_model``'s cast), so a bf16 run must not round them before ``_cond_video_rows`` patchifies them; the
    noisy latent and the text take the compute dtype as ever."""
    from pipetrainer.tests.family_rows.minimax_h3 import LATENT, TEXT_DIM, h3_small
    from pipetrainer.tests.helpers import BatchCapture
    from pipetrainer.training.data.micro_batches import Example, MicroBatches
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import TimestepSpec

    model = h3_small().model
    model.manual_cast_dtype = torch.bfloat16
    adapter = adapter_for("MiniMaxH3")
    capture = BatchCapture(adapter)
    g = torch.Generator().manual_seed(5)
    extras = {"audio_latent": torch.randn(32, 2, 3, generator=g), "reference_0": torch.randn(24, 4, 4, generator=g),
              "ref_audio_0": torch.randn(32, 2, 2, generator=g),
              "minimax_token_tags": torch.tensor([0, 0, 1, 1], dtype=torch.int64)}
    example = Example(torch.randn(*LATENT, generator=g), torch.randn(4, TEXT_DIM, generator=g), None, extras=extras,
                      latent_extra_shapes=(("reference_0", (24, 4, 4)),))
    MicroBatches([example], 1, 3, model, capture, TimestepSpec(), torch.device("cpu"),
                 family_options=adapter.options_type()).build(0)
    batch = capture.batches[-1]
    assert batch.noisy.dtype == batch.cond.dtype == torch.bfloat16
    for name in ("reference_0", "ref_audio_0"):
        assert batch.extras[name].dtype == torch.float32 and torch.equal(batch.extras[name][0], extras[name]), name
