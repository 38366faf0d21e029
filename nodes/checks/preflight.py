"""Preflight: every problem of a training setup, found before any process starts, in one message.

Hours of training are lost to problems that were visible up front: a file that cannot be decoded, items
the cache quietly dropped, latents from another family's VAE, text embeddings of the wrong width, a
resolution the model cannot patch, a full disk, or DeepSpeed missing. Each check here is a small pure
function over plain values that returns problem strings naming the item and the fix; :func:`train_problems`
reads the facts from ComfyUI's objects and the cache files and runs them all. The Train node adds these
to its own problems and raises them together, so a user fixes a graph in one go. Checks whose rules
differ by model family (patch sizes, frames, text widths, extras, LoRA targets) are pure functions of
training/pipelines/checks.py, driven by the family adapter; no stage layer is built here (only the memory
plan of ``blocks_to_swap`` auto builds them, to count each stage's bytes: nodes/checks/memory.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...training.cache.plan import latent_layout, text_entries
from ...training.data.captions import CaptionOptions
from ...training.offload.stages import blocks_to_swap_problem, uniform_boundaries
from ...training.pipelines import checks as family_checks
from ...training.pipelines.checks import CachedShapes, ModelInputs, cache_vs_model_problems
from ...training.quant.formats import quant_format_problem
from ...training.quant.stacking import CHECKPOINT_PREFIX, recipe_base_kind, stacked_lora_problem
from ...training.spec.options import CacheItem, LoraSpec, TrainSpec

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP, VAE

    from ...training.cache.store import CacheResult
    from ...training.data.dataset import DatasetSpec

MAX_NAMED = 20  # items named per problem; the rest are counted
BYTES_PER_LORA_PARAM_PER_SAVE = 16  # fp32 weight + two AdamW moments in the checkpoint, + the LoRA file
DISK_MARGIN_BYTES = 256 * 2**20  # logs, events, DeepSpeed's own files, and room for the OS

MediaCheck = Callable[[str], "str | None"]


def _named(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


# ---- dataset files -----------------------------------------------------------------------------
def image_problem(path: str) -> str | None:
    """Why Pillow cannot fully decode ``path``, or None (``load`` catches truncated files too)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def video_problem(path: str) -> str | None:
    """Why PyAV cannot decode a first video frame of ``path``, or None."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                return "no video stream"
            for _ in container.decode(container.streams.video[0]):
                return None
            return "no decodable frame"
    except (av.FFmpegError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def media_checks() -> dict[str, MediaCheck]:
    """File suffix -> the check that decodes that kind of file."""
    from ...training.data import dataset

    images = {ext: image_problem for ext in dataset.IMAGE_EXTENSIONS}
    videos = {ext: video_problem for ext in getattr(dataset, "VIDEO_EXTENSIONS", ())}
    return {**images, **videos}


def media_problems(paths: Iterable[str], checks: Mapping[str, MediaCheck] | None = None) -> list[str]:
    """One problem naming every dataset file that is missing, of an unknown type, or does not decode."""
    checks = media_checks() if checks is None else checks
    bad = []
    for path in paths:
        name = Path(path).name
        check = checks.get(Path(path).suffix.lower())
        if not os.path.isfile(path):
            bad.append(f"{name}: the file is gone")
        elif check is None:
            bad.append(f"{name}: not a supported type ({', '.join(sorted(checks))})")
        elif (why := check(path)) is not None:
            bad.append(f"{name}: {why}")
    if not bad:
        return []
    return [f"{len(bad)} dataset file(s) cannot be read: {_named(bad)}. "
            "Re-export or remove them, then run 'Cache Latents & Text' again."]


def unchanged_since_cached(items: Iterable[CacheItem]) -> set[str]:
    """Sources whose size and mtime still match what the cache index recorded when it decoded them.

    Those decoded fine moments ago and need no second decode; the others (plain-file caches, files
    changed since) are checked with :func:`media_problems`, so preflight stays cheap on large datasets.
    """
    import sqlite3

    from ...training.cache.index import connect

    items = tuple(items)
    indexes = {item.latent_file for item in items if getattr(item, "latent_key", "") and os.path.isfile(item.latent_file)}
    known: dict[str, tuple[int, int]] = {}
    for index_file in indexes:
        db = connect(Path(index_file), readonly=True)
        try:
            known.update({row[0]: (row[1], row[2]) for row in db.execute("SELECT path, size, mtime_ns FROM sources")})
        except sqlite3.Error:
            pass
        finally:
            db.close()
    unchanged = set()
    for source in {item.source for item in items}:
        try:
            st = os.stat(source)
        except OSError:
            continue
        if known.get(source) == (st.st_size, st.st_mtime_ns):
            unchanged.add(source)
    return unchanged


def dropped_item_problems(dropped: Sequence[str]) -> list[str]:
    """The items the cache left out (unreadable, or lost to bucket rounding), which would silently be missing."""
    if not dropped:
        return []
    return [f"{len(dropped)} dataset item(s) were dropped while caching and would be missing from training: "
            f"{_named(list(dropped))}. Fix or remove them (or change the bucket settings), then cache again."]


def empty_dataset_problems(item_count: int) -> list[str]:
    if item_count > 0:
        return []
    return ["The dataset is empty: nothing reached the cache. Add captioned images to the dataset folder "
            "(or fix the captions / missing_caption policy), then cache again."]


# ---- cached tensors against the model ----------------------------------------------------------
def _file_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Shapes in a plain safetensors cache file (items without keys)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _index_shapes(index_file: str, keys: Sequence[str]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shapes the cache index recorded for ``keys`` (see training/cache/index.py); absent keys are left out."""
    import json
    import sqlite3

    from ...training.cache.index import connect

    db = connect(Path(index_file), readonly=True)
    try:
        out = {}
        for key in keys:
            row = db.execute("SELECT shapes FROM entries WHERE key=?", (key,)).fetchone()
            if row:
                out[key] = {k: tuple(v) for k, v in json.loads(row[0]).items()}
        return out
    except sqlite3.Error:
        return {}
    finally:
        db.close()


