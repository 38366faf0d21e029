"""Preflight: every bad input a user can give is refused before any process starts, with what to do.

The table below runs each bad input through the real entry point that meets it (the Dataset scan, or
the Train node's ``build_spec`` with the real tiny MMDiT loaded by our loader node, real cache files and
real image/video files) and checks the message names the item and the fix. Nothing here trains.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pipetrainer.training.data.dataset import DatasetError, scan_dataset
from pipetrainer.training.spec.choices import SpecError
from pipetrainer.training.spec.options import CacheItem, LoraSpec, OptimizerSpec, TrainSpec
from pipetrainer.training.spec.run_spec import RunSpec
from safetensors.torch import save_file

GOOD_SETTINGS = dict(steps=10, batch_size=1, gradient_accumulation=1, seed=0,
                     save_every=0, training_dtype="fp32", gradient_checkpointing=True, pipeline_stages=1,
                     partition_method="parameters")


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    """The tiny SD3-family MMDiT as the user gets it: through 'Load Diffusion Model (PipeTrainer)'."""
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


@pytest.fixture(scope="module")
def sd15_model(comfy_root):
    """A real (tiny) ComfyUI model of a class PipeTrainer cannot train."""
    import comfy.model_patcher
    import comfy.supported_models

    unet = {"use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
            "adm_in_channels": None, "in_channels": 4, "out_channels": 4, "model_channels": 32,
            "num_res_blocks": [1], "transformer_depth": [1], "channel_mult": [1], "transformer_depth_middle": 1,
            "transformer_depth_output": [1, 1], "use_linear_in_transformer": False, "context_dim": 768,
            "num_heads": 2, "num_head_channels": -1}
    base = comfy.supported_models.SD15(unet).get_model({})
    # a model class ComfyUI added that PipeTrainer does not know (SD 1.x itself, ComfyUI's plain BaseModel,
    # trains): registries match BaseModel exactly, so its subclasses stay unknown
    base.__class__ = type("NewComfyModel", (type(base),), {})
    return comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))


@dataclass
class Setup:
    """One Train node call; each case changes a part of a good one."""

    model: object
    cache: object
    tmp: Path
    demo_image: Path
    lora_name: str = "preflight_test"
    settings: dict = dataclasses.field(default_factory=lambda: dict(GOOD_SETTINGS))

    def build(self) -> RunSpec:
        from pipetrainer.nodes.train import PipeTrainerTrain

        return PipeTrainerTrain.build_spec(self.model, self.cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                           self.lora_name, **self.settings)

    def item(self, name: str, latent=(16, 8, 8), cond=(77, 768), pooled: int | None = 768,
             source: Path | None = None) -> CacheItem:
        """A real cache entry pair written with safetensors, shaped as given."""
        lat, txt = self.tmp / f"{name}.latent.safetensors", self.tmp / f"{name}.text.safetensors"
        save_file({"latent": torch.zeros(latent)}, str(lat))
        text = {"cond": torch.zeros(cond)}
        if pooled:
            text["pooled"] = torch.zeros(pooled)
        save_file(text, str(txt))
        if source is None:
            source = self.tmp / f"{name}.png"
            shutil.copy(self.demo_image, source)
        return CacheItem(str(lat), str(txt), str(source), "a caption")

    def with_items(self, *items: CacheItem, skipped: tuple[str, ...] = ()) -> Setup:
        report = dataclasses.replace(self.cache.report, skipped=list(skipped))
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache, items=tuple(items), report=report))


@pytest.fixture
def setup(tiny_model, demo_cache, fixture_paths, tmp_path) -> Setup:
    demo_image = sorted(Path(fixture_paths.dataset).glob("*.png"))[0]
    return Setup(tiny_model, demo_cache, tmp_path, demo_image)


def _error(call: Callable[[], object], kind: type[Exception] = SpecError) -> str:
    with pytest.raises(kind) as info:
        call()
    return str(info.value)


def _dataset(tmp: Path, files: dict[str, bytes | str]) -> Path:
    folder = tmp / "ds"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def _png(setup: Setup) -> bytes:
    return setup.demo_image.read_bytes()


# ---- the bad-input table: kind -> how it is produced -> the message fragment ------------------
def _empty_folder(s: Setup) -> str:
    return _error(lambda: scan_dataset(_dataset(s.tmp, {}), 64), DatasetError)


def _missing_caption(s: Setup) -> str:
    folder = _dataset(s.tmp, {"a.png": _png(s), "a.txt": "x", "nocap.png": _png(s)})
    return _error(lambda: scan_dataset(folder, 64), DatasetError)


def _empty_caption(s: Setup) -> str:
    folder = _dataset(s.tmp, {"blank.png": _png(s), "blank.txt": "  \n"})
    return _error(lambda: scan_dataset(folder, 64), DatasetError)


def _nothing_cached(s: Setup) -> str:
    return _error(s.with_items().build)


def _corrupt_image(s: Setup) -> str:
    bad = s.tmp / "garbage.png"
    bad.write_bytes(b"this is not a png")
    return _error(s.with_items(s.item("ok"), s.item("garbage", source=bad)).build)


def _truncated_image(s: Setup) -> str:
    cut = s.tmp / "truncated.png"
    data = _png(s)
    cut.write_bytes(data[: len(data) // 2])
    return _error(s.with_items(s.item("truncated", source=cut)).build)


def _corrupt_video(s: Setup) -> str:
    bad = s.tmp / "clip.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x13" * 4000)
    return _error(s.with_items(s.item("clip", latent=(16, 5, 8, 8), source=bad)).build)


def _source_deleted(s: Setup) -> str:
    item = s.item("gone")
    Path(item.source).unlink()
    return _error(s.with_items(item).build)


def _dropped_by_cache(s: Setup) -> str:
    return _error(s.with_items(s.item("kept"), skipped=("tiny.png: smaller than every bucket",)).build)


def _damaged_cache_file(s: Setup) -> str:
    item = s.item("damaged")
    Path(item.latent_file).write_bytes(b"\x07" * 64)
    return _error(s.with_items(item).build)


def _entry_missing_from_index(s: Setup) -> str:
    real = s.cache.items[0]
    return _error(s.with_items(dataclasses.replace(real, latent_key="f" * 64)).build)


def _wrong_vae(s: Setup) -> str:
    return _error(s.with_items(s.item("sd15latent", latent=(4, 8, 8))).build)


def _wrong_text_encoder(s: Setup) -> str:
    return _error(s.with_items(s.item("t5", cond=(77, 1024))).build)


def _no_pooled(s: Setup) -> str:
    return _error(s.with_items(s.item("nopool", pooled=None)).build)


def _not_patch_multiple(s: Setup) -> str:
    return _error(s.with_items(s.item("odd", latent=(16, 9, 9))).build)


def _too_small(s: Setup) -> str:
    return _error(s.with_items(s.item("small", latent=(16, 4, 4))).build)


def _unsupported_family(s: Setup, sd15_model) -> str:
    return _error(dataclasses.replace(s, model=sd15_model).build)


def _model_without_recipe(s: Setup, fixture_paths) -> str:
    """A MODEL built in code (as some custom nodes do): a fresh ModelPatcher records no loader, on any
    ComfyUI (newer ones record how their stock loaders built a MODEL; that one would be accepted)."""
    import comfy.model_patcher
    import comfy.sd

    loaded = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    built = comfy.model_patcher.ModelPatcher(loaded.model, load_device=loaded.load_device,
                                             offload_device=loaded.offload_device)
    return _error(dataclasses.replace(s, model=built).build)


def _model_file_changed(s: Setup, fixture_paths) -> str:
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    copy = fixture_paths.mmdit.with_name(f"preflight-{os.getpid()}-{s.tmp.name}.safetensors")
    shutil.copy(fixture_paths.mmdit, copy)
    try:
        model = PipeTrainerLoadDiffusionModel.execute(copy.name, "default").result[0]
        with open(copy, "r+b") as f:  # re-saved with other weights under the same name
            f.seek(2**16 - 16)  # weight bytes in the first chunk the fingerprint samples (past the header)
            f.write(b"\x01\x02\x03\x04")
        return _error(dataclasses.replace(s, model=model).build)
    finally:
        copy.unlink(missing_ok=True)


def _lora_name(name: str) -> Callable[[Setup], str]:
    return lambda s: _error(dataclasses.replace(s, lora_name=name).build)


def _too_many_stages(s: Setup) -> str:
    return _error(dataclasses.replace(s, settings={**s.settings, "pipeline_stages": 64}).build)


def _too_many_blocks_to_swap(stages: int, blocks: int) -> Callable[[Setup], str]:
    return lambda s: _error(dataclasses.replace(s, settings={**s.settings, "pipeline_stages": stages,
                                                             "partition_method": "uniform",
                                                             "blocks_to_swap": blocks}).build)


def _deepspeed_missing(s: Setup) -> str:
    from pipetrainer.nodes.checks.preflight import deepspeed_problems

    return "\n".join(deepspeed_problems(installed=False, platform="win32"))


def _disk_full(s: Setup) -> str:
    from pipetrainer.nodes.checks.preflight import disk_problems, lora_parameter_count, run_disk_bytes

    train = TrainSpec(steps=1000, save_every=10)
    needed = run_disk_bytes(lora_parameter_count(s.model, LoraSpec(rank=4)), train)
    return "\n".join(disk_problems(str(s.tmp), needed, needed - 1, "checkpoints and LoRA files", ""))


BAD_INPUTS: list[tuple[str, Callable, tuple[str, ...]]] = [
    ("empty dataset folder", _empty_folder, ("has no images or videos", "add them with .txt captions")),
    ("missing caption", _missing_caption, ("nocap.png", "Add a same-name .txt file")),
    ("empty caption", _empty_caption, ("blank.png", "or an empty one")),
    ("nothing reached the cache", _nothing_cached, ("The dataset is empty",)),
    ("corrupt image", _corrupt_image, ("garbage.png: UnidentifiedImageError", "Re-export or remove them")),
    ("truncated image", _truncated_image, ("truncated.png:", "cannot be read")),
    ("corrupt video", _corrupt_video, ("clip.mp4:", "cannot be read")),
    ("dataset file deleted after caching", _source_deleted, ("gone.png: the file is gone",)),
    ("items dropped while caching", _dropped_by_cache, ("tiny.png: smaller than every bucket", "dropped while caching")),
    ("damaged cache file", _damaged_cache_file, ("damaged.latent.safetensors", "Run 'Cache Latents & Text' again")),
    ("cache entry missing from the index", _entry_missing_from_index, ("demo_00.png: its entry is missing from",
                                                                     "Run 'Cache Latents & Text' again")),
    ("VAE of another family", _wrong_vae, ("latents have 4 channels but the SD3 model takes 16", "Use this model's VAE")),
    ("text encoder of another family", _wrong_text_encoder, ("1024 wide but the SD3 model's context input takes 768",)),
    ("pooled vector missing", _no_pooled, ("pooled text vectors are none wide but the SD3 model takes 768",)),
    ("resolution not a patch multiple", _not_patch_multiple, ("9x9 are not multiples of the SD3 model's patch size 2",
                                                              "16 px for an 8x VAE")),
    ("resolution too small", _too_small, ("4x4 are too small", "Raise the resolution")),
    ("unsupported model family", _unsupported_family, ("cannot train NewComfyModel", "Supported model families: Anima, AuraFlow, Chroma, ",
                                                       "QwenImage, SD1/SD2, SD3, SDXL, Wan")),
    ("MODEL not from the train loader", _model_without_recipe, ("was not loaded by 'Load Diffusion Model (PipeTrainer)'",)),
    ("model file changed after loading", _model_file_changed, ("changed on disk after the graph loaded it",
                                                              "queue again")),
    ("LoRA name with a folder", _lora_name("sub/my_lora"), ("must be a plain file name",)),
    ("LoRA name with '..'", _lora_name("..\\evil"), ("must be a plain file name",)),
    ("absolute LoRA path", _lora_name("/tmp/evil"), ("must be a plain file name",)),
    ("reserved LoRA name", _lora_name("con.safetensors"), ("reserved device name",)),
    ("empty LoRA name", _lora_name("  "), ("lora_name is empty",)),
    ("more stages than devices", _too_many_stages, ("64 ranks is more than this machine can run",)),
    ("blocks_to_swap out of range", _too_many_blocks_to_swap(1, 5),
     ("blocks_to_swap 5 is out of range", "the model has 4 swappable block(s)", "Set blocks_to_swap to 4 or less")),
    ("blocks_to_swap out of range for a stage", _too_many_blocks_to_swap(2, 3),
     ("smallest stage has 2 swappable block(s)", "or use fewer pipeline stages")),
    ("DeepSpeed missing (native Windows)", _deepspeed_missing, ("DeepSpeed is not installed", "WSL2", "pip install")),
    ("not enough disk", _disk_full, ("Not enough free disk for checkpoints and LoRA files", "GiB free")),
]


@pytest.mark.parametrize("kind, produce, fragments", BAD_INPUTS, ids=[k for k, _, _ in BAD_INPUTS])
def test_bad_input_is_refused_with_what_to_do(kind, produce, fragments, setup, request):
    extra = {name: request.getfixturevalue(name) for name in produce.__code__.co_varnames[1:produce.__code__.co_argcount]}
    message = produce(setup, **extra)
    for fragment in fragments:
        assert fragment in message, f"{kind}: {fragment!r} not in:\n{message}"


def test_the_train_node_refuses_flow_timesteps_for_sdxl_and_wan_options_that_do_not_fit(setup, comfy_root,
                                                                                       fixture_paths):
    """Through the Train node: shift / sigma bounds of 'Timestep Sampling' on an eps model, and Wan options
    the model or the timesteps leave nothing of (the rules themselves: tests/test_family_rules.py)."""
    from pipetrainer.tests.family_rows.sdxl import sdxl_small
    from pipetrainer.tests.family_rows.wan_video import ROWS
    from pipetrainer.training.spec.options import TimestepSpec

    sdxl = dataclasses.replace(setup, model=sdxl_small(), settings={
        **setup.settings, "timesteps": TimestepSpec(shift="resolution", sigma_max=0.8)})
    message = _error(sdxl.build)
    for fragment in ("shift 'resolution'", "set shift to 'model'", "sigma_max 0.8", "eps-prediction"):
        assert fragment in message, (fragment, message)
    ti2v = next(row for row in ROWS if row.name == "Wan22-TI2V").load(comfy_root, fixture_paths)
    wan = dataclasses.replace(setup, model=ti2v, settings={
        **setup.settings, "expert": "high_noise", "timesteps": TimestepSpec(sigma_max=0.5)})
    message = _error(wan.build)
    for fragment in ("Wan option expert 'high_noise' is for the two files", "leave (almost) nothing of it"):
        assert fragment in message, (fragment, message)
    assert "Timestep Sampling: shift" not in message  # a flow model: its timestep settings are fine


def test_a_good_setup_passes(setup):
    spec = setup.build()
    assert isinstance(spec, RunSpec) and spec.items == setup.cache.items


def test_every_problem_is_reported_at_once(setup):
    bad = setup.tmp / "garbage.png"
    bad.write_bytes(b"nope")
    s = setup.with_items(setup.item("sd15latent", latent=(4, 9, 9), cond=(77, 1024), source=bad),
                         skipped=("lost.png: unreadable",))
    s = dataclasses.replace(s, lora_name="../up", settings={**s.settings, "pipeline_stages": 64})
    message = _error(s.build)
    for fragment in ("plain file name", "64 ranks", "lost.png", "garbage.png", "4 channels",
                     "patch size 2", "1024 wide"):
        assert fragment in message, (fragment, message)
    assert message.count("\n- ") >= 7


def test_real_images_and_videos_pass_the_media_check(setup):
    import av
    import numpy as np
    from pipetrainer.nodes.checks.preflight import media_problems

    video = setup.tmp / "ok.mp4"
    with av.open(str(video), "w") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, dtype=np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    assert media_problems([str(setup.demo_image), str(video)]) == []
    text = setup.tmp / "notes.txt"
    text.write_text("x")
    assert "not a supported type" in media_problems([str(text)])[0]


def test_disk_estimates_grow_with_saves_and_items(setup):
    from pipetrainer.nodes.checks.preflight import cache_disk_bytes, free_bytes, lora_parameter_count, run_disk_bytes

    params = lora_parameter_count(setup.model, LoraSpec(rank=4, targets="attention"))
    wider = lora_parameter_count(setup.model, LoraSpec(rank=8, targets="all_linear"))
    assert 0 < params < wider
    once, often = run_disk_bytes(params, TrainSpec(steps=100)), run_disk_bytes(params, TrainSpec(steps=100, save_every=10))
    assert often - once == 9 * params * 16  # nine intermediate saves, each a checkpoint + a LoRA file
    assert cache_disk_bytes(1000 * 16 * 64 * 64, 77 * 768) > cache_disk_bytes(10 * 16 * 64 * 64, 77 * 768)
    assert free_bytes(str(setup.tmp / "not" / "yet" / "made")) > 0


def test_the_cache_disk_estimate_counts_items_resolutions_and_text(encoders, fixture_paths, tmp_path):
    from pipetrainer.nodes.checks.preflight import (
        DISK_MARGIN_BYTES,
        cache_problems,
        dataset_latent_elements,
        free_bytes,
    )

    vae, clip = encoders
    dataset = scan_dataset(fixture_paths.dataset, 64)
    assert dataset_latent_elements(dataset, 16, 8, lambda f: f) == len(dataset.entries) * 16 * 8 * 8
    assert cache_problems(dataset, vae, clip, str(tmp_path / "cache")) == []  # tiny cache, plenty of room
    assert free_bytes(str(tmp_path)) > DISK_MARGIN_BYTES


def test_the_cache_disk_estimate_counts_what_a_cache_with_flip_masks_and_caption_options_stores(encoders, tmp_path):
    """Oracle: the elements a real cache run stores (every latent entry with its mirrored latent and
    mask, every tag-shuffled caption and the empty caption) equal the estimate's count."""
    import numpy as np
    from PIL import Image
    from pipetrainer.nodes.checks.preflight import dataset_latent_elements, dataset_texts, text_cache_elements
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.captions import CaptionOptions

    vae, clip = encoders
    rng = np.random.default_rng(5)
    for folder in ("data", "masks"):
        (tmp_path / folder).mkdir()
    for i, caption in enumerate(("cat, red, sofa, window", "cat, red, sofa, window", "dog, lawn, ball")):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "data" / f"p{i}.png")
        Image.fromarray(rng.integers(0, 255, (64, 64), dtype=np.uint8)).save(tmp_path / "masks" / f"p{i}.png")
        (tmp_path / "data" / f"p{i}.txt").write_text(caption, encoding="utf-8")

    def stored_and_estimated(**options):
        dataset = scan_dataset(tmp_path / "data", 64, **options)
        result = build_cache(dataset, vae, clip, tmp_path / f"cache{len(options)}")
        keys = {i.latent_key for i in result.items} | {k for i in result.items
                                                        for k in (i.text_key, *i.text_variants, i.empty_text_key) if k}
        stored = sum(t.numel() for entry in read_entries(result.items[0].latent_file, keys).values() for t in entry.values())
        return stored, (dataset_latent_elements(dataset, 16, 8, lambda f: f)
                        + text_cache_elements(dataset_texts(dataset), clip))

    stored, estimated = stored_and_estimated()
    assert stored == estimated
    stored_with_options, estimated_with_options = stored_and_estimated(
        flip="random", mask="folder", mask_folder=tmp_path / "masks",
        captions=CaptionOptions(dropout=0.2, shuffle_variants=3, keep_tags=1))
    assert stored_with_options > 2 * stored  # the options really store more: the oracle is not trivial
    assert estimated_with_options == stored_with_options


