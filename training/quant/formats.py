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
