"""Run a ComfyUI block with its in-place residual adds (``x += f(x)``) turned into ordinary adds.

Several ComfyUI blocks (Flux's double and single stream blocks among them) update the residual stream
in place after a LayerNorm has saved that same tensor for backward. Inference never notices; autograd
raises "modified by an inplace operation" without activation checkpointing, and with PyTorch's
non-reentrant checkpointing the recomputed saved tensor is silently overwritten, giving wrong
gradients (checked against finite differences in tests/test_flux.py). ComfyUI's code is called
unchanged: a scoped :class:`~torch.overrides.TorchFunctionMode` sees ``Tensor.add_`` (what ``+=``
dispatches to) and, only when its target is one of the block's residual tensors, returns
``torch.add`` of the same operands instead. ``x += y`` rebinds ``x`` to that result, so the block's
arithmetic and output are bit-identical, the caller's tensors are left untouched, and every other
in-place op (e.g. on attention intermediates) runs as written.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class OutOfPlaceResidualAdds(TorchFunctionMode):
    """Within the ``with`` block, ``r += y`` on a tracked residual ``r`` makes a new tensor.

    ``residuals`` are the block's inputs that it updates with ``+=``; each result of such an add is
    tracked too, so chains like ``img += attn; img += mlp`` stay out of place.
    """

    def __init__(self, *residuals: torch.Tensor):
        super().__init__()
        self._tracked: list[torch.Tensor] = list(residuals)

    def _is_tracked(self, tensor: object) -> bool:
        return any(tensor is t for t in self._tracked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.add_ and args and self._is_tracked(args[0]):
            result = torch.add(*args, **kwargs)
            self._tracked.append(result)
            return result
        return func(*args, **kwargs)
