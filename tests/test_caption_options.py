"""Caption dropout and tag shuffle (training/data/captions.py): what is cached, and what each micro-batch trains on.

Oracles: ComfyUI's own ``CLIPTextEncode`` for the empty caption (what a model sees for an empty prompt)
and for every cached variant's text; the key formula of keys.py for "options off keeps the old keys";
a micro-batch built without the options for "the noise stream is untouched".
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from pipetrainer.tests.helpers import BatchCapture
from pipetrainer.training.data.captions import CaptionOptions, shuffle_tags, split_tags
from pipetrainer.training.data.dataset import DatasetError, scan_dataset
from pipetrainer.training.data.micro_batches import Example, MicroBatches, TextChoice
from pipetrainer.training.spec.options import CacheItem, TimestepSpec
from pipetrainer.training.spec.run_spec import RunSpec

CAPTIONS = {
    "a": "ohwx, red hair, smiling, outdoors, blue sky, looking at viewer, short sleeves, tree",
    "b": "ohwx, black hair, indoors, sitting, chair, book, window, lamp",
    "c": "ohwx, portrait",
}


@pytest.fixture
def tag_data(tmp_path) -> Path:
    """Three images with tag-list captions (one with too few tags to shuffle)."""
    data = tmp_path / "data"
    data.mkdir()
    for i, (name, caption) in enumerate(CAPTIONS.items()):
        Image.new("RGB", (32, 32), (60 * i, 100, 180)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(caption, encoding="utf-8")
    return data


# ---- tag shuffle (pure) ------------------------------------------------------------------------
def test_shuffled_variants_keep_the_first_tags_and_permute_the_rest():
    caption = CAPTIONS["a"]
    tags = split_tags(caption)
    for keep in (1, 2):
        variants = CaptionOptions(shuffle_variants=8, keep_tags=keep).variants(caption)
        assert len(variants) == 8  # 7! orders: eight distinct draws
        for text in variants:
            shuffled = split_tags(text)
            assert shuffled[:keep] == tags[:keep], f"keep_tags={keep} moved a leading tag: {text}"
            assert sorted(shuffled) == sorted(tags)  # a permutation: no tag lost, none invented
        assert len({tuple(split_tags(v)[keep:]) for v in variants}) == 8
    assert CaptionOptions(shuffle_variants=8, keep_tags=1).variants(caption) == \
        CaptionOptions(shuffle_variants=8, keep_tags=1).variants(caption)  # a pure function: keys repeat
    everything = CaptionOptions(shuffle_variants=8, keep_tags=0).variants(caption)
    assert any(split_tags(v)[0] != "ohwx" for v in everything)  # keep 0 moves the first tag too
    assert CaptionOptions().variants(caption) == (caption,)  # off: the caption as written
    assert CaptionOptions(shuffle_variants=5, keep_tags=1).variants("ohwx, portrait") == ("ohwx, portrait",)
    assert shuffle_tags("a | b | c", 0, 3, "|") == "a| b| c"


def test_caption_option_problems_are_reported_together(tmp_path):
    from pipetrainer.training.data.dataset import BucketSettings

    with pytest.raises(DatasetError) as err:
        scan_dataset(tmp_path, 32, buckets=BucketSettings(resolutions=(8,)),
                     captions=CaptionOptions(dropout=1.5, shuffle_variants=-1, keep_tags=-2, separator=""))
    text = str(err.value)
    for part in ("caption_dropout", "shuffle_tags", "keep_tags", "smaller than the bucket multiple"):
        assert part in text
    assert CaptionOptions(shuffle_variants=2, separator=" ").problems() == [
        "tag_separator is empty: give the character between tags (usually ',')."]


def test_the_dataset_node_passes_the_options_and_reports_them(tag_data, comfy_root):
    from pipetrainer.nodes.dataset import PipeTrainerDataset

    out = PipeTrainerDataset.execute(str(tag_data), 64, 1, "error", caption_dropout=0.1, shuffle_tags=4, keep_tags=2,
                                     tag_separator=",")
    dataset, report = out.result
    assert dataset.captions == CaptionOptions(dropout=0.1, shuffle_variants=4, keep_tags=2, separator=",")
    assert "caption dropout 0.1" in report and "4 tag-shuffled variants" in report and "first 2 tag(s)" in report
    with pytest.raises(ValueError, match="tag_separator is empty"):
        PipeTrainerDataset.execute(str(tag_data), 64, 1, "error", shuffle_tags=2, tag_separator="")


# ---- the choice per micro-batch (pure) ---------------------------------------------------------
def _marked(value: float) -> TextChoice:
    return TextChoice(torch.full((2, 3), value), torch.full((3,), value), {})


def _examples(dropout: float, variants: int = 3) -> list[Example]:
    """Four items; item i's variant k is marked 10·i + k, the empty caption -1."""
    out = []
    for i in range(4):
        texts = tuple(_marked(10 * i + k) for k in range(variants))
        out.append(Example(torch.zeros(4, 2, 2), texts[0].cond, texts[0].pooled, {}, (), texts if variants > 1 else (),
                           _marked(-1.0) if dropout > 0 else None, dropout))
    return out


