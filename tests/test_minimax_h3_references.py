"""MiniMax-H3's reference mode from a Dataset control folder of reference pictures and the Cache node's
``reference_in_prompt`` (``auto`` picks MiniMax-H3's style for its text encoder).

The oracle is ComfyUI's own ``MiniMaxH3ReferenceToVideo`` (``ref_image_size`` ``match``) with the item's reference
pictures as ``ref_images``, generating at the item's bucket: the cached cond and token tags must be its conditioning
(each picture in the prompt, as Qwen3-VL vision tokens tagged 0), and each cached reference latent its
``minimax_refs`` latent at the node's own size for that picture (aspect kept, scaled down to the bucket's pixel area,
never up, sides rounded to 32). The staged forward with these extras against ``apply_model`` is the family row's
generic check (tests/family_rows/minimax_h3.py, ``MiniMaxH3 references``).

Tiny models in ComfyUI's own classes, seeded: MiniMax-H3's text encoder
(tests/custom_nodes/pipetrainer_test_nodes/tiny_minimax_h3_te.py) and the narrow Wan 2.1 VAE standing in for H3's
2.6 B video VAE (the node encodes each picture with whatever VAE it is given). Reference PNGs are read as ComfyUI's
``Load Image`` reads them (tests/test_edit_prompt_cache.py shows that for PNG files).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.tests.test_i2v_cache import _by_source, _write_video
from pipetrainer.training.cache.buckets import BucketSettings
from pipetrainer.training.cache.start_image_prompt import IMAGE_TOKEN_TAGS

CAPTIONS = {"a.mp4": "<Picture 1> walks past <Picture 2>", "b.mp4": "<Picture 1> drifts"}
REFERENCES = {"a.png": (160, 64), "a_1.png": (48, 80), "b.png": (40, 120)}  # (width, height): down, kept, down
SETTINGS = BucketSettings(resolutions=(64,), min_ratio=0.5, max_ratio=2.0, count=3, max_frames=9, fps=24.0)


def _write_picture(path: Path, size: tuple[int, int], seed: int) -> None:
    import numpy as np
    from PIL import Image

    w, h = size
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def write_clips_and_pictures(root: Path, captions: dict[str, str], pictures: dict[str, tuple[int, int]]):
    """``(data, control)`` folders under ``root``: 12-frame 24 fps clips with their captions, and seeded pictures."""
    data, control = root / "data", root / "control"
    data.mkdir()
    control.mkdir()
    for name, caption in captions.items():
        _write_video(data / name, frames=12, fps=24, size=(96, 48))
        (data / name).with_suffix(".txt").write_text(caption, encoding="utf-8")
    for i, (name, size) in enumerate(pictures.items()):
        _write_picture(control / name, size, seed=i)
    return data, control


@pytest.fixture(scope="module")
def h3_refs(comfy_root, tmp_path_factory):
    """Two clips with reference pictures, cached with MiniMax-H3's text encoder and reference_in_prompt auto."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes.tiny_minimax_h3_te import tiny_minimax_h3_clip

    root = tmp_path_factory.mktemp("h3_refs")
    data, control = write_clips_and_pictures(root, CAPTIONS, REFERENCES)
    vae, clip = tiny_wan21_vae(), tiny_minimax_h3_clip()
    out = {"data": data, "control": control, "vae": vae, "clip": clip, "root": root}
    out["run"] = lambda cache, **kw: _cache(out, cache, **kw)
    out["result"] = out["run"](root / "cache")
    return out


def _cache(h3: dict, cache: Path, mode: str = "auto", start=None):
    from pipetrainer.training.cache import reference_prompt
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    dataset = scan_dataset(h3["data"], 64, buckets=SETTINGS, control_folder=h3["control"])
    refs = [(Path(e.path).name, len(e.references)) for e in dataset.entries]
    style, problems = reference_prompt.choose(mode, h3["clip"], refs)
    assert problems == []
    kwargs = {"start_image": start} if start is not None else {}
    return build_cache(dataset, h3["vae"], h3["clip"], cache, reference_prompt=style, **kwargs)


def _node(h3: dict, caption: str, references: list[str], width: int, height: int) -> dict:
    """``MiniMaxH3ReferenceToVideo``'s positive conditioning for the pictures, generating ``width`` x ``height``."""
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3ReferenceToVideo
    from pipetrainer.training.cache.reference_prompt import load_reference

    images = {f"ref_image_{i + 1}": load_reference(str(h3["control"] / name)) for i, name in enumerate(references)}
    result = MiniMaxH3ReferenceToVideo.execute(h3["clip"], h3["vae"], None, caption, width, height, 5,
                                               ref_image_size="match", ref_images=images)
    positive = result.args[0] if hasattr(result, "args") else result[0]
    return {"cond": positive[0][0], **positive[0][1]}


