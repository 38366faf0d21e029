"""Qwen-Image-Edit: each caption cached with its item's reference images in the text encoder's prompt.

The text encoder is a real ``comfy.sd.CLIP`` of ComfyUI's Qwen-Image classes (Qwen2.5-VL language model and
vision tower at width 32, seeded weights; tests/custom_nodes/pipetrainer_test_nodes/tiny_qwen25vl.py). The
oracle is ComfyUI itself: ``Load Image`` reads the reference files and ComfyUI's own
``TextEncodeQwenImageEditPlus`` / ``TextEncodeQwenImageEdit`` nodes (``vae`` not connected) encode them with
the caption; the cached ``cond`` must be that conditioning tensor exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pipetrainer.training.cache import reference_prompt
from pipetrainer.training.cache.reader import read_entries
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import scan_dataset
from pipetrainer.training.pipelines.qwen_image_prompt import EDIT, EDIT_PLUS

CAPTIONS = {"a": "make the sky red", "b": "swap the two objects"}


@pytest.fixture(scope="module")
def vl_clip(comfy_root):
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes import tiny_qwen25vl

    return tiny_qwen25vl.tiny_qwen25vl_clip()


def _image(path: Path, width: int, height: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(path)


def _edit_pairs(root: Path) -> Path:
    """Two edit pairs: ``a`` with one reference, ``b`` with two (of other sizes than the targets)."""
    data, control = root / "data", root / "control"
    data.mkdir()
    control.mkdir()
    for i, (stem, caption) in enumerate(CAPTIONS.items()):
        _image(data / f"{stem}.png", 64, 64, seed=i)
        (data / f"{stem}.txt").write_text(caption, encoding="utf-8")
    _image(control / "a.png", 72, 56, seed=10)
    _image(control / "b.png", 48, 64, seed=11)
    _image(control / "b_1.png", 64, 40, seed=12)
    return root


@pytest.fixture(scope="module")
def edit_base(encoders, vl_clip, tmp_path_factory):
    """The pairs cached once with reference_in_prompt auto (the cache and its report)."""
    root = _edit_pairs(tmp_path_factory.mktemp("edit_prompt"))
    return root, _cache(root, encoders[0], vl_clip)


@pytest.fixture
def edit_data(edit_base, tmp_path):
    """A copy of the cached pairs that a test may change."""
    for part in ("data", "control", "cache"):
        shutil.copytree(edit_base[0] / part, tmp_path / part)
    return tmp_path


def _dataset(root: Path, control: bool = True):
    return scan_dataset(root / "data", 64, control_folder=root / "control" if control else None)


def _refs(dataset) -> list[tuple[str, int]]:
    return [(Path(e.path).name, len(e.references)) for e in dataset.entries]


def _cache(root: Path, vae, clip, mode: str = "auto", control: bool = True):
    dataset = _dataset(root, control)
    style, problems = reference_prompt.choose(mode, clip, _refs(dataset))
    assert problems == []
    return build_cache(dataset, vae, clip, root / "cache", reference_prompt=style)


def _cached_conds(result) -> dict[str, torch.Tensor]:
    tensors = read_entries(result.items[0].text_file, [i.text_key for i in result.items])
    return {Path(i.source).stem: tensors[i.text_key]["cond"] for i in result.items}


def _load_image(root: Path, name: str) -> torch.Tensor:
    """ComfyUI's ``Load Image`` of ``control/<name>`` (the input folder pointed at ``root`` meanwhile)."""
    import folder_paths

    import nodes

    before = folder_paths.get_input_directory()
    folder_paths.set_input_directory(str(root))
    try:
        return nodes.LoadImage().load_image(f"control/{name}")[0]
    finally:
        folder_paths.set_input_directory(before)


def _node_cond(node, clip, caption: str, images: list[torch.Tensor]) -> torch.Tensor:
    if node == "plus":
        from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus

        slots = {f"image{i + 1}": image for i, image in enumerate(images)}
        out = TextEncodeQwenImageEditPlus.execute(clip, caption, vae=None, **slots)
    else:
        from comfy_extras.nodes_qwen import TextEncodeQwenImageEdit

        out = TextEncodeQwenImageEdit.execute(clip, caption, vae=None, image=images[0])
    (conditioning,) = out.args
    assert "reference_latents" not in conditioning[0][1]  # no VAE: the cache encodes those itself
    return conditioning[0][0][0]


