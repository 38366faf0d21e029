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

An in-place update written as a statement (LTX-Video's gated residual ``x.addcmul_(y, gate)``) rebinds
nothing: an out-of-place result would be lost. Such a block runs with ``private=True`` on a copy the
caller made for it: in-place ops on that copy run as written, and every other use of it (a norm, a
Linear, a view) gets a snapshot (a clone of its current value), so no tensor that autograd saved is
modified afterwards. Without ``private``, ``addcmul_`` on a tracked residual raises instead of
corrupting the caller's tensor and the gradients. A block that updates slices of its private copy in place
(MiniMax-H3's per-segment gated residual ``x[a:b].addcmul_(y, gate)``) runs with ``slices=True`` as well: a slice
of the copy is then the copy's own view, tracked like the copy, so the in-place op on it writes into the copy.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class OutOfPlaceResidualAdds(TorchFunctionMode):
    """Within the ``with`` block, ``r += y`` on a tracked residual ``r`` makes a new tensor.

    ``residuals`` are the block's inputs that it updates with ``+=``; each result of such an add is
    tracked too, so chains like ``img += attn; img += mlp`` stay out of place. With ``private`` the
    residuals are the caller's own copies, updated in place as written (see the module docstring).
    """

    def __init__(self, *residuals: torch.Tensor, private: bool = False, slices: bool = False):
        super().__init__()
        self._tracked: list[torch.Tensor] = list(residuals)
        self._private = private
        self._slices = private and slices

    def _is_tracked(self, tensor: object) -> bool:
        return any(tensor is t for t in self._tracked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if self._private:
            kwargs = dict(zip(kwargs, self._snapshots(kwargs.values()), strict=True))
            if self._slices and func is torch.Tensor.__getitem__ and self._is_tracked(target):
                view = func(target, *self._snapshots(args[1:]), **kwargs)
                self._tracked.append(view)  # an in-place op on the slice writes into the residual, as written
                return view
            if self._is_tracked(target) and (_in_place(func) or _is_getter(func)):
                return func(target, *self._snapshots(args[1:]), **kwargs)
            return func(*self._snapshots(args), **kwargs)
        if func is torch.Tensor.add_ and self._is_tracked(target):
            result = torch.add(*args, **kwargs)
            self._tracked.append(result)
            return result
        if func is torch.Tensor.addcmul_ and self._is_tracked(target):
            raise RuntimeError(
                "A ComfyUI block updates its residual with an in-place addcmul_ that rebinds nothing; run it "
                "under OutOfPlaceResidualAdds(copy, private=True) on a copy of the residual (x.clone()).")
        return func(*args, **kwargs)

    def _snapshots(self, values) -> tuple:
        """``values`` with each tracked residual cloned (also inside lists and tuples, as ``torch.cat`` takes them)."""
        return tuple(type(v)(self._snapshots(v)) if type(v) in (list, tuple) else
                     v.clone() if self._is_tracked(v) else v for v in values)


def _in_place(func) -> bool:
    """``Tensor.addcmul_``, ``add_``, ``__setitem__`` ...: ops that write into their first argument."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in {"__setitem__", "__iadd__", "__imul__"}


def _is_getter(func) -> bool:
    """A tensor property read (``x.shape``, ``x.dtype``): nothing to snapshot."""
    return getattr(func, "__name__", "") == "__get__"