def _choices(batches: MicroBatches, micro: int) -> list[float]:
    batch = [batches.examples[i] for i in batches._indices(micro)]
    return [float(b.cond[0, 0]) for b in batches.captioned(batch, micro)]


def _batches(examples, seed=5, **kw) -> MicroBatches:
    return MicroBatches(examples, 2, seed, None, None, TimestepSpec(), torch.device("cpu"), **kw)


def test_dropout_share_is_near_p_and_the_choice_depends_on_seed_and_micro_index_only():
    p, micros = 0.3, 1500
    batches = _batches(_examples(p))
    drawn = [c for m in range(micros) for c in _choices(batches, m)]
    share = sum(c == -1.0 for c in drawn) / len(drawn)
    assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / len(drawn)), share
    kept = Counter(int(c) % 10 for c in drawn if c != -1.0)
    assert set(kept) == {0, 1, 2} and min(kept.values()) > 0.28 * sum(kept.values())  # variants ~uniform
    again = _batches(_examples(p))
    for m in (1499, 7, 0, 300):  # any order, fresh instance: a stage or a resumed run draws the same
        assert _choices(again, m) == drawn[2 * m:2 * m + 2]
    other = _batches(_examples(p), seed=6)
    assert [_choices(other, m) for m in range(50)] != [drawn[2 * m:2 * m + 2] for m in range(50)]
    for replica in (0, 1):  # two replicas: replica r's micro m is the global micro 2m + r
        split = _batches(_examples(p), replica=replica, replicas=2)
        whole_seq = _batches(_examples(p))
        for m in range(20):
            got = [float(b.cond[0, 0]) for b in split.captioned([split.examples[0], split.examples[1]], m)]
            want = [float(b.cond[0, 0]) for b in whole_seq.captioned([split.examples[0], split.examples[1]],
                                                                         2 * m + replica)]
            assert got == want


def test_dropout_zero_and_one_and_the_last_stage():
    never = _batches(_examples(0.0))
    assert all(c != -1.0 for m in range(300) for c in _choices(never, m))
    always = _batches(_examples(1.0))
    assert all(c == -1.0 for m in range(300) for c in _choices(always, m))
    last = [dataclasses.replace(e, cond=None, pooled=None) for e in _examples(1.0)]  # a last stage reads no text
    batch = [last[0], last[1]]
    assert _batches(last).captioned(batch, 3) == batch


# ---- the spec carries the options --------------------------------------------------------------
def test_items_carry_validated_caption_options_through_json(tmp_path):
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec

    def spec(*items):
        return RunSpec(ModelRecipe("diffusion_model", str(tmp_path / "m.safetensors")), tuple(items), LoraSpec(),
                       OptimizerSpec(), TrainSpec(), str(tmp_path), str(tmp_path / "l.safetensors"), str(tmp_path))

    plain = CacheItem("/i", "/i", "/a.png", "a", latent_key="L", text_key="T0")
    shuffled = dataclasses.replace(plain, text_variants=("T0", "T1"), empty_text_key="E", caption_dropout=0.1)
    back = RunSpec.from_json(spec(shuffled).to_json())
    assert back.items == (shuffled,) and hash(back.items[0])  # lists from JSON become tuples again
    assert spec(shuffled).problems() == []
    problems = spec(dataclasses.replace(shuffled, caption_dropout=1.5),
                    dataclasses.replace(plain, caption_dropout=0.2)).problems()
    assert any("caption_dropout is a probability in [0, 1] (got 1.5)" in p for p in problems)
    assert any("needs the empty caption's cached embedding" in p for p in problems)
    assert spec(plain).training_hash() != spec(dataclasses.replace(plain, caption_dropout=0.1,
                                                                  empty_text_key="E")).training_hash()
    assert spec(plain).training_hash() != spec(dataclasses.replace(plain, text_variants=("T0", "T1"))).training_hash()
    old = json.loads(spec(plain).to_json())  # a spec written before the options existed
    for item in old["items"]:
        for name in ("text_variants", "empty_text_key", "caption_dropout"):
            item.pop(name)
    assert RunSpec.from_dict(old).training_hash() == spec(plain).training_hash()


