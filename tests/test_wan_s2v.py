"""Wan 2.2 S2V from the Cache node: each clip's sound and reference image cached as ComfyUI's S2V graph builds them.

The oracle is ComfyUI's own sampling graph on the same samples: ``AudioEncoderEncode`` with ComfyUI's
audio encoder (a tiny wav2vec2 in its real class, tests/family_rows/wan_s2v.py) on the clip's audio window as
the Dataset reads it, then ``WanSoundImageToVideo`` with the clip's first frame as ``ref_image`` and the
real (narrow) Wan 2.1 VAE, then ``WAN22_S2V.extra_conds``. ``AudioEncoderEncode`` first resamples with
torchaudio, whose ``resample`` returns the waveform itself when both rates are equal (16 kHz here); this host
has only a torchaudio stub, so that one call is given that identity (nothing of ComfyUI is replaced). Keys:
a changed track re-encodes its item only, with the reason; a clip without a track trains on encoded silence
and the report says so. The staged forward against ``apply_model`` is the family row's (tests/test_families.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

WINDOW = 8  # 5 kept frames = 2 latent frames = 8 audio slots at 16 fps


@pytest.fixture(scope="module")
def audio_encoder(comfy_root):
    from pipetrainer.tests.family_rows.wan_s2v import tiny_audio_encoder

    return tiny_audio_encoder()


@pytest.fixture
def equal_rate_resample(monkeypatch):
    """torchaudio's ``resample`` where both rates are equal (the identity), on a host with the torchaudio stub."""
    import torchaudio

    if not torchaudio.__version__.endswith("stub"):
        return

    def resample(waveform, orig_freq, new_freq, *args, **kwargs):
        assert orig_freq == new_freq, "only the equal-rate case is the identity"
        return waveform

    monkeypatch.setattr(torchaudio.functional, "resample", resample, raising=False)


def _settings():
    from pipetrainer.training.data.dataset import BucketSettings

    return BucketSettings(resolutions=(48,), max_frames=5, fps=16.0)


