"""Control / reference datasets (edit models): pairing by file name, encoding with the same VAE into the
item's latent entry, per-item invalidation, the data pipeline and preflight.

Oracles are independent of the cache code: ComfyUI's own ``VAE.encode`` of the reference's pixels (read
with Pillow at the bucket size, so no resize is involved) and the model's own ``process_latent_in``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from pipetrainer.tests.helpers import BatchCapture
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import DatasetError, pair_references, scan_dataset
from pipetrainer.training.data.micro_batches import MicroBatches, bucket_groups, load_examples
from pipetrainer.training.pipelines.base import ExtraSpec, adapter_for, reference_extra
from pipetrainer.training.spec.options import TimestepSpec


# ---- pairing (pure) ---------------------------------------------------------------------------
def _touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith(".txt"):
            (folder / name).write_text("a caption", encoding="utf-8")
        else:
            Image.new("RGB", (8, 8), (len(name) * 20 % 255, 0, 0)).save(folder / name)
    return folder


def test_references_pair_by_stem_in_index_order_with_any_image_extension(tmp_path):
    refs, problems = pair_references(["a.png", "b.jpg", "c_1.png"],
                                     ["a_2.jpg", "a.png", "a_1.webp", "b.webp", "c_1.png", "notes.txt"], tmp_path)
    assert problems == []
    assert {k: [Path(p).name for p in v] for k, v in refs.items()} == {
        "a.png": ["a.png", "a_1.webp", "a_2.jpg"], "b.jpg": ["b.webp"], "c_1.png": ["c_1.png"]}


def test_an_exact_stem_is_reference_zero_of_that_image_not_reference_one_of_another(tmp_path):
    refs, problems = pair_references(["cat.png", "cat_1.png"], ["cat.png", "cat_1.png"], tmp_path)
    assert problems == []
    assert {k: [Path(p).name for p in v] for k, v in refs.items()} == {"cat.png": ["cat.png"],
                                                                         "cat_1.png": ["cat_1.png"]}


def test_every_pairing_problem_names_its_files(tmp_path):
    _, problems = pair_references(
        ["a.png", "b.png", "d.png", "e.png"],
        ["a.png", "a_2.png", "d_1.png", "e.png", "e.jpg", "zz.png", "b_01.png"], tmp_path / "ctl")
    text = "\n".join(problems)
    assert len(problems) == 4
    assert "several files" in problems[0] and "e.jpg and e.png" in problems[0]
    assert "1 training image(s) have no reference image" in problems[1] and "b.png (needs b.png" in problems[1]
    assert "a.png has a_2.png but no a_1.*" in problems[2] and "d.png has d_1.png but no d.*" in problems[2]
    assert "2 file(s)" in problems[3] and "b_01.png, zz.png" in problems[3]  # no leading zeros: b_01 is not b_1
    assert str(tmp_path / "ctl") in text


def test_audio_files_pair_as_reference_audio_numbered_on_their_own(tmp_path):
    """MiniMax-H3's ref_audios: an item with audio needs no picture, an item with neither is named, and gaps and
    unpaired audio files are named like the pictures'."""
    data = _touch(tmp_path / "data", "a.png", "a.txt", "b.png", "b.txt", "c.png", "c.txt", "d.png", "d.txt")
    control = _touch(tmp_path / "ctl", "a.png")
    for name in ("a.wav", "a_1.flac", "b.mp3", "d_1.wav", "zz.ogg"):
        (control / name).write_bytes(b"")  # pairing reads names only
    with pytest.raises(DatasetError) as err:
        scan_dataset(data, 64, control_folder=control)
    problems = str(err.value).splitlines()
    assert len(problems) == 3, problems
    assert "have no reference image" in problems[0] and "c.png (needs c.png" in problems[0]
    assert "d.png (needs" not in problems[0]  # d claims reference audio d_1.wav, so the gap is what is named
    assert "d.png has d_1.wav but no d.*" in problems[1]
    assert "zz.ogg" in problems[2] and "pair with no training image" in problems[2]
    for name in ("d_1.wav", "zz.ogg"):
        (control / name).unlink()
    (control / "c.png").write_bytes((control / "a.png").read_bytes())
    (data / "d.png").unlink()
    spec = scan_dataset(data, 64, control_folder=control)
    assert {Path(e.path).name: [Path(r).name for r in e.references] for e in spec.entries} == {
        "a.png": ["a.png", "a.wav", "a_1.flac"], "b.png": ["b.mp3"], "c.png": ["c.png"]}
    assert "2 reference images and 3 reference audio files in" in spec.report()