# ---- the cache and the micro-batches, with ComfyUI's encoders ----------------------------------
# A real pair: the tiny Wan 2.1 (ComfyUI-detected, text width 4096) and a tiny UMT5-shaped ComfyUI
# CLIP (the test node pack's), with the tiny TAESD; every encode takes milliseconds.
TEST_NODES = Path(__file__).resolve().parent / "custom_nodes" / "pipetrainer_test_nodes" / "__init__.py"


@pytest.fixture(scope="module")
def wan_path(comfy_root, fixture_paths) -> Path:
    from pipetrainer.devkit.fixtures import WAN_T2V_FILE, build_tiny_wan_t2v
    from pipetrainer.tests.family_rows.common import built_fixture

    return built_fixture(WAN_T2V_FILE, build_tiny_wan_t2v)(comfy_root, fixture_paths)


@pytest.fixture(scope="module")
def tiny_wan(wan_path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(wan_path)).model


@pytest.fixture(scope="module")
def umt5_encoders(comfy_root, fixture_paths):
    """ComfyUI's VAE (tiny TAESD) and a tiny UMT5-shaped ComfyUI ``CLIP``."""
    import importlib.util

    import comfy.sd
    import comfy.utils

    spec = importlib.util.spec_from_file_location("_pipetrainer_test_nodes", TEST_NODES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixture_paths.vae))), module.tiny_umt5_clip()



def _built(model, items, micros: int, seed: int = 3):
    from pipetrainer.training.data.micro_batches import load_examples
    from pipetrainer.training.pipelines.base import adapter_for

    adapter = adapter_for("Wan")
    capture = BatchCapture(adapter)
    batches = MicroBatches(load_examples(items), 2, seed, model, capture, TimestepSpec(), torch.device("cpu"),
                           family_options=adapter.options_type())
    built = [batches.build(m) for m in range(micros)]
    return built, capture.batches


def _same_text(row: torch.Tensor, cond: torch.Tensor) -> bool:
    """A micro-batch row is ``cond`` (in the row's dtype) followed by zero tokens up to the batch's length."""
    n = cond.shape[0]
    return torch.equal(row[:n], cond.to(row.dtype)) and not row[n:].any()


def test_caption_dropout_one_trains_on_clip_text_encode_of_the_empty_prompt(tag_data, umt5_encoders, tiny_wan,
                                                                           tmp_path):
    from pipetrainer.training.cache.store import build_cache

    import nodes as comfy_nodes

    vae, clip = umt5_encoders
    (conditioning,) = comfy_nodes.CLIPTextEncode().encode(clip, "")
    empty_cond = conditioning[0][0][0]
    dropped = build_cache(scan_dataset(tag_data, 32, captions=CaptionOptions(dropout=1.0)), vae, clip, tmp_path / "c")
    assert dropped.report.encoded["text"] == 4  # three captions and the empty one, once
    _, batches = _built(tiny_wan, dropped.items, 6)
    assert len(batches) == 6
    for batch in batches:
        for row in batch.cond:
            assert _same_text(row, empty_cond)

    kept = build_cache(scan_dataset(tag_data, 32), vae, clip, tmp_path / "c")  # options off: same cache
    assert sum(kept.report.encoded.values()) == 0 and kept.items[0].empty_text_key == ""
    _, batches = _built(tiny_wan, kept.items, 6)
    own = {name: comfy_nodes.CLIPTextEncode().encode(clip, caption)[0][0][0][0] for name, caption in CAPTIONS.items()}
    seen = set()
    for batch in batches:
        for row in batch.cond:
            assert not _same_text(row, empty_cond)
            match = [n for n, c in own.items() if _same_text(row, c)]
            assert len(match) == 1
            seen.update(match)
    assert seen == set(CAPTIONS)


