"""Which quantized bases can take LoRAs stacked before training (LoraLoaderModelOnly ahead of Train LoRA).

The training process merges stacked LoRAs into the frozen base's weights before training
(training/model/model_source.py). That works for full-precision and plain fp8 weights (merged in fp32 and
stored back in the weight's dtype), but not for:

- legacy scaled fp8 and ComfyUI's per-layer-quantized files: the stored fp8 values only mean something
  with their per-layer scales, and ComfyUI merges into them by requantizing (stochastic rounding,
  a recalculated scale), which the trainer does not reproduce;
- GGUF files: the weights are GGML blocks, which ComfyUI-GGUF only dequantizes on the fly; a merge
  would have to requantize every patched layer.

One rule, two callers: the Train node's preflight (nodes/checks/preflight.py, before any process starts, so
the user learns it at once) and the training process's loader (a spec written by hand or by an older
node). :func:`stacked_lora_problem` is a pure function of plain values; :func:`recipe_base_kind` reads
the one fact it needs (the file's weight format) from a safetensors header only.
"""

from __future__ import annotations

from .formats import WeightFormat, file_weight_format

GGUF = "gguf"  # the base kind of a GGUF file (ModelRecipe.loader "gguf"); other kinds are WeightFormat values
CHECKPOINT_PREFIX = "model.diffusion_model."  # where ComfyUI's checkpoint loader finds the diffusion model

_REFUSED = {
    WeightFormat.SCALED_FP8.value: "scaled fp8",
    WeightFormat.PER_LAYER.value: "per-layer-quantized (mixed precision)",
    GGUF: "GGUF",
}


def recipe_base_kind(loader: str, path: str) -> str:
    """The base's kind for :func:`stacked_lora_problem`: ``"gguf"`` or a :class:`WeightFormat` value.

    Reads the safetensors header of a diffusion-model or checkpoint file (nothing else); a file that
    cannot be read counts as plain (the model-file checks report a missing or changed file).
    """
    if loader == GGUF:
        return GGUF
    prefix = CHECKPOINT_PREFIX if loader == "checkpoint" else ""
    try:
        return file_weight_format(path, prefix)[0].value
    except (OSError, ValueError, RuntimeError):  # gone / not safetensors: reported by other checks
        return WeightFormat.PLAIN.value


def stacked_lora_problem(base_kind: str, stacked: int) -> str | None:
    """Why ``stacked`` LoRA levels on a base of ``base_kind`` cannot be trained on, with the fix; or None."""
    what = _REFUSED.get(base_kind)
    if not stacked or what is None:
        return None
    plural = "s" if stacked > 1 else ""
    return (f"The MODEL has {stacked} LoRA{plural} stacked on a {what} base (LoRA loaders between the model "
            f"loader and Train LoRA). They cannot be merged into its quantized weights before training. Fix: "
            "remove the LoRA loaders between the model loader and Train LoRA, or train on a full-precision or "
            "plain fp8 file of the model (or one with the LoRA already merged into it, e.g. saved with the "
            "stock ModelSave node from a full-precision base).")