def _dataset_folder(root: Path) -> Path:
    """Clip a with a tone pair, clip b with noise, clip q without a track (1 s at 24 fps, 64x64)."""
    from pipetrainer.tests.test_audio_data import SR, write_clip

    data = root / "data"
    data.mkdir(parents=True)
    write_clip(data / "a.mp4", seconds=1.0)
    rng = np.random.default_rng(1)
    write_clip(data / "b.mp4", seconds=1.0, shade=60, signal=(rng.standard_normal((2, SR)) * 0.2).astype(np.float32))
    write_clip(data / "q.mp4", seconds=1.0, audio=None, shade=120)
    for name in "abq":
        (data / f"{name}.txt").write_text(f"clip {name}", encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def s2v(audio_encoder, encoders, tmp_path_factory):
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.s2v_sound import S2VSound
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    root = tmp_path_factory.mktemp("s2v")
    data = _dataset_folder(root)
    vae, clip = tiny_wan21_vae(), encoders[1]
    result = build_cache(scan_dataset(data, 48, buckets=_settings(), audio="optional"), vae, clip, root / "cache",
                         s2v=S2VSound(audio_encoder))
    return {"result": result, "root": root, "data": data, "vae": vae, "clip": clip}


def _by_source(result) -> dict:
    from pipetrainer.training.data.micro_batches import load_examples

    return {Path(i.source).name: e for i, e in zip(result.items, load_examples(result.items), strict=True)}


def _comfy_conditioning(audio_encoder, vae, waveform: torch.Tensor, first: torch.Tensor) -> dict:
    """ComfyUI's graph: AudioEncoderEncode, WanSoundImageToVideo (48x48, 5 frames, ref_image), extra_conds."""
    from comfy_extras.nodes_audio_encoder import AudioEncoderEncode
    from comfy_extras.nodes_wan import WanSoundImageToVideo
    from pipetrainer.tests.family_rows.wan_s2v import s2v_conds, wan_s2v_small

    encoded = AudioEncoderEncode.execute(audio_encoder, {"waveform": waveform[None], "sample_rate": 16000})
    output = (encoded.result if hasattr(encoded, "result") else encoded)[0]
    node = WanSoundImageToVideo.execute([[torch.zeros(1, 1, 1), {}]], [], vae, 48, 48, 5, 1,
                                        audio_encoder_output=output, ref_image=first)
    values = (node.result if hasattr(node, "result") else node)[0][0][1]
    model = wan_s2v_small().model
    return s2v_conds(model, (1, 16, 2, 6, 6), values["audio_embed"], values["reference_latents"][-1])


def test_cached_extras_are_what_comfyuis_s2v_graph_gives_the_model(s2v, audio_encoder, equal_rate_resample):
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import load_video
    from pipetrainer.training.data.audio import read_clip_audio

    result = s2v["result"]
    assert result.report.skipped == [] and len(result.items) == 3
    examples = _by_source(result)
    bucket = Bucket(48, 48, 5)
    for name in "abq":
        path = str(s2v["data"] / f"{name}.mp4")
        clip = read_clip_audio(path, 16000, 1, WINDOW, 16.0)  # the audio window as the Dataset reads it
        waveform = clip.samples if name != "q" else torch.zeros(1, WINDOW * 1000)  # q: silence of the window
        assert waveform.shape == (1, WINDOW * 1000) and (name == "q") == (not waveform.any())
        theirs = _comfy_conditioning(audio_encoder, s2v["vae"], waveform, load_video(path, bucket, 16.0)[:1])
        got = examples[f"{name}.mp4"].extras
        assert got["audio_embed"].shape == (25, 32, WINDOW) and got["s2v_reference"].shape == (16, 1, 6, 6)
        assert torch.equal(got["audio_embed"][None], theirs["audio_embed"]), name
        assert torch.equal(got["s2v_reference"][None], theirs["reference_latent"]), name
    assert not torch.equal(examples["a.mp4"].extras["audio_embed"], examples["b.mp4"].extras["audio_embed"])
    assert any("1 clip(s) have no sound track and train Wan S2V on the audio encoder's encoding of silence" in n
               and "q.mp4" in n for n in result.report.notes)


def test_a_changed_track_reencodes_only_its_item(s2v, audio_encoder, tmp_path):
    from pipetrainer.tests.family_rows.wan_s2v import tiny_audio_encoder
    from pipetrainer.tests.test_audio_data import SR, write_clip
    from pipetrainer.training.cache.s2v_sound import S2VSound
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    shutil.copytree(s2v["root"], tmp_path / "copy")  # later runs must not change the module's cache
    root = tmp_path / "copy"

    def cache(encoder=audio_encoder):
        dataset = scan_dataset(root / "data", 48, buckets=_settings(), audio="optional")
        return build_cache(dataset, s2v["vae"], s2v["clip"], root / "cache", s2v=S2VSound(encoder))

    again = cache()
    assert again.report.encoded == {} and again.report.reused == {"latent": 3, "text": 3}
    before = {Path(i.source).name: i.latent_key for i in again.items}
    rng = np.random.default_rng(9)
    write_clip(root / "data" / "b.mp4", seconds=1.0, shade=60,
               signal=(rng.standard_normal((2, SR)) * 0.2).astype(np.float32))  # same picture, another track
    changed = cache()
    assert changed.report.reencoded == ["b.mp4 latent: source bytes changed; S2V sound changed (track changed)"]
    assert changed.report.reused == {"latent": 2, "text": 3}
    after = {Path(i.source).name: i.latent_key for i in changed.items}
    assert after["a.mp4"] == before["a.mp4"] and after["q.mp4"] == before["q.mp4"] and after["b.mp4"] != before["b.mp4"]
    assert not torch.equal(_by_source(changed)["b.mp4"].extras["audio_embed"],
                           _by_source(again)["b.mp4"].extras["audio_embed"])
    entry = next(e for e in scan_dataset(root / "data", 48, buckets=_settings()).entries if e.path.endswith("a.mp4"))
    other = S2VSound(tiny_audio_encoder(seed=6))  # another encoder: every item's key moves (not encoded here)
    assert other.key_part(entry) != S2VSound(audio_encoder).key_part(entry)


def test_the_cache_node_takes_an_audio_encoder_and_refuses_what_s2v_cannot_use(audio_encoder):
    from pipetrainer.nodes.cache import PipeTrainerCache
    from pipetrainer.training.cache.s2v_sound import S2VSound

    inputs = {i.id: i for i in PipeTrainerCache.define_schema().inputs}
    assert inputs["audio_encoder"].optional
    sound = S2VSound(audio_encoder)
    assert sound.problems(16.0) == [] and S2VSound().problems(24.0) == []
    [fps] = sound.problems(24.0)
    assert "16 fps" in fps and "set the Dataset's fps to 16" in fps
    [flip] = sound.problems(16.0, "random")
    assert "flip" in flip
    with pytest.raises(ValueError, match="Load Audio Encoder"):
        S2VSound(object())


def test_a_cache_without_the_sound_is_refused_for_s2v_naming_the_input():
    from pipetrainer.tests.family_rows.wan_s2v import wan_s2v_small
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    model = wan_s2v_small().model
    adapter = adapter_for("WanS2V")
    assert adapter is not adapter_for("Wan") and set(adapter.extras(model.diffusion_model)) == {
        "audio_embed", "s2v_reference"}
    batch = Batch(torch.zeros(1, 16, 2, 6, 6), torch.tensor([500.0]), torch.zeros(1, 3, 16), None, extras={})
    with pytest.raises(ValueError, match="audio_encoder input of 'Cache Latents & Text'"):
        adapter.first_stage_inputs(batch)


def test_preflight_accepts_the_cached_extras_and_names_the_fix_without_them(s2v):
    import dataclasses

    from pipetrainer.nodes.checks.preflight import read_cached_shapes
    from pipetrainer.tests.family_rows.wan_s2v import wan_s2v_small
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.checks import extra_problems

    specs = adapter_for("WanS2V").extras(wan_s2v_small().model.diffusion_model)
    shapes = read_cached_shapes(s2v["result"].items)
    assert extra_problems(shapes, specs, "WanS2V") == []
    problems = extra_problems(dataclasses.replace(shapes, extras={}), specs, "WanS2V")
    assert len(problems) == 2 and all("audio_encoder input of 'Cache Latents & Text'" in p for p in problems)