def test_scan_dataset_attaches_references_and_refuses_bad_control_folders(tmp_path):
    data = _touch(tmp_path / "data", "x.png", "x.txt", "y.png", "y.txt", "nocap.png")
    control = _touch(tmp_path / "ctl", "x.png", "x_1.png", "y.png", "nocap.png")
    spec = scan_dataset(data, 64, missing_caption="skip", control_folder=control)
    assert [[Path(r).name for r in e.references] for e in spec.entries] == [["x.png", "x_1.png"], ["y.png"]]
    assert "3 reference images in" in spec.report() and "1 to 2 per item" in spec.report()
    # nocap.png was skipped for its caption: its reference is neither required nor unpaired
    (control / "y.png").unlink()
    with pytest.raises(DatasetError, match=r"no reference image .*y\.png"):
        scan_dataset(data, 64, missing_caption="skip", control_folder=control)
    with pytest.raises(DatasetError, match="does not exist"):
        scan_dataset(data, 64, missing_caption="skip", control_folder=tmp_path / "nope")
    with pytest.raises(DatasetError, match="is the dataset folder"):
        scan_dataset(data, 64, missing_caption="skip", control_folder=data)
    assert scan_dataset(data, 64, missing_caption="skip").entries[0].references == ()


def test_dataset_node_takes_a_control_folder_and_reruns_when_a_reference_changes(comfy_root, tmp_path):
    from pipetrainer.nodes.dataset import PipeTrainerDataset

    data = _touch(tmp_path / "data", "x.png", "x.txt")
    control = _touch(tmp_path / "ctl", "x.png")
    out = PipeTrainerDataset.execute(str(data), 64, 1, "error", control_folder=str(control))
    assert [Path(r).name for r in out.result[0].entries[0].references] == ["x.png"]
    before = PipeTrainerDataset.fingerprint_inputs(str(data), control_folder=str(control))
    _touch(control, "x_1.png")
    assert PipeTrainerDataset.fingerprint_inputs(str(data), control_folder=str(control)) != before
    (control / "x_1.png").rename(control / "stray.png")
    with pytest.raises(ValueError, match=r"stray\.png"):
        PipeTrainerDataset.execute(str(data), 64, 1, "error", control_folder=str(control))


# ---- caching with the real VAE ----------------------------------------------------------------
def _reference_images(control: Path, data: Path) -> None:
    """A 4-pair edit dataset: each demo image's reference is its mirror image (64x64, the bucket size,
    so the oracle needs no resize); demo_02 has a second reference of another shape (96x64)."""
    control.mkdir(parents=True, exist_ok=True)
    for src in sorted(data.glob("*.png")):
        with Image.open(src) as img:
            ImageOps.mirror(img.convert("RGB")).save(control / src.name)
    with Image.open(data / "demo_02.png") as img:
        ImageOps.flip(img.convert("RGB")).resize((96, 64)).save(control / "demo_02_1.png")


@pytest.fixture(scope="module")
def edit_base(encoders, fixture_paths, tmp_path_factory):
    root = tmp_path_factory.mktemp("edit_base")
    shutil.copytree(fixture_paths.dataset, root / "data")
    _reference_images(root / "control", root / "data")
    vae, clip = encoders
    result = build_cache(scan_dataset(root / "data", 64, control_folder=root / "control"), vae, clip, root / "cache")
    assert result.report.encoded == {"latent": 4, "text": 4}
    return root


@pytest.fixture
def edit_work(edit_base, tmp_path):
    for part in ("data", "control", "cache"):
        shutil.copytree(edit_base / part, tmp_path / part)
    return tmp_path