def test_auto_picks_minimax_h3s_reference_style_for_its_text_encoder(h3_refs):
    from pipetrainer.training.cache import reference_prompt

    style, problems = reference_prompt.choose("auto", h3_refs["clip"], [("a.mp4", 2)])
    assert problems == [] and style.node == "MiniMaxH3ReferenceToVideo" and style.size is not None


def test_cached_text_tags_and_references_equal_comfyuis_minimax_h3_reference_to_video(h3_refs):
    """Per clip: the cond and token tags are the node's (each picture's vision tokens tagged 0 ahead of the caption),
    and each reference latent is the node's ``minimax_refs`` latent, at the node's size for that picture."""
    cached = _by_source(h3_refs["result"])
    refs_of = {"a.mp4": ["a.png", "a_1.png"], "b.mp4": ["b.png"]}
    sizes = set()
    for name, caption in CAPTIONS.items():
        item, example = cached[name]
        bucket_h, bucket_w = (8 * s for s in example.latent.shape[-2:])  # the Wan VAE's 8x
        theirs = _node(h3_refs, caption, refs_of[name], bucket_w, bucket_h)
        cond = theirs["cond"][0].float()
        assert example.cond.shape == cond.shape, name
        assert torch.allclose(example.cond.float(), cond, rtol=0, atol=1e-6 * cond.abs().max().item()), name
        tags = example.extras[IMAGE_TOKEN_TAGS]
        assert torch.equal(tags, theirs["minimax_token_tags"]) and tags[-1] == 1 and (tags == 0).any(), name
        blocks = theirs["minimax_refs"]
        assert len(blocks) == len(refs_of[name]) and f"reference_{len(blocks)}" not in example.extras, name
        for i, block in enumerate(blocks):
            got, node = example.extras[f"reference_{i}"], block["latent"][0, :, 0].float()
            assert got.shape == node.shape, (name, i)
            assert torch.allclose(got, node, rtol=0, atol=1e-5 * node.abs().max().item()), (name, i)
            sizes.add(tuple(got.shape[-2:]))
    assert len(sizes) == 3  # each picture at its own size: none cropped to the bucket


def test_a_changed_reference_re_encodes_its_own_item_only(h3_refs, tmp_path):
    for part in ("data", "control"):
        shutil.copytree(h3_refs[part], tmp_path / part)
    shutil.copytree(h3_refs["root"] / "cache", tmp_path / "cache")
    h3 = {**h3_refs, "data": tmp_path / "data", "control": tmp_path / "control"}
    same = _cache(h3, tmp_path / "cache")
    assert same.report.encoded == {} and same.report.reused == {"latent": 2, "text": 2}
    _write_picture(tmp_path / "control" / "b.png", REFERENCES["b.png"], seed=9)
    changed = _cache(h3, tmp_path / "cache")
    assert changed.report.reused == {"latent": 1, "text": 1}
    assert sorted(changed.report.reencoded) == ["b.mp4 latent: reference images changed (reference 0)",
                                                "b.mp4 text: reference images changed (reference 0)"]


def test_first_last_frames_and_references_in_the_prompt_are_refused_together(h3_refs, tmp_path):
    from pipetrainer.training.cache.start_image import StartImage

    with pytest.raises(ValueError, match=r"no node does both.*start_image off"):
        h3_refs["run"](tmp_path / "cache", start=StartImage("first_last_frames"))


def test_references_without_their_pictures_in_the_prompt_are_refused_at_step_0(comfy_root):
    """A cache made with reference_in_prompt off: the latents are there, the captions lack the pictures."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    from pipetrainer.training.pipelines.base import Batch
    from pipetrainer.training.pipelines.minimax_h3 import ADAPTER

    video, audio = (1, 24, 2, 4, 6), (1, 32, 2, 3)
    batch = Batch(torch.zeros(1, 1, 1152 + 192), torch.zeros(1), torch.zeros(1, 5, 24),
                  extras={"reference_0": torch.zeros(1, 24, 4, 4)}, latent_shapes=(video, audio))
    with pytest.raises(ValueError, match=r"reference images or videos but captions encoded without them.*reference_in_prompt"):
        ADAPTER.first_stage_inputs(batch)
    tags = torch.tensor([[0, 0, 1, 1, 1]])
    inputs = ADAPTER.first_stage_inputs(Batch(batch.noisy, batch.timestep, batch.cond,
                                              extras={**batch.extras, IMAGE_TOKEN_TAGS: tags},
                                              latent_shapes=batch.latent_shapes))
    assert inputs[-1].shape == (1, 24, 1, 4, 4)  # the reference's one frame, as _cond_video_rows patchifies it
