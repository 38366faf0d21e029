"""What kind of weights a model file holds, read from its safetensors header only.

The training process replays ComfyUI's loader with a storage dtype for the frozen base. For the
"default" weight dtype that used to be the compute dtype, which would turn an fp8 file into a bf16 model
(the whole base dequantized: twice the memory the user chose the file to avoid). Here the header says
whether the file is plain fp8 (keep that dtype), legacy "scaled fp8" (a ``scaled_fp8`` marker key plus a
``scale_weight`` per layer: ComfyUI's scaled-fp8 or mixed-precision layers keep the fp8 weights whatever
the dtype option says) or ComfyUI's per-layer quantization format (``_quantization_metadata`` in the
header metadata, or ``<layer>.comfy_quant`` keys), or none of these. Nothing is read but the header.
"""

from __future__ import annotations

import collections
import enum

import torch

_FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class WeightFormat(enum.Enum):
    PLAIN = "plain"  # fp32 / bf16 / fp16
    FP8 = "fp8"  # every large weight stored in one fp8 dtype, no scales
    SCALED_FP8 = "scaled_fp8"  # legacy: scaled_fp8 marker + per-layer scale_weight
    PER_LAYER = "per_layer"  # ComfyUI's mixed-precision format (_quantization_metadata / comfy_quant)


def file_weight_format(path: str, prefix: str = "") -> tuple[WeightFormat, torch.dtype | None]:
    """``(format, fp8 dtype)`` of the diffusion-model weights under ``prefix`` in a safetensors file.

    ``prefix`` is ComfyUI's diffusion-model prefix inside an all-in-one checkpoint
    (``model.diffusion_model.``), empty for a diffusion-model file. The fp8 dtype is the most common
    fp8 weight dtype (None when the file has no fp8 weights).
    """
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = [k for k in f.keys() if k.startswith(prefix)]
        metadata = f.metadata() or {}
        counts = collections.Counter(f.get_slice(k).get_dtype() for k in keys if k.endswith(".weight"))
    fp8 = next((_FP8[d] for d, _ in counts.most_common() if d in _FP8), None)
    if "_quantization_metadata" in metadata or any(k.endswith(".comfy_quant") for k in keys):
        return WeightFormat.PER_LAYER, fp8
    if f"{prefix}scaled_fp8" in keys:
        return WeightFormat.SCALED_FP8, fp8
    if fp8 is not None:
        return WeightFormat.FP8, fp8
    return WeightFormat.PLAIN, None


# Per-layer formats ComfyUI loads but PipeTrainer does not train on, with the reason (measured on the CPU).
NOT_TRAINABLE = {
    "convrot_w4a4": (
        "ComfyUI's ConvRot W4A4 Linear has no backward to its input (comfy_kitchen's W4A4 GEMM takes only the "
        "transposed weight, so the gradient to earlier layers and their LoRAs cannot pass), and with its 4-bit "
        "activations ComfyUI's applied LoRA differs from a LoRA trained on the dequantized weights by about as "
        "much as the LoRA itself"
    ),
}


def per_layer_formats(path: str, prefix: str = "") -> set[str]:
    """The per-layer quantization formats named in a safetensors file (header metadata or ``comfy_quant`` keys)."""
    import json

    from safetensors import safe_open

    formats: set[str] = set()
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        if "_quantization_metadata" in metadata:
            layers = json.loads(metadata["_quantization_metadata"]).get("layers", {})
            formats |= {conf.get("format") for name, conf in layers.items() if name.startswith(prefix)}
        for key in f.keys():
            if key.startswith(prefix) and key.endswith(".comfy_quant"):
                formats.add(json.loads(bytes(f.get_tensor(key).tolist()).decode("utf-8")).get("format"))
    return {fmt for fmt in formats if fmt}


def quant_format_problem(path: str, prefix: str = "", known: set[str] | None = None) -> str | None:
    """Why the per-layer formats of this file cannot be trained on here, with the fix; or None.

    ``known``: the formats this ComfyUI loads (default: ``comfy.quant_ops.QUANT_ALGOS``; ComfyUI 0.3.75 has
    only ``float8_e4m3fn``). A file that cannot be read is left to the model-file checks.
    """
    try:
        formats = per_layer_formats(path, prefix)
    except (OSError, ValueError, RuntimeError):
        return None
    if not formats:
        return None
    if known is None:
        import comfy.quant_ops

        known = set(comfy.quant_ops.QUANT_ALGOS)
    missing = sorted(formats - set(known))
    if missing:
        return (f"The model file uses the per-layer quantization format(s) {', '.join(missing)}, which this ComfyUI "
                f"cannot load (its comfy.quant_ops.QUANT_ALGOS has {', '.join(sorted(known))}). Fix: update ComfyUI "
                "(these formats came in 2026), or train on a full-precision or fp8 file of the model.")
    refused = sorted(formats & NOT_TRAINABLE.keys())
    if refused:
        return "; ".join(f"The model file is quantized as {fmt}, which cannot be trained on: {NOT_TRAINABLE[fmt]}"
                         for fmt in refused) + ". Fix: train on the model's bf16, fp8 or int8_tensorwise file."
    return None
