"""Rebuild the graph's MODEL in the training process by replaying ComfyUI's own loader.

The node layer records a :class:`~training.spec.ModelRecipe` (loader, file, options, fingerprint);
here the same ComfyUI function loads the same file with the same options, so fp8 and other quantized
weights behave exactly as they do in the graph. LoRAs stacked on the input MODEL are merged first.

Loaders (``ModelRecipe.loader``): ``diffusion_model`` (``comfy.sd.load_diffusion_model``),
``checkpoint`` (``comfy.sd.load_checkpoint_guess_config``, the MODEL only) and ``gguf``
(ComfyUI-GGUF's own reader and ops, imported from the user's custom_nodes folder: training/quant/gguf.py).
Quantized files stay quantized: the frozen base is never dequantized as a whole (training/quant/).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..quant.formats import WeightFormat, file_weight_format, quant_format_problem
from ..quant.guards import force_full_precision_matmul, match_fixed_compute_dtypes
from ..quant.stacking import CHECKPOINT_PREFIX, recipe_base_kind, stacked_lora_problem
from ..spec.options import ModelRecipe
from .fingerprint import file_fingerprint
from .sampling_override import apply_sampling_override
from .stage_weights import DeferredWeights, release_modules

_WEIGHT_DTYPES = {
    "default": {},
    "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn},
    "fp8_e4m3fn_fast": {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True},
    "fp8_e5m2": {"dtype": torch.float8_e5m2},
}

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_options(weight_dtype: str, compute_dtype: str | None = None, file_fp8: torch.dtype | None = None) -> dict:
    """ComfyUI ``model_options`` for UNETLoader's ``weight_dtype`` choice.

    Without ``compute_dtype`` this is the stock loader's own mapping (the graph's MODEL, for
    inference): ComfyUI picks the storage dtype of "default" weights from the device, e.g. bf16 or
    fp16 on CUDA. With one (the training process), "default" weights are stored in the compute dtype,
    so ``fp32`` means fp32 on every device; fp8 weights stay fp8 and get their compute dtype from
    :func:`use_compute_dtype` after loading, because ComfyUI's loader has no option for it.
    ``file_fp8`` is the dtype of a plain fp8 file (training/quant/formats.py): its "default" weights
    stay in it rather than being dequantized to the compute dtype.
    """
    options = dict(_WEIGHT_DTYPES[weight_dtype])
    if compute_dtype is not None and "dtype" not in options:
        options["dtype"] = file_fp8 or COMPUTE_DTYPES[compute_dtype]
    return options


def weight_dtype_of_options(options: dict) -> str:
    """The loader's ``weight_dtype`` choice that gives these ``model_options`` (inverse of the mapping)."""
    wanted = {k: options[k] for k in ("dtype", "fp8_optimizations") if options.get(k)}
    return next((name for name, value in _WEIGHT_DTYPES.items() if value == wanted), "default")


def use_compute_dtype(patcher, compute_dtype: str) -> None:
    """Make the model compute in ``compute_dtype`` whatever its weights are stored in.

    ComfyUI chooses a manual-cast dtype at load time from the device and the model's supported
    inference dtypes (fp16 on many GPUs for SD3, fp32 on CPU). Its manual-cast layers cast each weight
    to the dtype of their input, and the trainer feeds inputs in ``manual_cast_dtype`` (or the weight
    dtype when that is None; training/data/micro_batches.py), so setting it here decides the compute dtype. fp8
    weights always get manual-cast layers from ComfyUI, so the cast happens in every Linear.
    """
    compute = COMPUTE_DTYPES[compute_dtype]
    model = patcher.model
    cast = None if model.get_dtype() == compute else compute
    model.manual_cast_dtype = cast
    model.model_config.manual_cast_dtype = cast


class StaleRecipeError(RuntimeError):
    pass


def load_model(recipe: ModelRecipe, compute_dtype: str = "fp32", deferred: DeferredWeights | None = None):
    """A ComfyUI ModelPatcher for the recipe computing in ``compute_dtype``, stacked LoRAs merged.

    With ``deferred``, ComfyUI's loader runs as usual but the weights are kept aside in it, not
    loaded, and stacked LoRAs stay pending: :func:`finish_loading` loads one pipeline stage's share.
    """
    import comfy.sd
    import comfy.utils

    if recipe.fingerprint and file_fingerprint(recipe.path) != recipe.fingerprint:
        raise StaleRecipeError(
            f"{recipe.path} changed on disk since the graph loaded it; queue the graph again to reload it."
        )
    if recipe.loader not in _LOADERS:
        raise ValueError(f"Unknown model loader {recipe.loader!r} in the run spec (known: {', '.join(_LOADERS)}).")
    if recipe.loras:  # the Train node's preflight refuses these first; a hand-written spec lands here
        problem = stacked_lora_problem(recipe_base_kind(recipe.loader, recipe.path), len(recipe.loras))
        if problem:
            raise ValueError(problem)
    if recipe.loader in ("diffusion_model", "checkpoint"):  # the Train node's preflight says it first
        problem = quant_format_problem(recipe.path, CHECKPOINT_PREFIX if recipe.loader == "checkpoint" else "")
        if problem:
            raise ValueError(problem)
    load = _LOADERS[recipe.loader]
    if deferred is None or _loads_only_in_full(recipe):
        patcher = load(recipe, compute_dtype)
    else:
        with deferred.capture():
            patcher = load(recipe, compute_dtype)
        if not deferred.captured:
            raise RuntimeError("This ComfyUI loaded the model without the state-dict load PipeTrainer defers; "
                               "report the ComfyUI version. Training cannot load stages separately.")
    use_compute_dtype(patcher, compute_dtype)
    force_full_precision_matmul(patcher.model.diffusion_model)
    match_fixed_compute_dtypes(patcher.model.diffusion_model)
    for lora_path, strength in recipe.loras:
        lora = comfy.utils.load_torch_file(lora_path, safe_load=True)
        patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
    if recipe.loras and deferred is None:
        _merge_patches(patcher)
    apply_sampling_override(patcher, recipe.sampling)
    return patcher