def test_the_cached_caption_is_text_encode_qwen_image_edit_plus_of_its_references(edit_base, vl_clip):
    root, result = edit_base
    assert result.report.encoded == {"latent": 2, "text": 2}
    assert any("TextEncodeQwenImageEditPlus" in note for note in result.report.notes)
    conds = _cached_conds(result)
    refs = {"a": ["a.png"], "b": ["b.png", "b_1.png"]}
    for stem, names in refs.items():
        expected = _node_cond("plus", vl_clip, CAPTIONS[stem], [_load_image(root, n) for n in names])
        assert torch.equal(conds[stem], expected.float()), stem
    text_only = vl_clip.encode_from_tokens(vl_clip.tokenize(CAPTIONS["a"]))[0]
    assert conds["a"].shape[0] > text_only.shape[1] + 100  # the image's tokens are in the prompt
    assert result.text_dim == 32


def test_the_edit_style_is_text_encode_qwen_image_edit(edit_base, encoders, vl_clip):
    """One reference through the first Qwen-Image-Edit's node: no "Picture 1:", a 1024 x 1024 pixel budget."""
    from pipetrainer.training.cache.encoders import ComfyEncoders

    vae, _ = encoders
    root = edit_base[0]
    path = root / "control" / "a.png"
    got = ComfyEncoders(vae, vl_clip).encode_text_with_references(
        CAPTIONS["a"], [reference_prompt.load_reference(str(path))], EDIT)
    image = _load_image(root, "a.png")
    assert torch.equal(got["cond"], _node_cond("edit", vl_clip, CAPTIONS["a"], [image]).float())
    assert got["cond"].shape != _node_cond("plus", vl_clip, CAPTIONS["a"], [image]).shape  # the two styles differ


def test_a_changed_reference_reencodes_that_items_text_and_latent_only(edit_data, encoders, vl_clip):
    vae, _ = encoders
    assert _cache(edit_data, vae, vl_clip).report.encoded == {}  # the copy: same bytes, its own file paths recorded
    _image(edit_data / "control" / "b_1.png", 64, 40, seed=99)
    result = _cache(edit_data, vae, vl_clip)
    assert result.report.encoded == {"latent": 1, "text": 1}
    assert result.report.reused == {"latent": 1, "text": 1}
    assert sorted(result.report.reencoded) == ["b.png latent: reference images changed (reference 1)",
                                               "b.png text: reference images changed (reference 1)"]
    images = [_load_image(edit_data, n) for n in ("b.png", "b_1.png")]
    expected = _node_cond("plus", vl_clip, CAPTIONS["b"], images)
    assert torch.equal(_cached_conds(result)["b"], expected.float())


def test_off_and_text_only_encoders_keep_the_keys_of_captions_encoded_alone(edit_data, encoders, vl_clip):
    """The oracle keys: the same captions cached from the dataset without its control folder (no references)."""
    vae, clip_l = encoders
    for clip, mode in ((vl_clip, "off"), (clip_l, "auto")):
        plain = {Path(i.source).name: i.text_key for i in _cache(edit_data, vae, clip, control=False).items}
        result = _cache(edit_data, vae, clip, mode)
        assert {Path(i.source).name: i.text_key for i in result.items} == plain, (mode, type(clip.cond_stage_model))
        assert result.report.encoded["text"] == 0  # found under the keys of the captions alone
    # back on: the entries encoded with the references are found again, nothing is encoded
    assert _cache(edit_data, vae, vl_clip, "edit_plus").report.encoded["text"] == 0