def read_cached_shapes(items: Iterable[CacheItem]) -> CachedShapes:
    """Shapes of every distinct cached entry; entries missing from the index or unreadable are named."""
    refs: dict[str, tuple[str, str, str]] = {}  # entry id -> (container file, key or "", source name)
    for item in dict.fromkeys(items):
        for container, key in ((item.latent_file, getattr(item, "latent_key", "")),
                               (item.text_file, getattr(item, "text_key", ""))):
            refs.setdefault(f"{container}#{key}", (container, key, Path(item.source).name))
    indexed: dict[str, dict[str, tuple[int, ...]]] = {}
    for index_file in {c for c, k, _ in refs.values() if k}:
        keys = sorted(k for c, k, _ in refs.values() if k and c == index_file)
        if os.path.isfile(index_file):
            indexed.update({f"{index_file}#{k}": v for k, v in _index_shapes(index_file, keys).items()})
    latents, conds, pooled, unreadable, extras = {}, {}, {}, [], {}
    for entry_id, (container, key, source) in refs.items():
        if key:
            shapes = indexed.get(entry_id)
            if shapes is None:
                unreadable.append(f"{source}: its entry is missing from {container}")
                continue
        else:
            try:
                shapes = _file_shapes(container)
            except Exception as exc:  # safetensors raises its own error types for damaged headers
                unreadable.append(f"{Path(container).name} ({source}): {type(exc).__name__}")
                continue
        if "latent" in shapes:
            latents[entry_id] = shapes["latent"]
        if "cond" in shapes:
            conds[entry_id] = shapes["cond"]
            pooled[entry_id] = shapes["pooled"][-1] if "pooled" in shapes else 0
        named = {k: v for k, v in shapes.items() if k not in ("latent", "cond", "pooled")}
        if named:  # the family's extras (training/pipelines/base.py ExtraSpec)
            extras[entry_id] = named
    pairs = tuple((Path(item.source).name, f"{item.latent_file}#{getattr(item, 'latent_key', '')}",
                   f"{item.text_file}#{getattr(item, 'text_key', '')}") for item in dict.fromkeys(items))
    return CachedShapes(latents, conds, pooled, tuple(unreadable), extras, pairs)


def unreadable_cache_problems(unreadable: Sequence[str]) -> list[str]:
    if not unreadable:
        return []
    return [f"{len(unreadable)} cache file(s) are missing or damaged: {_named(list(unreadable))}. "
            "Run 'Cache Latents & Text' again (it re-encodes them)."]


def model_inputs(model: ModelPatcher) -> ModelInputs | None:
    """What the ComfyUI MODEL takes (its family adapter's rules), or None when its family is not trainable."""
    return family_checks.model_inputs(model.model)


def model_support_problems(model: ModelPatcher) -> list[str]:
    """A known family's adapter may still refuse this model (Flux.2, Fill, Ovis-Image are
    loaded as Flux): report its reason here, before launching, instead of in the training process."""
    return family_checks.model_support_problems(model.model)


