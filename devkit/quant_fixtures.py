"""Quantized copies of a model file, in the formats users keep, written from a full-precision file.

Every builder quantizes the weights of the model's ``Linear`` layers only (as the real converters
do; norms, embeddings and convolutions stay in full precision). Which keys those are is asked of
ComfyUI: the file is loaded with its own loader and its ``nn.Linear`` modules are listed, so the
formats follow the architecture, not a key-name guess. Formats:

- ``fp8``: plain fp8 weights (e4m3fn or e5m2), no scales;
- ``scaled_fp8``: the legacy format: a ``scaled_fp8`` marker key and a per-layer fp32 ``scale_weight``,
  weight = fp8(W / scale);
- ``per_layer``: ComfyUI's mixed-precision format: fp8 weight + ``weight_scale`` per layer and
  ``_quantization_metadata`` in the header naming each layer's format;
- ``write_comfy_quant``: the same per-layer format in the formats ComfyUI added in 2026
  (``int8_tensorwise``, ``convrot_w4a4``, ``nvfp4``, ``mxfp8``), each weight quantized by ComfyUI's own
  layout class (comfy_kitchen's ``QuantizedTensor.from_float``) and written with the tensor's own
  ``state_dict`` (the weight and the scale keys of ``QUANT_ALGOS[format]["parameters"]``), as ComfyUI
  saves such a layer; only on a ComfyUI that has the format (current, not 0.3.75);
- ``gguf``: a GGUF file (ComfyUI-GGUF's layout) written with the ``gguf`` package, Linear weights
  in one GGML quantization type, the rest F32.
- ``checkpoint``: an all-in-one file (``model.diffusion_model.`` + text encoder + VAE prefixes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def linear_weight_keys(path: Path) -> list[str]:
    """State-dict keys of the weights of ComfyUI's Linear layers in a diffusion-model file."""
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    return sorted(f"{name}.weight" for name, m in patcher.model.diffusion_model.named_modules()
                  if isinstance(m, torch.nn.Linear))


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _save(state: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


def _scaled(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().max().clamp(min=1e-12) / FP8_MAX[dtype]
    return (weight.float() / scale).to(dtype), scale.to(torch.float32).reshape(())


def write_fp8(source: Path, target: Path, dtype: torch.dtype = torch.float8_e4m3fn) -> Path:
    keys = set(linear_weight_keys(source))
    return _save({k: v.to(dtype) if k in keys else v for k, v in _state(source).items()}, target)


def write_scaled_fp8(source: Path, target: Path) -> Path:
    keys = set(linear_weight_keys(source))
    out: dict[str, torch.Tensor] = {}
    for k, v in _state(source).items():
        if k in keys:
            out[k], out[k[: -len("weight")] + "scale_weight"] = _scaled(v, torch.float8_e4m3fn)
        else:
            out[k] = v
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return _save(out, target)


def write_per_layer(source: Path, target: Path) -> Path:
    keys = set(linear_weight_keys(source))
    out: dict[str, torch.Tensor] = {}
    layers = {}
    for k, v in _state(source).items():
        if k in keys:
            layer = k[: -len(".weight")]
            out[k], out[f"{layer}.weight_scale"] = _scaled(v, torch.float8_e4m3fn)
            layers[layer] = {"format": "float8_e4m3fn"}
        else:
            out[k] = v
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    return _save(out, target, meta)


def write_comfy_quant(source: Path, target: Path, fmt: str,
                      keep: tuple[str, ...] = ("x_embedder.", "y_embedder.", "t_embedder.", "context_embedder.")) -> Path:
    """ComfyUI's per-layer format with every Linear weight in ``fmt`` (a key of ``comfy.quant_ops.QUANT_ALGOS``).

    Each weight is quantized by the layout class ComfyUI registers for ``fmt`` (default options: e.g.
    ``convrot_w4a4``'s Hadamard group 256 and int4 groups of 64, ``nvfp4``'s per-tensor + fp8 block
    scales) and serialised by ``QuantizedTensor.state_dict``, the call ComfyUI's own ``state_dict`` of a
    quantized Linear makes; the layer's format goes to ``_quantization_metadata`` in the header.

    The input embedders (keys starting with ``keep``) stay full precision, as ComfyUI's converters keep
    them: its model detection reads their in-features from the stored shape, which the 4-bit formats
    pack to half.
    """
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    if fmt not in QUANT_ALGOS:
        raise ValueError(f"This ComfyUI has no {fmt!r} in comfy.quant_ops.QUANT_ALGOS (it has {sorted(QUANT_ALGOS)}).")
    layout = QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    keys = {k for k in linear_weight_keys(source) if not k.startswith(keep)}
    out: dict[str, torch.Tensor] = {}
    layers = {}
    for k, v in _state(source).items():
        if k in keys:
            layer = k[: -len(".weight")]
            out.update(QuantizedTensor.from_float(v.float(), layout).state_dict(k))
            layers[layer] = {"format": fmt}
        else:
            out[k] = v
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    return _save(out, target, meta)


# K-quants the ``gguf`` package cannot encode: where the block's fp16 super-scales sit (byte offsets) and
# the ratio dmin/d that centres the codes on zero (Q4_K/Q5_K subtract dmin*min; Q6_K codes are signed).
_K_QUANTS = {"Q4_K": ((0, 2), 7.5), "Q5_K": ((0, 2), 15.5), "Q6_K": ((-2, None), 0.0)}


def _random_k_blocks(shape: tuple[int, ...], qtype: str, seed: int, std: float = 0.02):
    """Valid ``qtype`` blocks for a tensor of ``shape``: random codes and sub-block scales, super-scales set
    so the values have about ``std``. Returns ``(raw uint8 blocks, their float32 values)``; the values are
    decoded by the ``gguf`` package's own dequantizer, so the file and its full-precision twin agree exactly."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    (d_at, dmin_at), ratio = _K_QUANTS[qtype]

    def set_scales(d: float) -> None:
        raw[..., d_at:(d_at + 2) or None] = np.full(raw.shape[:-1], d, np.float16)[..., None].view(np.uint8)
        if dmin_at is not None:
            raw[..., dmin_at:dmin_at + 2] = np.full(raw.shape[:-1], d * ratio, np.float16)[..., None].view(np.uint8)

    set_scales(1.0)
    spread = gguf.quants.dequantize(raw.reshape(rows, -1), kind).std()
    set_scales(std / float(spread))
    raw = raw.reshape(*shape[:-1], -1)
    return raw, gguf.quants.dequantize(raw, kind).reshape(shape).astype(np.float32)


def write_gguf(source: Path, target: Path, qtype: str = "Q8_0", arch: str = "sd3",
               original: Path | None = None) -> Path:
    """A GGUF file as ComfyUI-GGUF reads it: Linear weights in ``qtype``, everything else F32.

    Q8_0 is the ``gguf`` package's quantization of the source weights. The package cannot encode
    K-quants, so Q4_K/Q5_K/Q6_K Linear weights are valid blocks of random codes at the source's scale
    (:func:`_random_k_blocks`). ``original`` receives the full-precision twin: exactly the values the
    GGUF file holds (the package's dequantization), as a safetensors diffusion-model file.
    """
    import gguf
    import numpy as np

    keys = set(linear_weight_keys(source))
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    writer = gguf.GGUFWriter(str(target), arch=arch)
    twin: dict[str, torch.Tensor] = {}
    for index, (k, v) in enumerate(sorted(_state(source).items())):
        array = v.float().numpy()
        if k in keys and array.shape[-1] % block == 0:  # rows that fill no block stay F32, as converters keep them
            if qtype in _K_QUANTS:
                raw, values = _random_k_blocks(array.shape, qtype, seed=index)
            else:
                raw = gguf.quants.quantize(array, kind)
                values = gguf.quants.dequantize(raw, kind).reshape(array.shape)
            writer.add_tensor(k, raw, raw_dtype=kind)
            twin[k] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        else:
            writer.add_tensor(k, np.ascontiguousarray(array.astype(np.float32)))
            twin[k] = v.float()
    target.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if original is not None:
        _save(twin, original)
    return target


def write_checkpoint(model: Mapping[str, torch.Tensor], text_encoders: Mapping[str, Mapping[str, torch.Tensor]],
                     vae: Mapping[str, torch.Tensor], target: Path, metadata: dict[str, str] | None = None) -> Path:
    """An all-in-one checkpoint: ``model.diffusion_model.*``, ``text_encoders.<name>.transformer.*`` (the
    SD3-family layout) and ``first_stage_model.*``."""
    out = {f"model.diffusion_model.{k}": v for k, v in model.items()}
    for name, state in text_encoders.items():
        out.update({f"text_encoders.{name}.transformer.{k}": v for k, v in state.items()})
    out.update({f"first_stage_model.{k}": v for k, v in vae.items()})
    return _save(out, target, metadata)


def build_tiny_sd3_checkpoint(path: Path, clip_l: Path, vae: Path, seed: int = 4242) -> Path:
    """An all-in-one SD3-family checkpoint ComfyUI's checkpoint loader detects: the tiny MMDiT (depth 4,
    hidden 256) sized for SD3's text encoder output (context 4096 = CLIP-L padded, pooled 2048 = CLIP-L +
    empty CLIP-G), the CLIP-L fixture as ``clip_l`` and the TAESD fixture as its VAE."""
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper

    from .fixtures import _randomize

    model = OpenAISignatureMMDITWrapper(
        input_size=None, patch_size=2, in_channels=16, out_channels=16, depth=4,
        adm_in_channels=2048, num_patches=32 * 32, pos_embed_max_size=32, pos_embed_scaling_factor=None,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 256}},
        operations=torch.nn, dtype=torch.float32,
    )
    return write_checkpoint(_randomize(model.state_dict(), seed), {"clip_l": _state(clip_l)}, _state(vae), path)
