"""LTX-2's sound in the cache: the audio latent is ComfyUI's ``AudioVAE.encode`` of the clip's kept span, a clip
without sound gets encoded silence, and a changed track re-encodes its item only.

The audio VAE is ComfyUI's own ``AudioVAE`` class, narrow (8 base channels, a small vocoder), fixed-seed weights
and per-channel statistics. ComfyUI's resample and mel run on torchaudio, which the current host only has as a
stub: where ``AudioVAE.encode`` cannot run, the reference is its autoencoder, posterior mode and normalizer on
the same log-mel (the mel itself is checked against its definition in tests/test_audio_data.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

SR = 16000


def tiny_audio_vae(seed: int = 5):
    """ComfyUI's LTX-2 ``AudioVAE`` at 8 base channels (the real one: 128), 16 kHz, 64 mels, seeded."""
    import comfy.ldm.lightricks.av_model  # noqa: F401  (ComfyUI's LTX-2 code; absent on 0.3.75)
    from comfy.ldm.lightricks.vae.audio_vae import AudioVAE

    dd = {"double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
          "in_channels": 2, "out_ch": 2, "ch": 8, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
          "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}
    ae = {"model": {"params": {"ddconfig": dd, "sampling_rate": SR}},
          "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}}
    vocoder = {"upsample_initial_channel": 8, "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
               "upsample_rates": [4, 4], "upsample_kernel_sizes": [8, 8]}
    vae = AudioVAE({"config": {"audio_vae": ae, "vocoder": vocoder}})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in vae.state_dict().items():
            if t.is_floating_point():
                scale = 0.5 if "std" in name else 0.2
                t.copy_(torch.randn(t.shape, generator=g) * scale + (1.0 if "std" in name else 0.0))
    return vae.eval()


@pytest.fixture(scope="module")
def audio_vae(comfy_root):
    from pipetrainer.tests.family_rows.common import require_model_class

    require_model_class("LTXAV")
    return tiny_audio_vae()


def _reference(vae, waveform: torch.Tensor) -> torch.Tensor:
    """``AudioVAE.encode`` of ``waveform`` ``[1, ch, n]`` at the VAE's rate: ComfyUI's own call where torchaudio
    runs; else its model part (autoencoder, posterior mode, normalizer) on the same log-mel."""
    from comfy.ldm.mmaudio.vae.distributions import DiagonalGaussianDistribution
    from pipetrainer.training.cache.audio_mel import log_mel

    try:
        with torch.no_grad():
            return vae.encode(waveform, SR)[0]
    except Exception:  # noqa: BLE001 - torchaudio is a stub on this host: it imports, calls raise
        pass
    mel = log_mel(waveform, SR, 1024, 160, 64)
    with torch.no_grad():
        return vae.normalizer.normalize(DiagonalGaussianDistribution(vae.autoencoder.encode(mel)).mode())[0]


def test_the_audio_latent_is_comfyuis_audio_vae_encode_of_the_same_samples(audio_vae):
    from pipetrainer.training.cache.audio_latent import encode_audio

    g = torch.Generator().manual_seed(1)
    stereo = torch.randn(2, SR, generator=g) * 0.3
    ours = encode_audio(audio_vae, stereo, SR)
    theirs = _reference(audio_vae, stereo[None])
    assert ours.shape == (8, 26, 16) == theirs.shape  # 101 mel frames, 4x causal downsampling
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    mono = stereo[:1]  # repeated to the encoder's 2 channels, as AudioVAE.encode does
    assert torch.equal(encode_audio(audio_vae, mono, SR), encode_audio(audio_vae, mono.expand(2, -1), SR))
    assert not torch.allclose(encode_audio(audio_vae, stereo.flip(0), SR), ours)  # the channels count


def test_a_clip_without_sound_trains_on_encoded_silence_of_its_kept_span(audio_vae, tmp_path):
    from pipetrainer.tests.test_audio_data import FPS, write_clip
    from pipetrainer.training.cache.audio_latent import encode_audio
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.clip_sound import AUDIO_LATENT, ClipSound
    from pipetrainer.training.data.dataset import ImageEntry

    sound = ClipSound(audio_vae)
    bucket = Bucket(64, 64, 9)
    quiet = ImageEntry(str(write_clip(tmp_path / "quiet.mp4", audio=None)), "")
    samples, rate = sound.waveform(quiet, bucket, float(FPS))
    assert rate == SR and samples.shape == (2, round(9 / FPS * SR)) and not samples.any()
    latent = sound.encode(quiet, bucket, float(FPS))[AUDIO_LATENT]
    assert torch.equal(latent, encode_audio(audio_vae, samples, rate)) and latent.abs().max() > 0.1  # not the zero latent
    loud = ImageEntry(str(write_clip(tmp_path / "loud.mp4")), "")
    played, _ = sound.waveform(loud, bucket, float(FPS))
    assert played.shape == samples.shape and played.abs().max() > 0.1
    assert sound.key_part(quiet) != sound.key_part(loud)
    assert sound.note() == ("1 clip(s) have no sound track and train on encoded silence of their kept span: "
                            "quiet.mp4")  # said in the Cache node's report


def test_a_changed_track_reencodes_only_its_item(audio_vae, encoders, tmp_path):
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.tests.test_audio_data import SR as CLIP_SR
    from pipetrainer.tests.test_audio_data import write_clip
    from pipetrainer.training.cache.clip_sound import AUDIO_LATENT, ClipSound
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import BucketSettings, scan_dataset
    from pipetrainer.training.data.micro_batches import load_examples

    data = tmp_path / "data"
    data.mkdir()
    for i, name in enumerate("ab"):
        write_clip(data / f"{name}.mp4", seconds=1.0, shade=40 * i)
        (data / f"{name}.txt").write_text(f"clip {name}", encoding="utf-8")
    settings = BucketSettings(resolutions=(48,), max_frames=5, fps=8.0)
    vae, clip = tiny_wan21_vae(), encoders[1]

    def cache():
        dataset = scan_dataset(data, 48, buckets=settings, audio="optional")
        return build_cache(dataset, vae, clip, tmp_path / "cache", sound=ClipSound(audio_vae))

    first = cache()
    assert first.report.skipped == [] and len(first.items) == 2
    latents = {Path(i.source).name: e.extras[AUDIO_LATENT] for i, e in zip(first.items, load_examples(first.items),
                                                                             strict=True)}
    assert all(v.shape[0] == 8 and v.shape[2] == 16 for v in latents.values())
    before = {Path(i.source).name: i.latent_key for i in first.items}

    rng = np.random.default_rng(3)
    write_clip(data / "b.mp4", seconds=1.0, shade=40, signal=(rng.standard_normal((2, CLIP_SR)) * 0.2).astype(np.float32))
    changed = cache()
    assert changed.report.reused == {"latent": 1, "text": 2}
    assert len(changed.report.reencoded) == 1 and changed.report.reencoded[0].startswith("b.mp4 latent")
    after = {Path(i.source).name: i.latent_key for i in changed.items}
    assert after["a.mp4"] == before["a.mp4"] and after["b.mp4"] != before["b.mp4"]
    shutil.rmtree(tmp_path / "cache")
