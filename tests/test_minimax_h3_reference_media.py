"""MiniMax-H3's reference videos and audio from a Dataset control folder (``name_video.mov``, ``name.wav``,
``name_1.flac``... beside the reference pictures) and the Cache node's audio VAE, with ``reference_in_prompt``
``auto``.

The oracle is ComfyUI's own ``MiniMaxH3ReferenceToVideo`` with the item's pictures as ``ref_images``, its videos as
ComfyUI's Load Video gives them (``VideoFromFile``: the frames as ``ref_videos``, the sound track as
``ref_video_audios``) and its audio files, read by ComfyUI's ``LoadAudio`` loader, as ``ref_audios``, generating the
item's clip: the cached cond and token tags must be its conditioning (each video's frames at 2 fps with timestamps,
its track's ``<Audio j>`` label first, the audio labels last) and each cached ``ref_video_k``, ``ref_video_audio_k``
and ``ref_audio_j`` the latent of its ``minimax_refs`` block (each sound whole, through ``VAE.encode``, whose input
crop keeps the centred whole latent frames). The staged forward with such extras against ``apply_model`` is the
family rows' generic check (tests/family_rows/minimax_h3.py, ``MiniMaxH3 reference audio`` and ``... video``).

Tiny models in ComfyUI's own classes, seeded: MiniMax-H3's text encoder, the narrow Wan 2.1 VAE standing in for
H3's video VAE, and ComfyUI's ``MiniMaxH3AudioVAE`` at a tiny width inside the ``comfy.sd.VAE`` object 'Load VAE'
makes for H3's audio VAE (built on the meta device at its real size, its model then swapped for the tiny one: the
loader detects only the full size). The audio files are at the VAE's 32 kHz, so neither side resamples (the current
host's torchaudio, which the node resamples with, is a stub). Current ComfyUI only.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pipetrainer.nodes.load_video import LoadVideoReader
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.tests.test_audio_data import write_clip
from pipetrainer.tests.test_i2v_cache import _by_source
from pipetrainer.tests.test_minimax_h3_references import write_clips_and_pictures
from pipetrainer.training.cache.buckets import BucketSettings
from pipetrainer.training.cache.start_image_prompt import IMAGE_TOKEN_TAGS

CAPTIONS = {"a.mp4": "<Picture 1> sings <Video 1> with <Audio 1>, then <Audio 2> and <Audio 3>",
            "b.mp4": "a room as in <Video 1> with <Audio 1>"}
PICTURES = {"a.png": (80, 48)}
SOUNDS = {"a.wav": (0.30, 330.0), "a_1.flac": (0.13, 550.0), "b.wav": (0.21, 440.0)}  # seconds, hz: 9600/4160/6720
SETTINGS = BucketSettings(resolutions=(64,), min_ratio=0.5, max_ratio=2.0, count=3, max_frames=9, fps=24.0)
RATE = 32000


def _tone(seconds: float, hz: float = 330.0) -> np.ndarray:
    t = np.arange(int(round(seconds * RATE))) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * hz * t), 0.3 * np.sin(2 * np.pi * 2 * hz * t)]).astype(np.float32)


def _write_sound(path: Path, seconds: float, hz: float) -> None:
    import av

    signal = _tone(seconds, hz)
    n = signal.shape[1]
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
    write_clip(control / "a_video.mov", seconds=2.0, signal=_tone(0.45), sr=RATE)  # 48 frames, a 32 kHz track
    write_clip(control / "b_video.mp4", seconds=0.5, audio=None, shade=90)  # 12 frames, no track
    out = {"data": data, "control": control, "vae": tiny_wan21_vae(), "clip": tiny_minimax_h3_clip(),
           "audio_vae": h3_audio_vae_object(), "root": root}
    out["result"] = _cache(out, root / "cache")
    return out


def _cache(h3: dict, cache: Path):
    from pipetrainer.training.cache import reference_prompt
    from pipetrainer.training.cache.clip_sound import ClipSound
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import is_audio, is_picture, is_video, scan_dataset

    dataset = scan_dataset(h3["data"], 64, buckets=SETTINGS, control_folder=h3["control"])
    counts = [[(Path(e.path).name, sum(map(of, e.references))) for e in dataset.entries]
              for of in (is_picture, is_audio, is_video)]
    style, problems = reference_prompt.choose("auto", h3["clip"], *counts)
    assert problems == [] and style.max_audio == 3 and style.max_videos == 3
    return build_cache(dataset, h3["vae"], h3["clip"], cache, reference_prompt=style, sound=ClipSound(h3["audio_vae"]),
                       read_video=LoadVideoReader())  # what the Cache node gives


def _node(h3: dict, caption: str, refs: tuple[list[str], list[str], list[str]], width: int, height: int,
          length: int) -> dict:
    """``MiniMaxH3ReferenceToVideo``'s positive conditioning for ``(pictures, videos, audio files)``, its videos read
    by ComfyUI's Load Video (``VideoFromFile``), its audio by ``LoadAudio``'s loader."""
    from comfy_api.latest import InputImpl
    from comfy_extras.nodes_audio import load
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3ReferenceToVideo
    from pipetrainer.training.cache.reference_prompt import load_reference

    pictures, videos, sounds = refs
    images = {f"ref_image_{i}": load_reference(str(h3["control"] / name)) for i, name in enumerate(pictures)}
    clips, tracks = {}, {}
    for k, name in enumerate(videos):
        components = InputImpl.VideoFromFile(str(h3["control"] / name)).get_components()
        clips[f"ref_video_{k}"] = components.images
        if components.audio is not None:
            tracks[f"ref_video_audio_{k}"] = components.audio
    audios = {}
    for i, name in enumerate(sounds):
        waveform, rate = load(str(h3["control"] / name))
        audios[f"ref_audio_{i}"] = {"waveform": waveform[None], "sample_rate": rate}
    result = MiniMaxH3ReferenceToVideo.execute(h3["clip"], h3["vae"], h3["audio_vae"], caption, width, height, length,
                                               ref_image_size="match", ref_images=images, ref_videos=clips,
                                               ref_video_audios=tracks, ref_audios=audios)
    positive = result.args[0] if hasattr(result, "args") else result[0]
    return {"cond": positive[0][0], **positive[0][1]}


def test_the_dataset_pairs_videos_and_audio_files_as_references_after_the_pictures(h3_sound_refs):
    from pipetrainer.training.data.dataset import scan_dataset

    dataset = scan_dataset(h3_sound_refs["data"], 64, buckets=SETTINGS, control_folder=h3_sound_refs["control"])
    refs = {Path(e.path).name: [Path(r).name for r in e.references] for e in dataset.entries}
    assert refs == {"a.mp4": ["a.png", "a_video.mov", "a.wav", "a_1.flac"], "b.mp4": ["b_video.mp4", "b.wav"]}
    assert "1 reference images and 2 reference videos and 3 reference audio files" in dataset.report()


def test_cached_text_and_reference_media_equal_comfyuis_minimax_h3_reference_to_video(h3_sound_refs):
    cached = _by_source(h3_sound_refs["result"])
    refs_of = {"a.mp4": (["a.png"], ["a_video.mov"], ["a.wav", "a_1.flac"]), "b.mp4": ([], ["b_video.mp4"], ["b.wav"])}
    lengths, kinds = set(), []
    for name, caption in CAPTIONS.items():
        item, example = cached[name]
        bucket_h, bucket_w = (8 * s for s in example.latent.shape[-2:])  # the Wan VAE's 8x
        frames = 4 * (example.latent.shape[-3] - 1) + 1  # its 4k+1 frames
        theirs = _node(h3_sound_refs, caption, refs_of[name], bucket_w, bucket_h, frames)
        cond = theirs["cond"][0].float()
        assert example.cond.shape == cond.shape, name  # the videos' frames and the <Audio j> labels are in the prompt
        assert torch.allclose(example.cond.float(), cond, rtol=0, atol=1e-6 * cond.abs().max().item()), name
        assert torch.equal(example.extras[IMAGE_TOKEN_TAGS], theirs["minimax_token_tags"]), name
        blocks = theirs["minimax_refs"]
        kinds.append([b["kind"] for b in blocks])
        videos = [b for b in blocks if b["kind"].startswith("video")]
        sounds = [b for b in blocks if b["kind"] == "audio"]
        ours = [(f"ref_video_{k}", b["latent"][0]) for k, b in enumerate(videos)]
        ours += [(f"ref_video_audio_{k}", b["audio_latent"][0]) for k, b in enumerate(videos) if b["ref_audio_t"]]
        ours += [(f"ref_audio_{j}", b["audio_latent"][0]) for j, b in enumerate(sounds)]
        held = sorted(k for k in example.extras if k.startswith(("ref_video", "ref_audio")))
        assert held == sorted(k for k, _ in ours), name
        for key, node in ours:
            got, node = example.extras[key], node.float()
            assert got.shape == node.shape, (name, key, got.shape, node.shape)
            assert torch.allclose(got, node, rtol=0, atol=1e-5 * node.abs().max().item()), (name, key)
        lengths |= {b["ref_audio_t"] for b in sounds}
        assert all(b["latent_t"] == example.extras[f"ref_video_{k}"].shape[1] for k, b in enumerate(videos))
    assert kinds == [["image", "video_audio", "audio", "audio"], ["video", "audio"]]
    assert lengths == {12, 5, 8}  # each file whole: 9600, 4160 and 6720 samples, cropped to whole 800-sample frames


def test_reference_videos_are_sized_and_cut_as_the_node_does(comfy_root):
    """Against the node module's own rules: the 768-short-edge canvas for a large video, its own size rounded to 32
    for a small one, the clip's aligned frame count, then 17k + 5 frames; under 5 frames is refused."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from comfy_extras.nodes_minimax_h3 import adapt_canvas, align_frame_count
    from pipetrainer.training.pipelines.minimax_h3_prompt import size_video

    large = torch.rand(48, 200, 360, 3)
    assert adapt_canvas(360, 200)[0] * adapt_canvas(360, 200)[1] > 360 * 200
    assert size_video(large, 9).shape == (22, 192, 352, 3)  # 360x200 rounded to 32; 22 = align_frame_count(9)
    huge = torch.rand(6, 900, 1600, 3)
    cw, ch = adapt_canvas(1600, 900)
    assert size_video(huge, 9).shape == (5, ch, cw, 3) and (cw, ch) != (1600, 896)  # the canvas, 6 -> 5 frames
    assert align_frame_count(40) == 56 and size_video(large, 40).shape[0] == 39  # all 48 frames, then 17k + 5
    with pytest.raises(ValueError, match="at least 5"):
        size_video(large[:4], 9)


