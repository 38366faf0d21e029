"""MiniMax-H3's reference audio from a Dataset control folder (``name.wav``, ``name_1.flac``... beside the reference
pictures) and the Cache node's audio VAE, with ``reference_in_prompt`` ``auto``.

The oracle is ComfyUI's own ``MiniMaxH3ReferenceToVideo`` with the item's pictures as ``ref_images`` and its audio
files, read by ComfyUI's ``LoadAudio`` loader, as ``ref_audios``: the cached cond and token tags must be its
conditioning (``<Audio j>: `` after the pictures in the prompt) and each cached ``ref_audio_j`` the ``audio_latent``
of its ``minimax_refs`` block (the whole file, through ``VAE.encode``, whose input crop keeps the centred whole
latent frames). The staged forward with such extras against ``apply_model`` is the family row's generic check
(tests/family_rows/minimax_h3.py, ``MiniMaxH3 reference audio``).

Tiny models in ComfyUI's own classes, seeded: MiniMax-H3's text encoder, the narrow Wan 2.1 VAE standing in for
H3's video VAE, and ComfyUI's ``MiniMaxH3AudioVAE`` at a tiny width inside the ``comfy.sd.VAE`` object 'Load VAE'
makes for H3's audio VAE (built on the meta device at its real size, its model then swapped for the tiny one: the
loader detects only the full size). The audio files are at the VAE's 32 kHz, so neither side resamples (the current
host's torchaudio, which the node resamples with, is a stub). Current ComfyUI only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.tests.test_i2v_cache import _by_source
from pipetrainer.tests.test_minimax_h3_references import write_clips_and_pictures
from pipetrainer.training.cache.buckets import BucketSettings
from pipetrainer.training.cache.start_image_prompt import IMAGE_TOKEN_TAGS

CAPTIONS = {"a.mp4": "<Picture 1> sings <Audio 1> then <Audio 2>", "b.mp4": "a room with <Audio 1>"}
PICTURES = {"a.png": (80, 48)}
SOUNDS = {"a.wav": (0.30, 330.0), "a_1.flac": (0.13, 550.0), "b.wav": (0.21, 440.0)}  # seconds, hz: 9600/4160/6720
SETTINGS = BucketSettings(resolutions=(64,), min_ratio=0.5, max_ratio=2.0, count=3, max_frames=9, fps=24.0)
RATE = 32000


def _write_sound(path: Path, seconds: float, hz: float) -> None:
    import av

    n = int(round(seconds * RATE))
    t = np.arange(n) / RATE
    signal = np.stack([0.5 * np.sin(2 * np.pi * hz * t), 0.3 * np.sin(2 * np.pi * 2 * hz * t)]).astype(np.float32)
    codec = "flac" if path.suffix == ".flac" else "pcm_s16le"
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=RATE)
        stream.layout = "stereo"
        pcm = (signal * 32767).astype(np.int16)
        for start in range(0, n, 1024):
            frame = av.AudioFrame.from_ndarray(pcm[:, start:start + 1024].T.reshape(1, -1).copy(), format="s16",
                                               layout="stereo")
            frame.sample_rate, frame.pts = RATE, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def h3_audio_vae_object():
    """The ``comfy.sd.VAE`` 'Load VAE' makes for MiniMax-H3's audio VAE, around a tiny seeded ``MiniMaxH3AudioVAE``."""
    import comfy.model_patcher
    import comfy.ops
    import comfy.sd
    from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    from pipetrainer.devkit.fixtures import _randomize_scaled

    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=MiniMaxH3AudioVAE().state_dict())
    model = MiniMaxH3AudioVAE(encoder_dim=2, latent_dim=16, decoder_dim=8).float().eval()
    model.load_state_dict(_randomize_scaled({k: v.float() for k, v in model.state_dict().items()}, 5))
    with torch.no_grad():
        model.latents_mean.copy_(torch.linspace(-0.1, 0.1, model.latents_mean.numel()))
        model.latents_std.copy_(torch.linspace(0.5, 1.5, model.latents_std.numel()))
    vae.first_stage_model = model
    vae.patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                                   offload_device=torch.device("cpu"))
    vae.device, vae.output_device, vae.vae_dtype = torch.device("cpu"), torch.device("cpu"), torch.float32
    return vae