def _labels_equal(a, b) -> bool:
    """The loss labels: a target, or a tuple of target, weight and item scale (training/objective/loss.py)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return len(a) == len(b) and all(_labels_equal(x, y) for x, y in zip(a, b, strict=True))


def test_caption_choices_leave_the_noise_alone(tag_data, umt5_encoders, tiny_wan, tmp_path):
    """Dropout and the variant draw come from a generator of their own: with the options on, every
    micro-batch's noise, sigma and target are those of the run without them."""
    from pipetrainer.training.cache.store import build_cache

    vae, clip = umt5_encoders
    off = build_cache(scan_dataset(tag_data, 32), vae, clip, tmp_path / "c")
    on = build_cache(scan_dataset(tag_data, 32, captions=CaptionOptions(dropout=0.5, shuffle_variants=3)),
                     vae, clip, tmp_path / "c")
    plain, plain_batches = _built(tiny_wan, off.items, 8)
    varied, varied_batches = _built(tiny_wan, on.items, 8)
    for (_, target_a), (_, target_b), a, b in zip(plain, varied, plain_batches, varied_batches, strict=True):
        assert _labels_equal(target_a, target_b)
        assert torch.equal(a.noisy, b.noisy) and torch.equal(a.timestep, b.timestep)
    assert any(not torch.equal(a.cond, b.cond) for a, b in zip(plain_batches, varied_batches, strict=True))
    # and the texts trained are the choices of MicroBatches.captioned (its own generator), not other draws
    from pipetrainer.training.data.micro_batches import load_examples, stack_text

    chooser = _batches(load_examples(on.items), seed=3)
    for micro, b in enumerate(varied_batches):
        chosen = chooser.captioned([chooser.examples[i] for i in chooser._indices(micro)], micro)
        assert torch.equal(b.cond, stack_text([c.cond for c in chosen], b.cond.shape[1]).to(b.cond.dtype))


def test_tag_shuffle_caches_each_variant_under_its_own_key_and_reuses_them(tag_data, umt5_encoders, tmp_path):
    from pipetrainer.training.cache.encoders import ComfyEncoders
    from pipetrainer.training.cache.keys import encoder_signature, text_key
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.cache.store import build_cache

    import nodes as comfy_nodes

    vae, clip = umt5_encoders
    options = CaptionOptions(shuffle_variants=3, keep_tags=2)
    sig = encoder_signature(ComfyEncoders(vae, clip).text_identity())
    plain = build_cache(scan_dataset(tag_data, 32), vae, clip, tmp_path / "c")
    for item in plain.items:  # options off: the key formula of every cache before them
        assert item.text_key == text_key(item.caption, sig) and item.text_variants == ()

    shuffled = build_cache(scan_dataset(tag_data, 32, captions=options), vae, clip, tmp_path / "c")
    assert shuffled.report.encoded == Counter({"text": 6})  # 3 variants of a and b; c has one order only
    by_name = {Path(i.source).stem: i for i in shuffled.items}
    for name in ("a", "b"):
        item = by_name[name]
        texts = options.variants(CAPTIONS[name])
        assert item.text_variants == tuple(text_key(t, sig) for t in texts)  # keyed by the shuffled text
        assert item.text_key == item.text_variants[0] and len(set(item.text_variants)) == 3
        assert all(split_tags(t)[:2] == split_tags(CAPTIONS[name])[:2] for t in texts)
        stored = read_entries(item.text_file, set(item.text_variants))
        for key, text in zip(item.text_variants, texts, strict=True):
            (conditioning,) = comfy_nodes.CLIPTextEncode().encode(clip, text)
            assert torch.equal(stored[key]["cond"], conditioning[0][0][0].float())
    assert by_name["c"].text_variants == () and by_name["c"].text_key == text_key("ohwx, portrait", sig)

    again = build_cache(scan_dataset(tag_data, 32, captions=options), vae, clip, tmp_path / "c")
    assert sum(again.report.encoded.values()) == 0 and again.items == shuffled.items
    back = build_cache(scan_dataset(tag_data, 32), vae, clip, tmp_path / "c")
    assert sum(back.report.encoded.values()) == 0 and back.items == plain.items


@pytest.mark.slow
def test_caption_options_train_in_the_process_tree(tag_data, umt5_encoders, wan_path, comfy_root, tmp_path):
    """The options cross the spec file and load on the real ranks (two pipeline stages: the last reads no text)."""
    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.training.cache.store import build_cache

    vae, clip = umt5_encoders
    cache = build_cache(scan_dataset(tag_data, 32, captions=CaptionOptions(dropout=0.5, shuffle_variants=2)),
                        vae, clip, tmp_path / "c")
    spec = make_spec(wan_path, cache.items, tmp_path / "run", comfy_root, steps=3, batch_size=2, pipeline_stages=2,
                     partition_method="uniform")  # by parameters, the 4096-wide text embedding fills stage 0
    assert any(i.text_variants for i in spec.items) and all(i.empty_text_key for i in spec.items)
    rc, events = run_training(spec)
    assert rc == 0, [e for e in events if e["type"] == "error"]
    assert len(losses(events)) == 3 and all(math.isfinite(x) for x in losses(events))