def test_reference_video_frames_are_load_videos_at_the_datasets_rate(h3_sound_refs):
    """PyAV's RGB decode (used outside ComfyUI) gives Load Video's frames within 8-bit rounding; a file at another
    rate is taken every 1/24 s: a 30 fps second gives 24 frames, each the one on screen then."""
    from pipetrainer.training.cache.reference_media import PyAVVideoReader, video_frames

    path = str(h3_sound_refs["control"] / "a_video.mov")
    theirs, ours = LoadVideoReader()(path), PyAVVideoReader()(path)
    assert theirs[1] == ours[1] == 24.0 and theirs[0].shape == ours[0].shape == (48, 64, 64, 3)
    assert (theirs[0] - ours[0]).abs().max() < 3 / 255
    assert torch.equal(video_frames(path, 24.0, LoadVideoReader()), theirs[0])

    class Thirty:
        identity = "test"

        def __call__(self, path):
            return torch.arange(30.0).view(30, 1, 1, 1).expand(30, 2, 2, 3), 30.0

    shown = video_frames("thirty.mp4", 24.0, Thirty())[:, 0, 0, 0].tolist()
    assert len(shown) == 24 and shown[:6] == [0, 1, 2, 3, 5, 6] and shown[-1] == 28  # frame 28 is on screen at 23/24 s


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


