"""MiniMax-H3's first/last-frame mode from the Cache node's ``start_image = first_last_frames``, and its
image-to-video mode (``first_keyframe``: the first frame alone).

The oracle is ComfyUI's own ``MiniMaxH3ImageToVideo`` with ``first_frame`` and ``last_frame`` connected, given the
item's first and last kept frames at its bucket: the cached cond and token tags must be its conditioning (both frames
in the prompt, as Qwen3-VL vision tokens tagged 0), and the cached keyframe latents its ``minimax_keyframes`` latents.
The staged forward with these extras against ``apply_model`` is the family row's generic check
(tests/family_rows/minimax_h3.py, ``MiniMaxH3 keyframes``).

Tiny models in ComfyUI's own classes, seeded: MiniMax-H3's text encoder (``MiniMaxH3TEModel`` over ComfyUI's
Qwen3-VL at width 24 with a 32-wide vision tower and the real Qwen2 tokenizer:
tests/custom_nodes/pipetrainer_test_nodes/tiny_minimax_h3_te.py), and the narrow Wan 2.1 VAE standing in for H3's
2.6 B video VAE (the node encodes each frame with whatever VAE it is given).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.tests.test_i2v_cache import SETTINGS, VIDEO_BUCKET, _by_source, _write_video
from pipetrainer.training.cache.start_image import KEYFRAME_FIRST, KEYFRAME_LAST, StartImage
from pipetrainer.training.cache.start_image_prompt import IMAGE_TOKEN_TAGS, START_IMAGE_PROMPT

CAPTIONS = {"a.mp4": "a drifting gradient", "b.mp4": "a gradient drifting the other way"}
MODE = "first_last_frames"


@pytest.fixture(scope="module")
def h3_frames(comfy_root, tmp_path_factory):
    """Two clips cached with first_last_frames and MiniMax-H3's text encoder."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes.tiny_minimax_h3_te import tiny_minimax_h3_clip
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    root = tmp_path_factory.mktemp("h3_frames")
    data = root / "data"
    data.mkdir()
    for i, (name, caption) in enumerate(CAPTIONS.items()):
        _write_video(data / name, frames=24 + 7 * i, fps=24, size=(VIDEO_BUCKET.width, VIDEO_BUCKET.height))
        (data / name).with_suffix(".txt").write_text(caption, encoding="utf-8")
    vae, clip = tiny_wan21_vae(), tiny_minimax_h3_clip()

    def run(cache: Path, start: StartImage = StartImage(MODE), text_encoder=clip):  # noqa: B008 - frozen settings
        return build_cache(scan_dataset(data, 32, buckets=SETTINGS), vae, text_encoder, cache, start_image=start)

    return {"result": run(root / "cache"), "data": data, "vae": vae, "clip": clip, "run": run, "root": root}


def _frames(data: Path, name: str, latent_frames: int) -> torch.Tensor:
    """The clip at its bucket (the Wan VAE's 4k + 1 frames of ``latent_frames`` latent frames)."""
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import load_video

    bucket = Bucket(VIDEO_BUCKET.width, VIDEO_BUCKET.height, 4 * latent_frames - 3)
    return load_video(str(data / name), bucket, SETTINGS.fps)


def _h3_frames(length: int) -> int:
    from comfy_extras.nodes_minimax_h3 import align_frame_count

    return align_frame_count(max(5, length))


@pytest.mark.parametrize("length", [5, 22, 39, 124, 362])
def test_the_trainer_anchors_the_last_frame_where_the_node_does(comfy_root, length):
    """The trainer knows a clip only by its latent: its last-frame anchor, from the latent frames, is the node's
    ``frame_count - 1`` for every clip length H3's VAE encodes (the cache cuts clips to 17k + 5 frames)."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from comfy_extras.nodes_minimax_h3 import temporal_shape
    from pipetrainer.training.pipelines.minimax_h3_layout import Keyframes

    frames, latent_t, _ = temporal_shape(length)
    anchors = Keyframes(which=3, frames=1).anchors(latent_t)
    assert [a["resolved_frame_index"] for a in anchors] == [0, frames - 1]
    assert [a["resolved_frame_index"] for a in Keyframes(which=2, frames=1).anchors(latent_t)] == [frames - 1]


def _node(clip, vae, caption: str, pixels: torch.Tensor, first: bool = True, last: bool = True) -> dict:
    """``MiniMaxH3ImageToVideo``'s positive conditioning for the clip's first and last frames at its size (or one)."""
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3ImageToVideo

    height, width = pixels.shape[1:3]
    result = MiniMaxH3ImageToVideo.execute(clip, vae, caption, width, height, pixels.shape[0],
                                           first_frame=pixels[:1] if first else None,
                                           last_frame=pixels[-1:] if last else None)
    positive = result.args[0] if hasattr(result, "args") else result[0]
    return {"cond": positive[0][0], **positive[0][1]}


def test_cached_text_tags_and_keyframes_equal_comfyuis_minimax_h3_image_to_video(h3_frames):
    """Per clip: the cond and token tags are the node's (the two frames' vision tokens tagged 0 lead the caption's,
    and the cond differs from the caption encoded alone), ``start_image_prompt`` counts those tokens, and the
    keyframe latents are the node's ``minimax_keyframes`` latents, first frame then last."""
    cached = _by_source(h3_frames["result"])
    clip = h3_frames["clip"]
    for name, caption in CAPTIONS.items():
        _, example = cached[name]
        pixels = _frames(h3_frames["data"], name, example.latent.shape[1])
        theirs = _node(clip, h3_frames["vae"], caption, pixels)
        assert {KEYFRAME_FIRST, KEYFRAME_LAST, IMAGE_TOKEN_TAGS, START_IMAGE_PROMPT} <= set(example.extras), name
        cond = theirs["cond"][0].float()
        assert example.cond.shape == cond.shape, name
        assert torch.allclose(example.cond.float(), cond, rtol=0, atol=1e-6 * cond.abs().max().item()), name
        tags = example.extras[IMAGE_TOKEN_TAGS]
        assert torch.equal(tags, theirs["minimax_token_tags"]) and tags[0] == 1 and tags[-1] == 1, name
        images = int((tags == 0).sum())
        assert images > 0 and example.extras[START_IMAGE_PROMPT].tolist() == [images], name
        alone = clip.encode_from_tokens(clip.tokenize(caption), return_pooled=True, return_dict=True)["cond"][0]
        assert cond.shape[0] > alone.shape[0] + images and not torch.allclose(cond[-alone.shape[0]:], alone.float())
        first, last = theirs["minimax_keyframes"]  # the node anchors the last frame on H3's 17k + 5 frame grid
        assert (first["resolved_frame_index"], last["resolved_frame_index"]) == (0, _h3_frames(pixels.shape[0]) - 1)
        for mine, node in ((KEYFRAME_FIRST, first["latent"][0]), (KEYFRAME_LAST, last["latent"][0])):
            got = example.extras[mine]
            assert got.shape == node.shape and got.shape[1] == 1 and got.shape[2:] == example.latent.shape[2:], name
            assert torch.allclose(got, node.float(), rtol=0, atol=1e-5 * node.abs().max().item()), (name, mine)
        assert not torch.allclose(example.extras[KEYFRAME_FIRST], example.extras[KEYFRAME_LAST]), name