def _cache(root: Path, encoders):
    vae, clip = encoders
    return build_cache(scan_dataset(root / "data", 64, control_folder=root / "control"), vae, clip, root / "cache")


def _vae_oracle(vae, path: Path) -> torch.Tensor:
    """ComfyUI's VAE.encode of the file's pixels as Pillow reads them: ``[C, h, w]``."""
    with Image.open(path) as img:
        pixels = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0)[None]
    return vae.encode(pixels).float()[0]


def test_cache_encodes_references_with_the_vae_into_the_items_latent_entry(edit_work, encoders):
    vae, _ = encoders
    result = _cache(edit_work, encoders)
    assert result.report.encoded == {}  # the copied folders: same bytes, nothing encoded again
    examples = {Path(i.source).name: e for i, e in zip(result.items, load_examples(result.items), strict=True)}
    for name, example in examples.items():
        expected = _vae_oracle(vae, edit_work / "control" / name)
        assert example.extras[reference_extra(0)].shape == example.latent.shape == (16, 8, 8)
        torch.testing.assert_close(example.extras[reference_extra(0)], expected, rtol=0, atol=1e-6)
        assert not torch.allclose(example.extras[reference_extra(0)], example.latent)  # the mirror, not the target
    second = examples["demo_02.png"].extras[reference_extra(1)]
    assert second.shape == (16, 8, 8)  # a 96x64 reference, cover-resized into its target's 64x64 bucket
    assert set(examples["demo_00.png"].extras) == {reference_extra(0)}
    assert sorted(result.report.buckets.items()) == [("64x64x1+1ref", 3), ("64x64x1+2ref", 1)]


def test_a_changed_reference_reencodes_only_its_item(edit_work, encoders):
    vae, _ = encoders
    _cache(edit_work, encoders)
    with Image.open(edit_work / "data" / "demo_03.png") as img:
        ImageOps.invert(img.convert("RGB")).save(edit_work / "control" / "demo_01.png")
    r = _cache(edit_work, encoders)
    assert r.report.encoded == {"latent": 1} and r.report.reused == {"latent": 3, "text": 4}
    assert r.report.reencoded == ["demo_01.png latent: reference images changed (reference 0)"]
    item = next(i for i in r.items if Path(i.source).name == "demo_01.png")
    got = load_examples([item])[0].extras[reference_extra(0)]
    torch.testing.assert_close(got, _vae_oracle(vae, edit_work / "control" / "demo_01.png"), rtol=0, atol=1e-6)
    # a reference added to one item re-encodes that item only, and names the count
    shutil.copy(edit_work / "control" / "demo_00.png", edit_work / "control" / "demo_03_1.png")
    r = _cache(edit_work, encoders)
    assert r.report.reencoded == ["demo_03.png latent: reference images changed (1 -> 2 references)"]


def test_an_unreadable_reference_skips_its_item_naming_the_reference(edit_work, encoders):
    (edit_work / "control" / "demo_00.png").write_bytes(b"not a png")
    r = _cache(edit_work, encoders)
    assert len(r.items) == 3
    assert len(r.report.skipped) == 1 and r.report.skipped[0].startswith("demo_00.png: cannot read its reference "
                                                                         "demo_00.png")


# ---- the data pipeline -------------------------------------------------------------------------
class _Capture(BatchCapture):
    """The real SD3 adapter, declaring one required reference and keeping the batches it is handed."""

    def extras(self, diffusion_model):
        return {reference_extra(0): ExtraSpec(("C", "H", "W"), is_latent=True)}