def test_the_sound_guide_is_comfyuis_add_guide_of_the_clips_sound_at_frame_0(h3_sound_refs, tmp_path):
    """``audio_guide clip_sound`` with ``start_image first_keyframe``: MiniMaxH3ImageToVideo with the first frame,
    then MiniMaxH3AddGuide with the clip's kept sound at frame 0 (the talking-picture graph). The cached
    ``guide_audio`` is the guide's ``audio_latent``, the keyframe the node's, and the captions carry the frame only."""
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3AddGuide, MiniMaxH3ImageToVideo
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.clip_sound import GUIDE_AUDIO, ClipSound
    from pipetrainer.training.cache.media import load_video
    from pipetrainer.training.cache.start_image import KEYFRAME_FIRST, StartImage
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import ImageEntry, scan_dataset

    data = tmp_path / "data"
    data.mkdir()
    write_clip(data / "talk.mov", seconds=1.0, signal=_tone(1.0, 220.0), sr=RATE)
    (data / "talk.txt").write_text("a face talking", encoding="utf-8")
    sound = ClipSound(h3_sound_refs["audio_vae"], "clip_sound")
    five = dataclasses.replace(SETTINGS, max_frames=5)  # 6667 samples: VAE.encode's crop shifts the guide's start
    result = build_cache(scan_dataset(data, 64, buckets=five), h3_sound_refs["vae"], h3_sound_refs["clip"],
                         tmp_path / "cache", start_image=StartImage("first_keyframe"), sound=sound)
    _, example = _by_source(result)["talk.mov"]
    frames = 4 * (example.latent.shape[-3] - 1) + 1
    bucket = Bucket(8 * example.latent.shape[-1], 8 * example.latent.shape[-2], frames)
    pixels = load_video(str(data / "talk.mov"), bucket, SETTINGS.fps)
    samples, rate = sound.waveform(ImageEntry(str(data / "talk.mov"), ""), bucket, SETTINGS.fps)
    out = MiniMaxH3ImageToVideo.execute(h3_sound_refs["clip"], h3_sound_refs["vae"], "a face talking", bucket.width,
                                        bucket.height, frames, first_frame=pixels[:1])
    positive, latent = out.args if hasattr(out, "args") else out
    guided = MiniMaxH3AddGuide.execute(positive, latent, 0, audio_vae=h3_sound_refs["audio_vae"],
                                       audio={"waveform": samples[None], "sample_rate": rate})
    conditioning = (guided.args if hasattr(guided, "args") else guided)[0]
    first, guide = conditioning[0][1]["minimax_keyframes"]
    assert guide["resolved_frame_index"] == 0 and "latent" not in guide
    node = guide["audio_latent"][0].float()
    assert frames == 5 and example.extras[GUIDE_AUDIO].shape == node.shape == example.extras["audio_latent"].shape
    assert not torch.allclose(example.extras[GUIDE_AUDIO], example.extras["audio_latent"], atol=1e-3)  # not the target
    assert torch.allclose(example.extras[GUIDE_AUDIO], node, rtol=0, atol=1e-5 * node.abs().max().item())
    assert torch.allclose(example.extras[KEYFRAME_FIRST], first["latent"][0].float(), rtol=0, atol=1e-4)
    cond = conditioning[0][0][0].float()
    assert example.cond.shape == cond.shape and torch.allclose(example.cond.float(), cond, rtol=0,
                                                               atol=1e-6 * cond.abs().max().item())
    with pytest.raises(ValueError, match="audio_guide.*audio_vae"):
        ClipSound(None, "clip_sound")