def test_a_re_encode_names_the_reference_in_prompt_change():
    from pipetrainer.training.cache.keys import change_reason, text_components

    alone = text_components("make it red", {"weights": "w"}, "bf16")
    plus = text_components("make it red", {"weights": "w"}, "bf16", EDIT_PLUS.identity(), ("d0",))
    edit = text_components("make it red", {"weights": "w"}, "bf16", EDIT.identity(), ("d1",))
    assert change_reason(alone, plus) == ("reference images changed (0 -> 1 references); "
                                          "reference-in-prompt changed (off -> edit_plus)")
    assert change_reason(plus, edit) == ("reference images changed (reference 0); reference-in-prompt changed "
                                         "(node changed, style edit_plus -> edit)")


def test_auto_picks_the_plus_node_only_for_an_image_reading_encoder_with_references(encoders, vl_clip):
    _, clip_l = encoders
    with_refs, without = [("a.png", 1), ("b.png", 2)], [("a.png", 0)]
    assert reference_prompt.choose("auto", vl_clip, with_refs) == (EDIT_PLUS, [])
    assert reference_prompt.choose("auto", vl_clip, without) == (None, [])
    assert reference_prompt.choose("auto", clip_l, with_refs) == (None, [])
    assert reference_prompt.choose("off", vl_clip, with_refs) == (None, [])
    assert reference_prompt.choose("edit", vl_clip, [("a.png", 1)]) == (EDIT, [])
    _, problems = reference_prompt.choose("edit", vl_clip, with_refs)
    assert "at most 1" in problems[0] and "b.png (2)" in problems[0] and "edit_plus" in problems[0]
    _, problems = reference_prompt.choose("edit_plus", clip_l, with_refs)
    assert "takes no images" in problems[0] and "TextEncodeQwenImageEditPlus" in problems[0]
    _, problems = reference_prompt.choose("edit_plus", vl_clip, without)
    assert "control_folder" in problems[0]
    assert reference_prompt.choose("sideways", vl_clip, with_refs)[1]


def test_the_cache_node_encodes_with_references_by_default_and_refuses_a_mismatch(edit_base, encoders, vl_clip):
    from pipetrainer.nodes.cache import PipeTrainerCache

    vae, clip_l = encoders
    schema = PipeTrainerCache.define_schema()
    option = next(i for i in schema.inputs if i.id == "reference_in_prompt")
    assert option.options == ["auto", "off", "minimax_h3_references", "edit_plus", "edit"] and option.default == "auto"
    root, base = edit_base
    with pytest.raises(ValueError, match="takes no images"):
        PipeTrainerCache.execute(_dataset(root), vae, clip_l, reference_in_prompt="edit_plus")
    # the node's default (auto) caches what reference_in_prompt edit_plus cached: the same text keys
    result = PipeTrainerCache.execute(_dataset(root), vae, vl_clip, text_dtype="fp32").result[0]
    assert sorted(i.text_key for i in result.items) == sorted(i.text_key for i in base.items)


def test_caption_dropout_of_an_edit_item_is_the_empty_prompt_with_its_references(edit_data, encoders, vl_clip):
    """An edit model never sees its prompt without the images: the dropped caption of each item is ComfyUI's
    TextEncodeQwenImageEditPlus of "" with that item's references (what its negative prompt is)."""
    from pipetrainer.training.data.captions import CaptionOptions

    vae, _ = encoders
    dataset = scan_dataset(edit_data / "data", 64, control_folder=edit_data / "control",
                           captions=CaptionOptions(dropout=0.5))
    style, problems = reference_prompt.choose("auto", vl_clip, _refs(dataset))
    assert problems == []
    result = build_cache(dataset, vae, vl_clip, edit_data / "cache", reference_prompt=style)
    assert result.report.encoded == {"text": 2}  # the two empty prompts: latents and captions reused
    empties = {Path(i.source).stem: i.empty_text_key for i in result.items}
    assert len(set(empties.values())) == 2
    tensors = read_entries(result.items[0].text_file, list(empties.values()))
    refs = {"a": ["a.png"], "b": ["b.png", "b_1.png"]}
    for stem, names in refs.items():
        expected = _node_cond("plus", vl_clip, "", [_load_image(edit_data, n) for n in names])
        assert torch.equal(tensors[empties[stem]]["cond"], expected.float()), stem