# ---- the model file ------------------------------------------------------------------------------
def model_file_problems(path: str, fingerprint: str, loras: Sequence[tuple[str, float]] = ()) -> list[str]:
    """The training process reloads the MODEL from its file: the file must still be the one the graph loaded."""
    from ...training.model.fingerprint import file_fingerprint

    name = Path(path).name
    out = []
    if not os.path.isfile(path):
        out.append(f"The model file {name} is gone since the graph loaded it: restore it, or pick another "
                   "in 'Load Diffusion Model (PipeTrainer)'.")
    elif fingerprint and file_fingerprint(path) != fingerprint:
        out.append(f"The model file {name} changed on disk after the graph loaded it, so training would use "
                   "other weights than the MODEL you see: unload models (Free model and node cache, or "
                   "restart ComfyUI) and queue again.")
    gone = [Path(p).name for p, _ in loras if not os.path.isfile(p)]
    if gone:
        out.append(f"The LoRA file(s) {_named(gone)} stacked on the model are gone: restore them or remove "
                   "their Load LoRA nodes.")
    return out


def stacked_lora_problems(loader: str, path: str, stacked: int) -> list[str]:
    """LoRAs stacked on a scaled-fp8, per-layer-quantized or GGUF base cannot be merged before training
    (training/quant/stacking.py): say so now, not from inside the training process."""
    problem = stacked_lora_problem(recipe_base_kind(loader, path), stacked) if stacked else None
    return [problem] if problem else []


def quant_format_problems(loader: str, path: str) -> list[str]:
    """A per-layer-quantized file in a format this ComfyUI cannot load or PipeTrainer cannot train
    (training/quant/formats.py): say so now, not from inside the training process."""
    if loader not in ("diffusion_model", "checkpoint"):
        return []
    problem = quant_format_problem(path, CHECKPOINT_PREFIX if loader == "checkpoint" else "")
    return [problem] if problem else []