@pytest.fixture(scope="module")
def h3_sound_refs(comfy_root, tmp_path_factory):
    """Clip a with a picture and two audio files, clip b with one audio file and no picture, cached with MiniMax-H3's
    text encoder, reference_in_prompt auto and the audio VAE."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes.tiny_minimax_h3_te import tiny_minimax_h3_clip

    root = tmp_path_factory.mktemp("h3_sound_refs")
    data, control = write_clips_and_pictures(root, CAPTIONS, PICTURES)
    for name, (seconds, hz) in SOUNDS.items():
        _write_sound(control / name, seconds, hz)
    out = {"data": data, "control": control, "vae": tiny_wan21_vae(), "clip": tiny_minimax_h3_clip(),
           "audio_vae": h3_audio_vae_object(), "root": root}
    out["result"] = _cache(out, root / "cache")
    return out


def _cache(h3: dict, cache: Path):
    from pipetrainer.training.cache import reference_prompt
    from pipetrainer.training.cache.clip_sound import ClipSound
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import is_audio, scan_dataset

    dataset = scan_dataset(h3["data"], 64, buckets=SETTINGS, control_folder=h3["control"])
    sounds = [(Path(e.path).name, sum(map(is_audio, e.references))) for e in dataset.entries]
    pictures = [(name, len(e.references) - n) for (name, n), e in zip(sounds, dataset.entries, strict=True)]
    style, problems = reference_prompt.choose("auto", h3["clip"], pictures, sounds)
    assert problems == [] and style.max_audio == 3
    return build_cache(dataset, h3["vae"], h3["clip"], cache, reference_prompt=style, sound=ClipSound(h3["audio_vae"]))


def _node(h3: dict, caption: str, pictures: list[str], sounds: list[str], width: int, height: int) -> dict:
    """``MiniMaxH3ReferenceToVideo``'s positive conditioning, its audio read by ComfyUI's ``LoadAudio`` loader."""
    from comfy_extras.nodes_audio import load
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3ReferenceToVideo
    from pipetrainer.training.cache.reference_prompt import load_reference

    images = {f"ref_image_{i}": load_reference(str(h3["control"] / name)) for i, name in enumerate(pictures)}
    audios = {}
    for i, name in enumerate(sounds):
        waveform, rate = load(str(h3["control"] / name))
        audios[f"ref_audio_{i}"] = {"waveform": waveform[None], "sample_rate": rate}
    result = MiniMaxH3ReferenceToVideo.execute(h3["clip"], h3["vae"], h3["audio_vae"], caption, width, height, 5,
                                               ref_image_size="match", ref_images=images, ref_audios=audios)
    positive = result.args[0] if hasattr(result, "args") else result[0]
    return {"cond": positive[0][0], **positive[0][1]}


def test_the_dataset_pairs_audio_files_as_reference_audio_after_the_pictures(h3_sound_refs):
    from pipetrainer.training.data.dataset import scan_dataset

    dataset = scan_dataset(h3_sound_refs["data"], 64, buckets=SETTINGS, control_folder=h3_sound_refs["control"])
    refs = {Path(e.path).name: [Path(r).name for r in e.references] for e in dataset.entries}
    assert refs == {"a.mp4": ["a.png", "a.wav", "a_1.flac"], "b.mp4": ["b.wav"]}  # b needs no picture
    assert "1 reference images and 3 reference audio files" in dataset.report()


def test_cached_text_and_reference_audio_equal_comfyuis_minimax_h3_reference_to_video(h3_sound_refs):
    cached = _by_source(h3_sound_refs["result"])
    refs_of = {"a.mp4": (["a.png"], ["a.wav", "a_1.flac"]), "b.mp4": ([], ["b.wav"])}
    lengths = set()
    for name, caption in CAPTIONS.items():
        item, example = cached[name]
        bucket_h, bucket_w = (8 * s for s in example.latent.shape[-2:])  # the Wan VAE's 8x
        theirs = _node(h3_sound_refs, caption, *refs_of[name], bucket_w, bucket_h)
        cond = theirs["cond"][0].float()
        assert example.cond.shape == cond.shape, name  # the <Audio j> labels are in the prompt
        assert torch.allclose(example.cond.float(), cond, rtol=0, atol=1e-6 * cond.abs().max().item()), name
        assert torch.equal(example.extras[IMAGE_TOKEN_TAGS], theirs["minimax_token_tags"]), name
        blocks = [b for b in theirs["minimax_refs"] if b["kind"] == "audio"]
        assert len(blocks) == len(refs_of[name][1]) and f"ref_audio_{len(blocks)}" not in example.extras, name
        for j, block in enumerate(blocks):
            got, node = example.extras[f"ref_audio_{j}"], block["audio_latent"][0].float()
            assert got.shape == node.shape and got.shape[-1] == block["ref_audio_t"], (name, j)
            assert torch.allclose(got, node, rtol=0, atol=1e-5 * node.abs().max().item()), (name, j)
            lengths.add(got.shape[-1])
    assert lengths == {12, 5, 8}  # each file whole: 9600, 4160 and 6720 samples, cropped to whole 800-sample frames


def test_a_changed_audio_file_re_encodes_its_own_item_only(h3_sound_refs, tmp_path):
    for part in ("data", "control"):
        shutil.copytree(h3_sound_refs[part], tmp_path / part)
    shutil.copytree(h3_sound_refs["root"] / "cache", tmp_path / "cache")
    h3 = {**h3_sound_refs, "data": tmp_path / "data", "control": tmp_path / "control"}
    assert _cache(h3, tmp_path / "cache").report.encoded == {}
    _write_sound(tmp_path / "control" / "b.wav", 0.21, 660.0)
    changed = _cache(h3, tmp_path / "cache")
    assert changed.report.reused == {"latent": 1, "text": 1}
    assert all(line.startswith("b.mp4 ") for line in changed.report.reencoded), changed.report.reencoded


def test_reference_audio_without_a_style_that_takes_it_is_refused_with_the_fix(h3_sound_refs, tmp_path):
    from pipetrainer.training.cache import reference_prompt
    from pipetrainer.training.cache.clip_sound import ClipSound
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    style, problems = reference_prompt.choose("off", h3_sound_refs["clip"], [("a.mp4", 1)], [("a.mp4", 2)])
    assert style is None and len(problems) == 1
    assert "a.mp4 have reference audio" in problems[0] and "MiniMaxH3ReferenceToVideo" in problems[0]
    _, loud = reference_prompt.choose("auto", h3_sound_refs["clip"], [("a.mp4", 1)], [("a.mp4", 4)])
    assert "at most 3 reference audio" in loud[0]
    dataset = scan_dataset(h3_sound_refs["data"], 64, buckets=SETTINGS, control_folder=h3_sound_refs["control"])
    with pytest.raises(ValueError, match="reference audio.*audio_vae"):
        build_cache(dataset, h3_sound_refs["vae"], h3_sound_refs["clip"], tmp_path / "c1",
                    reference_prompt=reference_prompt.styles_for(h3_sound_refs["clip"])[0])
    with pytest.raises(ValueError, match="reference audio.*reference_in_prompt auto or minimax_h3_references"):
        build_cache(dataset, h3_sound_refs["vae"], h3_sound_refs["clip"], tmp_path / "c2",
                    sound=ClipSound(h3_sound_refs["audio_vae"]))
