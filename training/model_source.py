"""Rebuild the graph's MODEL in the training process by replaying ComfyUI's own loader.

The node layer records a :class:`~training.spec.ModelRecipe` (loader, file, options, fingerprint);
here the same ComfyUI function loads the same file with the same options, so fp8 and other quantized
weights behave exactly as they do in the graph. LoRAs stacked on the input MODEL are merged first.
"""

from __future__ import annotations

import torch

from .fingerprint import file_fingerprint
from .spec import ModelRecipe

_WEIGHT_DTYPES = {
    "default": {},
    "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn},
    "fp8_e4m3fn_fast": {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True},
    "fp8_e5m2": {"dtype": torch.float8_e5m2},
}


def model_options(weight_dtype: str, compute_dtype: str = "fp32") -> dict:
    """ComfyUI ``model_options`` for UNETLoader's ``weight_dtype`` choice (the same mapping it uses)."""
    options = dict(_WEIGHT_DTYPES[weight_dtype])
    if "dtype" not in options and compute_dtype == "bf16":
        options["dtype"] = torch.bfloat16
    return options


class StaleRecipeError(RuntimeError):
    pass


def load_model(recipe: ModelRecipe, compute_dtype: str = "fp32"):
    """A ComfyUI ModelPatcher for the recipe, with stacked LoRAs merged into the weights."""
    import comfy.sd
    import comfy.utils

    if recipe.fingerprint and file_fingerprint(recipe.path) != recipe.fingerprint:
        raise StaleRecipeError(
            f"{recipe.path} changed on disk since the graph loaded it; queue the graph again to reload it."
        )
    if recipe.loader != "diffusion_model":
        raise ValueError(f"Unknown model loader {recipe.loader!r} in the run spec.")
    patcher = comfy.sd.load_diffusion_model(recipe.path, model_options=model_options(recipe.weight_dtype, compute_dtype))
    for lora_path, strength in recipe.loras:
        lora = comfy.utils.load_torch_file(lora_path, safe_load=True)
        patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
    if recipe.loras:
        _merge_patches(patcher)
    return patcher


def _merge_patches(patcher) -> None:
    """Bake the patcher's LoRA patches into the module weights (frozen base for training)."""
    import comfy.lora
    import comfy.utils

    model = patcher.model
    with torch.no_grad():
        for key, patches in patcher.patches.items():
            weight = comfy.utils.get_attr(model, key)
            # calculate_weight works in place: give it a detached fp32 copy, never the parameter itself.
            work = weight.detach().to(torch.float32, copy=True)
            merged = comfy.lora.calculate_weight(patches, work, key, intermediate_dtype=torch.float32)
            weight.copy_(merged.to(weight.dtype))
    patcher.patches.clear()