# ---- block swap --------------------------------------------------------------------------------
def blocks_to_swap_problems(blocks_to_swap: int, layer_is_block: Sequence[bool], stages: int, method: str) -> list[str]:
    """``blocks_to_swap`` (per stage) must not exceed the swappable blocks of the smallest stage.

    ``layer_is_block`` is the engine's layer list (input preparation first), True for swappable blocks.
    A uniform split is computed exactly; DeepSpeed's parameter-balanced split is only known in the
    trainer, so here its smallest stage is bounded by ``blocks // stages`` (the trainer checks the rest
    with the same message on every rank).
    """
    if blocks_to_swap <= 0:
        return []
    if stages <= 1 or method == "uniform":
        bounds = uniform_boundaries(len(layer_is_block), max(1, stages))
        per_stage = [sum(layer_is_block[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
        exact = True
    else:
        per_stage, exact = [sum(layer_is_block) // stages] * stages, False
    problem = blocks_to_swap_problem(blocks_to_swap, per_stage, exact)
    return [problem] if problem else []


def model_block_layout(model: ModelPatcher) -> list[bool]:
    """The engine's layer list as swappable-or-not: the input preparation, then the family's stage layers."""
    return family_checks.block_layout(model.model)


# ---- environment -------------------------------------------------------------------------------
def deepspeed_problems(installed: bool, platform: str) -> list[str]:
    if installed:
        return []
    hint = ("DeepSpeed's pipeline engine does not run on native Windows: run ComfyUI under WSL2 or Linux, then "
            if platform.startswith("win") else "")
    return [f"DeepSpeed is not installed in ComfyUI's Python: {hint}run "
            f"'{Path(sys.executable).name} -m pip install -r custom_nodes/ComfyUI-PipeTrainer/requirements.txt' "
            "(or 'pip install deepspeed') and restart ComfyUI."]


def lora_parameter_count(model: ModelPatcher, lora: LoraSpec) -> int:
    """Adapter parameters the run will train: each targeted Linear's count for the adapter type, as PEFT
    builds it (LoHa doubles LoRA's ``rank * (in + out)``, LoKr is far smaller; training/adapters/size.py)."""
    from ...training.adapters.size import model_adapter_parameter_count

    return model_adapter_parameter_count(model.model, lora)


def run_disk_bytes(lora_params: int, train: TrainSpec) -> int:
    """Bytes a run writes: one checkpoint + LoRA file per save (all are kept), plus a margin."""
    saves = 1 + (max(0, train.steps - 1) // train.save_every if train.save_every else 0)
    return saves * lora_params * BYTES_PER_LORA_PARAM_PER_SAVE + DISK_MARGIN_BYTES


def cache_disk_bytes(latent_elements: int, text_elements: int, bytes_per_element: int = 4) -> int:
    """Bytes a cache of that many latent and text-embedding elements needs (stored fp32), plus a margin."""
    return (latent_elements + text_elements) * bytes_per_element + DISK_MARGIN_BYTES


def _vae_geometry(vae: VAE) -> tuple[int, int, Callable[[int], int]]:
    """(latent channels, spatial downscale, frames -> latent frames) of a ComfyUI VAE."""
    ratio = getattr(vae, "downscale_ratio", 8)
    channels = int(getattr(vae, "latent_channels", 16))
    if isinstance(ratio, (tuple, list)):  # video VAEs: (temporal rule, h, w)
        temporal = ratio[0] if callable(ratio[0]) else (lambda f, r=ratio[0]: max(1, f // r))
        return channels, int(ratio[-1]), temporal
    return channels, int(ratio), lambda frames: frames


def dataset_latent_elements(dataset: DatasetSpec, channels: int, downscale: int, latent_frames: Callable[[int], int]) -> int:
    """Latent-entry elements of every item at every training resolution, videos at their largest frame
    bucket: what the cache's planner (training/cache/plan.py) puts in each item's entry, i.e. the
    latent, one image latent per reference image, with flip a second, mirrored latent and with a loss
    mask one channel on the latent grid."""
    settings = getattr(dataset, "bucket_settings", None)
    resolutions = settings.resolutions if settings is not None else (dataset.resolution,)
    max_frames = settings.max_frames if settings is not None else 1
    flip, mask = getattr(dataset, "flip", "none"), getattr(dataset, "mask", "none")
    total = 0
    for entry in dataset.entries:
        frames = latent_frames(max_frames) if getattr(entry, "is_video", False) else 1
        layout = latent_layout(entry, flip, mask)
        total += sum(layout.elements(channels, frames, (res // downscale) ** 2) for res in resolutions)
    return total


def dataset_texts(dataset: DatasetSpec, references_in_prompt: bool = True) -> list[str]:
    """The texts the cache encodes for ``dataset``, one per text entry, as the cache's planner
    (training/cache/plan.py) lists them: every distinct caption text (each tag-shuffled variant is its
    own, behind the prompt prefix) and the empty caption when captions drop out. With
    ``references_in_prompt`` (the default: an edit model's prompt may carry them, so the estimate stays
    an upper bound) an item's reference images make its texts entries of their own."""
    return text_entries(dataset.entries, getattr(dataset, "captions", None) or CaptionOptions(), references_in_prompt)


def _token_count(clip: CLIP, text: str) -> int:
    """The longest token sequence ``clip.tokenize`` makes of ``text`` over its tokenizers (padding and
    the encoder's template included; a caption longer than one CLIP window counts every window)."""
    counts = [sum(len(batch) for batch in batches) for batches in clip.tokenize(text).values()
              if isinstance(batches, list)]
    return max(counts, default=0)


def text_cache_elements(texts: Sequence[str], clip: CLIP) -> int:
    """Elements of the text entries of ``texts``: the empty prompt's embedding (its rows, width and
    pooled vector, from one real encode), plus one row per token a text has beyond the empty prompt's.
    Padded encoders (CLIP, 77 tokens) give every caption the same rows; LLM encoders grow with the caption
    (and store an attention-mask element per row)."""
    from ...training.cache.encoders import returns_attention_mask

    cond, pooled = clip.encode_from_tokens(clip.tokenize(""), return_pooled=True)
    rows, width = cond.shape[1], cond.shape[-1] + (1 if returns_attention_mask(clip) else 0)
    pooled_elements = pooled[0].numel() if pooled is not None else 0
    empty_tokens = _token_count(clip, "")
    extra_rows = sum(max(0, _token_count(clip, text) - empty_tokens) for text in texts)
    return (rows * width + pooled_elements) * len(texts) + extra_rows * width


def _folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) if os.path.isdir(folder) else 0


def cache_problems(dataset: DatasetSpec, vae: VAE, clip: CLIP, cache_dir: str) -> list[str]:
    """Free disk for the cache about to be filled.

    The estimate counts every item (an upper bound when some are reused) minus what the cache folder
    already holds, so re-running an unchanged dataset never trips it. One empty caption is encoded
    to learn the text embedding's size; the captions are only tokenized.
    """
    channels, downscale, latent_frames = _vae_geometry(vae)
    latent = dataset_latent_elements(dataset, channels, downscale, latent_frames)
    text = text_cache_elements(dataset_texts(dataset), clip)
    needed = max(DISK_MARGIN_BYTES, cache_disk_bytes(latent, text) - _folder_bytes(cache_dir))
    return disk_problems(cache_dir, needed, free_bytes(cache_dir), "the latent and text cache",
                         ", or cache fewer resolutions / frames")


def free_bytes(folder: str) -> int:
    """Free space of the file system that holds ``folder`` (or its nearest existing parent)."""
    path = Path(folder).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_problems(folder: str, needed: int, free: int, what: str, fix: str) -> list[str]:
    if free >= needed:
        return []
    gib = 2**30
    return [f"Not enough free disk for {what} in {folder}: about {needed / gib:.2f} GiB needed, "
            f"{free / gib:.2f} GiB free. Free some space{fix}."]


# ---- GPUs ------------------------------------------------------------------------------------
def gpu_problems(train: TrainSpec, gpus: str) -> list[str]:
    """The ``gpus`` input against ComfyUI's device and GPUs: one GPU per rank, each one visible.

    The logic and messages (naming each GPU's free and used memory) are nodes/checks/gpus.py's pure functions.
    """
    from .launch import comfyui_device, resolve_gpus

    return resolve_gpus(gpus, train.pipeline_stages * train.data_parallel, comfyui_device())[1]


# ---- all of it --------------------------------------------------------------------------------
def train_problems(model: ModelPatcher, cache: CacheResult, lora: LoraSpec, train: TrainSpec, runs_root: str,
                   gpus: str = "", family_options: Mapping[str, object] | None = None) -> list[str]:
    """Every problem the Train node can see before launching, in a stable order. ``family_options``: the
    raw family options of the Train node (their own rules against this model, e.g. a Wan expert's range)."""
    items = tuple(getattr(cache, "items", ()))
    report = getattr(cache, "report", None)
    problems = deepspeed_problems(importlib.util.find_spec("deepspeed") is not None, sys.platform)
    problems += gpu_problems(train, gpus)
    problems += empty_dataset_problems(len(items))
    problems += dropped_item_problems(tuple(getattr(report, "skipped", ())))
    unchanged = unchanged_since_cached(items)
    problems += media_problems(dict.fromkeys(item.source for item in items if item.source not in unchanged))
    shapes = read_cached_shapes(items)
    problems += unreadable_cache_problems(shapes.unreadable)
    from ..model_source import recipe_of  # ComfyUI's loaders: imported only where a MODEL exists
    from .stacked_loras import stacked_levels

    recipe = recipe_of(model)
    if recipe is not None:  # without one, the Train node already says which loader to use
        problems += model_file_problems(recipe.path, recipe.fingerprint, recipe.loras)
        problems += stacked_lora_problems(recipe.loader, recipe.path, len(recipe.loras) + stacked_levels(model))
        problems += quant_format_problems(recipe.loader, recipe.path)
    inputs = model_inputs(model)
    unsupported = model_support_problems(model)
    problems += unsupported
    if inputs is not None and not unsupported:  # the family's rules (training/pipelines/checks.py)
        problems += cache_vs_model_problems(shapes, inputs)
        problems += family_checks.model_timestep_problems(model.model, train.timesteps)
        problems += family_checks.family_rule_problems(model.model, family_options or {}, train.timesteps, shapes)
        problems += blocks_to_swap_problems(train.blocks_to_swap, model_block_layout(model), train.pipeline_stages,
                                            train.partition_method)
        needed = run_disk_bytes(lora_parameter_count(model, lora), train)
        problems += disk_problems(runs_root, needed, free_bytes(runs_root), "checkpoints and LoRA files",
                                  ", or save less often (save_every)")
    return problems


def validation_cache_problems(model: ModelPatcher, items: Sequence[CacheItem]) -> list[str]:
    """A validation cache's tensors against the model, by the same rules as the training cache."""
    shapes = read_cached_shapes(items)
    problems = unreadable_cache_problems(shapes.unreadable)
    inputs = model_inputs(model)
    if inputs is not None and not model_support_problems(model):
        problems += cache_vs_model_problems(shapes, inputs)
    return [f"Validation cache: {p}" for p in problems]


def regularization_cache_problems(model: ModelPatcher, cache: CacheResult) -> list[str]:
    """A regularization cache against the model, by the training cache's rules: items it dropped, entries
    missing or damaged, latents and embeddings the model cannot take."""
    items = tuple(getattr(cache, "items", ()))
    problems = dropped_item_problems(tuple(getattr(getattr(cache, "report", None), "skipped", ())))
    shapes = read_cached_shapes(items)
    problems += unreadable_cache_problems(shapes.unreadable)
    inputs = model_inputs(model)
    if inputs is not None and not model_support_problems(model):
        problems += cache_vs_model_problems(shapes, inputs)
    return [f"Regularization cache: {p}" for p in problems]