@pytest.mark.parametrize("mode", ["first_keyframe", "last_keyframe"])
def test_one_keyframe_is_comfyuis_image_to_video_with_that_frame_alone(h3_frames, tmp_path, mode):
    """``start_image = first_keyframe`` (``last_keyframe``): the node with ``first_frame`` (``last_frame``) only, its
    cond, tags and one keyframe, anchored where the node anchors it."""
    first = mode == "first_keyframe"
    mine, other = (KEYFRAME_FIRST, KEYFRAME_LAST) if first else (KEYFRAME_LAST, KEYFRAME_FIRST)
    cached = _by_source(h3_frames["run"](tmp_path / "cache", start=StartImage(mode)))
    for name, caption in CAPTIONS.items():
        _, example = cached[name]
        pixels = _frames(h3_frames["data"], name, example.latent.shape[1])
        theirs = _node(h3_frames["clip"], h3_frames["vae"], caption, pixels, first=first, last=not first)
        assert other not in example.extras and mine in example.extras, name
        cond = theirs["cond"][0].float()
        assert example.cond.shape == cond.shape, name  # one picture in the prompt, not two
        assert torch.allclose(example.cond.float(), cond, rtol=0, atol=1e-6 * cond.abs().max().item()), name
        assert torch.equal(example.extras[IMAGE_TOKEN_TAGS], theirs["minimax_token_tags"]), name
        (keyframe,) = theirs["minimax_keyframes"]
        assert keyframe["resolved_frame_index"] == (0 if first else _h3_frames(pixels.shape[0]) - 1)
        node = keyframe["latent"][0].float()
        assert torch.allclose(example.extras[mine], node, rtol=0, atol=1e-5 * node.abs().max().item()), name


def test_a_changed_clip_re_encodes_its_own_entries_only(h3_frames, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(h3_frames["data"], data)
    shutil.copytree(h3_frames["root"] / "cache", tmp_path / "cache")
    same = h3_frames["run"](tmp_path / "cache")
    assert same.report.encoded == {} and same.report.reused == {"latent": 2, "text": 2}
    _write_video(h3_frames["data"] / "b.mp4", frames=26, fps=24, size=(VIDEO_BUCKET.width, VIDEO_BUCKET.height))
    try:
        changed = h3_frames["run"](tmp_path / "cache")
    finally:
        shutil.copy(data / "b.mp4", h3_frames["data"] / "b.mp4")
    assert changed.report.reused == {"latent": 1, "text": 1}
    assert all(line.startswith("b.mp4 ") for line in changed.report.reencoded), changed.report.reencoded


def test_first_last_frames_needs_minimax_h3s_text_encoder_and_no_clip_vision(h3_frames, encoders, tmp_path):
    """Another text encoder cannot put the frames into the prompt as the model samples: refused with the fix; a
    CLIP vision model would go unused: a problem of the Cache node's settings."""
    from pipetrainer.tests.test_i2v_cache import tiny_clip_vision

    with pytest.raises(ValueError, match=r"MiniMaxH3ImageToVideo.*type minimax"):
        h3_frames["run"](tmp_path / "cache", text_encoder=encoders[1])
    problems = StartImage(MODE, tiny_clip_vision(tmp_path / "vision", seed=5)).problems()
    assert len(problems) == 1 and "Disconnect clip_vision" in problems[0]
    assert StartImage(MODE).problems() == []