def test_the_cache_node_checks_disk_then_caches(encoders, fixture_paths):
    from pipetrainer.nodes.cache import PipeTrainerCache

    vae, clip = encoders
    result = PipeTrainerCache.execute(scan_dataset(fixture_paths.dataset, 64), vae, clip).result[0]
    assert result.items


def test_sources_unchanged_since_caching_are_not_decoded_again(encoders, fixture_paths, tmp_path):
    import os

    from pipetrainer.nodes.checks.preflight import unchanged_since_cached
    from pipetrainer.training.cache.store import build_cache

    data = tmp_path / "data"
    shutil.copytree(fixture_paths.dataset, data)
    vae, clip = encoders
    cache = build_cache(scan_dataset(data, 64), vae, clip, tmp_path / "cache")
    sources = {item.source for item in cache.items}
    assert unchanged_since_cached(cache.items) == sources
    touched = sorted(sources)[0]
    os.utime(touched, ns=(0, 10**9))
    assert unchanged_since_cached(cache.items) == sources - {touched}


@pytest.mark.slow
def test_the_real_server_refuses_with_every_problem_and_starts_nothing(server, comfy_root, fixture_paths):
    """Queued through ComfyUI: an unreadable image plus a resolution too small for the model, in one error."""
    import json
    import uuid

    from pipetrainer.devkit.host import history_error

    folder = f"preflight_{uuid.uuid4().hex[:8]}"
    data = comfy_root / "input" / folder
    shutil.copytree(fixture_paths.dataset, data)
    (data / "broken.jpg").write_bytes(b"not a jpeg")
    (data / "broken.txt").write_text("broken", encoding="utf-8")
    lora_name = f"preflight-{uuid.uuid4().hex[:6]}"
    prompt = json.loads((Path(__file__).resolve().parent.parent / "workflows" / "api" / "pipetrainer_tiny_mmdit.json")
                        .read_text())
    prompt["4"]["inputs"].update(folder=folder, resolution=64, extra_resolutions="32")
    prompt["8"]["inputs"].update(lora_name=lora_name, steps=2)
    try:
        error = history_error(server.wait(server.queue(prompt), 600))
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert error is not None and "Invalid training setup" in error, error
    assert "broken.jpg" in error and "dropped while caching" in error, error
    assert "4x4 are too small" in error and "Raise the resolution" in error, error
    assert not list((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{lora_name}-*"))  # nothing launched


def test_preflight_stays_fast_on_a_large_cache(setup):
    import time

    from pipetrainer.nodes.checks.preflight import train_problems

    items = setup.cache.items * 500  # repeats: each distinct entry and source is read once
    big = setup.with_items(*items)
    started = time.monotonic()
    problems = train_problems(big.model, big.cache, LoraSpec(rank=4), TrainSpec(steps=10), str(setup.tmp))
    took = time.monotonic() - started
    print(f"\npreflight of {len(items)} items ({len(set(items))} distinct): {took:.2f} s")
    assert problems == [] and took < 10