def _loads_only_in_full(recipe: ModelRecipe) -> bool:
    """ComfyUI 0.3.75's per-layer-quantized Linear raises when its weight is not in the state dict it is
    given, so the stage-wise deferred load (training/model/stage_weights.py) cannot keep its weights aside:
    such a file loads in full on every rank (its weights stay fp8). Current ComfyUI defers it as usual.

    GGUF always loads in full: its weights are views of the memory-mapped file (loading reads nothing;
    other stages' layers are released unread), while a deferred load would make ComfyUI-GGUF fill every
    Linear whose weight it was not given with fp32 zeros: 4 bytes per weight of the whole model, held
    until the stage's share is loaded (measured: the worker's peak on Flux-min was set there)."""
    import comfy.ops

    if recipe.loader == "gguf":
        return True
    if recipe.loader not in ("diffusion_model", "checkpoint") or hasattr(comfy.ops, "QuantLinearFunc"):
        return False
    prefix = CHECKPOINT_PREFIX if recipe.loader == "checkpoint" else ""
    return file_weight_format(recipe.path, prefix)[0] is WeightFormat.PER_LAYER


def _load_diffusion_model(recipe: ModelRecipe, compute_dtype: str):
    import comfy.sd

    fmt, fp8 = file_weight_format(recipe.path)
    options = model_options(recipe.weight_dtype, compute_dtype, fp8 if fmt is WeightFormat.FP8 else None)
    return comfy.sd.load_diffusion_model(recipe.path, model_options=options)


def _load_checkpoint(recipe: ModelRecipe, compute_dtype: str):
    """The MODEL of an all-in-one checkpoint, as ``CheckpointLoaderSimple`` builds it (no CLIP, no VAE)."""
    import comfy.sd

    fmt, fp8 = file_weight_format(recipe.path, CHECKPOINT_PREFIX)
    options = model_options(recipe.weight_dtype, compute_dtype, fp8 if fmt is WeightFormat.FP8 else None)
    patcher = comfy.sd.load_checkpoint_guess_config(recipe.path, output_vae=False, output_clip=False,
                                                    output_clipvision=False, model_options=options)[0]
    if patcher is None:
        raise ValueError(f"ComfyUI found no diffusion model in the checkpoint {recipe.path}.")
    return patcher


def _load_gguf(recipe: ModelRecipe, compute_dtype: str):
    from ..quant.gguf import load_gguf_model

    return load_gguf_model(recipe.path, recipe.extension_path, COMPUTE_DTYPES[compute_dtype])


_LOADERS = {"diffusion_model": _load_diffusion_model, "checkpoint": _load_checkpoint, "gguf": _load_gguf}


def finish_loading(patcher, deferred: DeferredWeights, foreign_paths: Sequence[str]) -> list[str]:
    """Load the weights of everything but ``foreign_paths`` (other stages' modules, paths in the
    diffusion model), merge stacked LoRAs into those weights only, and free the foreign modules."""
    dm = patcher.model.diffusion_model
    loaded = deferred.load(dm, skip=foreign_paths)
    _merge_patches(patcher, keep={f"diffusion_model.{key}" for key in loaded})
    release_modules(dm, foreign_paths)
    return loaded


def _merge_patches(patcher, keep: set[str] | None = None) -> None:
    """Bake the patcher's LoRA patches into the module weights (frozen base for training).

    With ``keep``, only those weights are merged (one stage's); patches of the others are dropped.
    """
    import comfy.lora
    import comfy.utils

    model = patcher.model
    with torch.no_grad():
        for key, patches in patcher.patches.items():
            if keep is not None and key not in keep:
                continue
            weight = comfy.utils.get_attr(model, key)
            # calculate_weight works in place: give it a detached fp32 copy, never the parameter itself.
            work = weight.detach().to(torch.float32, copy=True)
            merged = comfy.lora.calculate_weight(patches, work, key, intermediate_dtype=torch.float32)
            weight.copy_(merged.to(weight.dtype))
    patcher.patches.clear()