def test_the_adapter_gets_processed_references_of_its_own_items(edit_base, encoders, fixture_paths):
    import comfy.sd

    vae, _ = encoders
    model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model
    adapter = adapter_for("SD3")
    capture = _Capture(adapter)
    result = _cache(edit_base, encoders)
    examples = load_examples(result.items)
    groups = bucket_groups(examples)
    names = [[Path(result.items[i].source).name for i in g] for g in groups]
    assert sorted(names) == [["demo_00.png", "demo_01.png", "demo_03.png"], ["demo_02.png"]]  # 1 vs 2 references
    batches = MicroBatches(examples, 2, 7, model, capture, TimestepSpec(), torch.device("cpu"),
                           family_options=adapter.options_type())
    seen = set()
    for micro in range(6):
        batches.build(micro)
        batch = capture.batches[-1]
        for row, index in enumerate(batches._indices(micro)):
            name = Path(result.items[index].source).name
            raw = _vae_oracle(vae, edit_base / "control" / name)
            expected = model.process_latent_in(raw[None])[0]
            torch.testing.assert_close(batch.extras[reference_extra(0)][row].float(), expected, rtol=0, atol=1e-5)
            clean = model.process_latent_in(examples[index].latent[None])[0]
            torch.testing.assert_close(batch.clean[row].float(), clean, rtol=0, atol=1e-5)
            seen.add(name)
    assert seen == {"demo_00.png", "demo_01.png", "demo_02.png", "demo_03.png"}


# ---- preflight ---------------------------------------------------------------------------------
def test_preflight_checks_a_cache_against_the_required_references(edit_base, demo_cache, encoders):
    from pipetrainer.nodes.checks.preflight import read_cached_shapes
    from pipetrainer.training.pipelines.checks import extra_problems

    one = {reference_extra(0): ExtraSpec(("C", "H", "W"), is_latent=True, description="a reference image")}
    plain = read_cached_shapes(demo_cache.items)
    [missing] = extra_problems(plain, one, "Kontext")
    assert "('reference_0')" in missing and "demo_00.png, demo_01.png, demo_02.png, demo_03.png" in missing
    assert "control folder" in missing

    edit = read_cached_shapes(_cache(edit_base, encoders).items)
    [unused] = extra_problems(edit, one, "Kontext")
    assert "'reference_1' (name_1.png) for demo_02.png" in unused and "takes only reference_0" in unused
    two = {**one, reference_extra(1): ExtraSpec(("C", "H", "W"), required=False, is_latent=True)}
    assert extra_problems(edit, two, "Qwen-Image-Edit") == []
    wrong = {reference_extra(0): ExtraSpec(("C", 16, 16), is_latent=True), reference_extra(1): two["reference_1"]}
    [shape] = extra_problems(edit, wrong, "Kontext")
    assert "demo_00.png [16, 8, 8] (expected [16, 16, 16])" in shape
    [none] = extra_problems(edit, {}, "SD3")
    assert "takes no reference images" in none and "'reference_0' (name.png) for demo_00.png, demo_01.png" in none


# ---- end to end through the server (slow tier) ------------------------------------------------
def _edit_prompt(flux_file: str, data: str, control: str, held_out: str, lora_name: str) -> dict:
    """Train a Kontext-style edit LoRA on Flux-min from a 4-pair dataset, then sample an edit of a
    held-out control image (stock ReferenceLatent) with the trained MODEL and with the base MODEL."""
    def sample(node: str, model: list, prefix: str) -> dict:
        return {node: {"class_type": "KSampler", "inputs": {
                    "model": model, "positive": ["13", 0], "negative": ["10", 0], "latent_image": ["11", 0],
                    "seed": 42, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                    "denoise": 1.0}},
                f"{node}d": {"class_type": "VAEDecode", "inputs": {"samples": [node, 0], "vae": ["3", 0]}},
                f"{node}s": {"class_type": "SaveImage", "inputs": {"images": [f"{node}d", 0],
                                                                   "filename_prefix": prefix}}}

    return {
        "1": {"class_type": "PipeTrainerLoadDiffusionModel", "inputs": {"unet_name": flux_file,
                                                                       "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "pipetrainer-tiny-clip-l.safetensors",
                                                     "type": "stable_diffusion"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": "pipetrainer-tiny-taesd16.safetensors"}},
        "4": {"class_type": "PipeTrainerDataset", "inputs": {"folder": data, "resolution": 64, "repeats": 1,
                                                             "missing_caption": "error", "control_folder": control}},
        "5": {"class_type": "PipeTrainerCache", "inputs": {"dataset": ["4", 0], "vae": ["3", 0], "clip": ["2", 0]}},
        "6": {"class_type": "PipeTrainerLoRA", "inputs": {"rank": 4, "alpha": 4.0, "dropout": 0.0,
                                                          "targets": "attention"}},
        "7": {"class_type": "PipeTrainerOptimizer", "inputs": {"optimizer": "AdamW", "learning_rate": 0.01,
                                                               "weight_decay": 0.0, "warmup_steps": 0,
                                                               "schedule": "constant"}},
        "8": {"class_type": "PipeTrainerTrain", "inputs": {
            "model": ["1", 0], "cache": ["5", 0], "lora": ["6", 0], "optimizer": ["7", 0], "lora_name": lora_name,
            "steps": 3, "batch_size": 1, "gradient_accumulation": 1, "seed": 0, "save_every": 0,
            "training_dtype": "fp32", "gradient_checkpointing": True, "pipeline_stages": 1,
            "partition_method": "parameters", "resume": False}},
        "9": {"class_type": "CLIPTextEncode", "inputs": {"text": "mirror it", "clip": ["2", 0]}},
        "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}},
        "11": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "12": {"class_type": "LoadImage", "inputs": {"image": held_out}},
        "12e": {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["3", 0]}},
        "13": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["9", 0], "latent": ["12e", 0]}},
        "20": {"class_type": "PreviewAny", "inputs": {"source": ["5", 1]}},
        **sample("30", ["8", 0], lora_name + "_trained"),
        **sample("31", ["1", 0], lora_name + "_base"),
    }


