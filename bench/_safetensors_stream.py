"""Write a safetensors file one tensor at a time, so a 24 GB model never has to sit whole in memory.

``safetensors.torch.save_file`` takes the whole state dict and serialises it at once (for a 12B bf16
model: the 24 GB dict plus a copy of its bytes). The format is simple enough to stream: an 8-byte
little-endian header length, a JSON header (padded with spaces to a multiple of 8) giving each
tensor's dtype, shape and byte range, then the tensors' bytes back to back in that order. The
header is known up front (names, shapes and dtypes come from a ``meta``-device model), so each
tensor can be made, written and dropped in turn. The file is read back by the safetensors library
(ComfyUI's loader), which validates the header and the byte ranges.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
}

Plan = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""Tensor name -> (shape, dtype), in the order the tensors are written."""


def header_bytes(plan: Plan, metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a file holding the tensors of ``plan`` in its order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (shape, dtype) in plan.items():
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written (supported: {sorted(map(str, _DTYPES))}).")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streamed(path: Path, plan: Plan, make: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
                   metadata: Mapping[str, str] | None = None) -> int:
    """Write ``make(name, shape, dtype)`` for every tensor of ``plan`` to ``path``; return the bytes written.

    ``make`` may return a tensor on any device; it is copied to host memory and written, then dropped.
    """
    written = 0
    with open(path, "wb") as f:
        head = header_bytes(plan, metadata)
        f.write(head)
        written += len(head)
        for name, (shape, dtype) in plan.items():
            tensor = make(name, shape, dtype)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{name}: made {tuple(tensor.shape)} {tensor.dtype}, the header says {shape} {dtype}.")
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(data)
            written += data.nbytes
    return written
