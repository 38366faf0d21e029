"""Tensor subclasses in a swapped block: copied as the plain tensors that hold their bytes, rebuilt around each copy.

Why: a subclass's own ops cannot be trusted to copy it. ComfyUI-GGUF's ``GGMLTensor`` keeps its quantization
type, logical shape and patches as instance attributes; ``pin_memory()`` returns a ``GGMLTensor`` without
them, and its layer then reads the quantized bytes as plain weights. ComfyUI's ``QuantizedTensor`` (a
wrapper around fp8 data and a scale) dequantizes on the ops it does not handle, ``pin_memory`` among them.
So the swapper never asks a subclass to pin, move or detach itself: :func:`split` gives the plain tensors
under it (its *pieces*: those go into the block's flat host buffer and are what is copied to the compute
device) and a function that rebuilds a tensor of the exact type and state around copies of them.

Two kinds are rebuilt generically:

* storage subclasses (a strided tensor with a storage of its own and no ``__torch_dispatch__``, like
  ``GGMLTensor``): one piece, the plain tensor under the subclass; rebuilt with ``as_subclass`` (which runs
  no constructor) and the instance's ``__dict__`` (lists, dicts and sets copied one level, as
  ``GGMLTensor.to`` copies its patches; other values shared, tensors included);
* traceable wrapper subclasses (torch's ``__tensor_flatten__`` / ``__tensor_unflatten__`` protocol for a
  subclass holding inner tensors, like ``QuantizedTensor``): the pieces of the inner tensors, rebuilt with
  ``__tensor_unflatten__`` and the flatten context taken at attach.

Anything else (a dispatch subclass without that protocol, a non-strided layout) has no generic copy:
:func:`split` returns None and the swapper refuses it (:func:`unsupported_message`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

Rebuild = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


def split(tensor: torch.Tensor) -> tuple[list[torch.Tensor], Rebuild] | None:
    """``(pieces, rebuild)``: plain strided tensors holding ``tensor``'s bytes, and ``rebuild(copies)`` giving a
    tensor of ``tensor``'s type and state over copies of those pieces (same order); None if not possible."""
    cls = type(tensor)
    if is_plain(tensor):
        return ([tensor.detach()], _first) if tensor.layout == torch.strided else None
    if hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__"):
        return _split_wrapper(tensor)
    if cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and tensor.layout == torch.strided:
        state = {k: v for k, v in tensor.__dict__.items() if k != "_is_param"}

        def rebuild(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
            new = pieces[0].as_subclass(cls)
            new.__dict__.update({k: v.copy() if isinstance(v, (list, dict, set)) else v for k, v in state.items()})
            return new

        return [tensor.as_subclass(torch.Tensor).detach()], rebuild
    return None


def _split_wrapper(tensor: torch.Tensor) -> tuple[list[torch.Tensor], Rebuild] | None:
    names, ctx = tensor.__tensor_flatten__()
    parts: list[tuple[str, int, Rebuild]] = []
    pieces: list[torch.Tensor] = []
    for name in names:
        inner = split(getattr(tensor, name))
        if inner is None:
            return None
        parts.append((name, len(inner[0]), inner[1]))
        pieces += inner[0]
    cls, size, stride = type(tensor), tensor.size(), tensor.stride()

    def rebuild(copies: Sequence[torch.Tensor]) -> torch.Tensor:
        inner, start = {}, 0
        for name, count, build in parts:
            inner[name] = build(copies[start:start + count])
            start += count
        return cls.__tensor_unflatten__(inner, ctx, size, stride)

    return pieces, rebuild


def as_parameter(tensor: torch.Tensor) -> torch.Tensor:
    """A frozen Parameter of ``tensor``. A subclass is marked as ``nn.Parameter`` marks one (``_is_param``),
    without the ``detach()`` it would run: GGMLTensor's returns itself, a wrapper's may copy inner tensors."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    if type(tensor) is torch.Tensor:
        return nn.Parameter(tensor, requires_grad=False)
    tensor._is_param = True
    return tensor


def unsupported_message(path: str, owner: nn.Module, tensor: torch.Tensor) -> str:
    """Why block swap refuses ``tensor`` (at ``path``, held by the layer ``owner``), and what to do instead."""
    kind = f"{type(tensor).__module__}.{type(tensor).__qualname__}"
    return (f"Block swap cannot keep a host copy of {path} (in a {type(owner).__name__} layer): it is a {kind} "
            f"({tensor.layout}) that can be copied neither as plain bytes nor through torch's __tensor_flatten__ "
            "protocol, and its own copy methods may lose its quantization state. Load this model unquantized, "
            "or set blocks_to_swap to 0.")


def _first(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    return pieces[0]