def _cache_only(prompt: dict) -> dict:
    return {k: prompt[k] for k in ("2", "3", "4", "5", "20")}


@pytest.mark.slow
def test_edit_training_end_to_end_through_the_server(server, comfy_root, flux_path, fixture_paths, request):
    import uuid

    from pipetrainer.devkit.host import history_error

    name = f"edit_{uuid.uuid4().hex[:6]}"
    inputs = comfy_root / "input"

    def remove_inputs() -> None:
        for part in ("data", "ctl"):
            shutil.rmtree(inputs / f"{name}_{part}", ignore_errors=True)
        (inputs / f"{name}_held_out.png").unlink(missing_ok=True)

    request.addfinalizer(remove_inputs)
    shutil.copytree(fixture_paths.dataset, inputs / f"{name}_data")
    _reference_images(inputs / f"{name}_ctl", inputs / f"{name}_data")
    (inputs / f"{name}_ctl" / "demo_02_1.png").unlink()  # one reference each: Flux-min batches are size 1 anyway
    with Image.open(inputs / f"{name}_data" / "demo_03.png") as img:
        ImageOps.flip(img.convert("RGB")).save(inputs / f"{name}_held_out.png")
    prompt = _edit_prompt(flux_path.name, f"{name}_data", f"{name}_ctl", f"{name}_held_out.png", name)

    entry = server.wait(server.queue(prompt), timeout=900)
    assert history_error(entry) is None, server.log_tail()
    [report] = entry["outputs"]["20"]["text"]
    assert "64x64x1+1ref (4)" in report and "skipped 0 files" in report  # encoded now or by an earlier run
    trained, base = (comfy_root / "output" / entry["outputs"][n]["images"][0]["filename"] for n in ("30s", "31s"))
    diff = np.abs(np.asarray(Image.open(trained), np.int16) - np.asarray(Image.open(base), np.int16))
    assert diff.max() > 0, "the edit LoRA changes the edit of a held-out control image"

    with Image.open(inputs / f"{name}_data" / "demo_00.png") as img:
        changed = ImageOps.invert(img.convert("RGB"))
    changed.putpixel((0, 0), tuple(name.encode()[-3:]))  # bytes no earlier run has cached
    changed.save(inputs / f"{name}_ctl" / "demo_01.png")
    again = server.wait(server.queue(_cache_only(prompt)), timeout=300)
    assert history_error(again) is None, server.log_tail()
    [report] = again["outputs"]["20"]["text"]
    assert "re-encoded 1 latents, 0 texts" in report and "reused 3 latents, 4 texts" in report
    assert "demo_01.png latent: reference images changed (reference 0)" in report
