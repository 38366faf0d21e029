"""A rank materialises the frozen weights of its own pipeline stage only.

ComfyUI's loader reads the whole file and copies every weight into the model it builds, so each rank
of an N-stage run would hold the whole model in host memory (and the ComfyUI process a further copy).
Here the loader still runs unchanged (the same detection, dtypes, operations and key conversion), but
while it runs, a ``load_state_dict`` pre-hook on the new diffusion model takes the state dict ComfyUI
is about to load and keeps it aside (:class:`DeferredWeights`). The model comes out with its
parameters allocated but never written, which on Linux costs address space, not memory; safetensors
tensors are memory-mapped, so the file costs nothing until read.

Once the pipeline split is known, :meth:`DeferredWeights.load` hands ComfyUI's own
``diffusion_model.load_state_dict`` the entries this stage needs (everything except what belongs to the
other stages' layers), so ComfyUI's operations load them exactly as they would have, and
:func:`release_modules` turns the other stages' parameters into meta tensors. Frozen weights are
then never broadcast: every data-parallel replica loads its own copy from the file.

The hook is attached through torch's public module-registration hook, only for the duration of the
load, to the module a ComfyUI ``BaseModel`` registers as ``diffusion_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from .page_out import paged_out_as_loaded


def _under(key: str, paths: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in paths)


class DeferredWeights:
    """The diffusion model's state dict as ComfyUI's loader prepared it, not yet loaded anywhere."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._model: nn.Module | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[DeferredWeights]:
        """Within the block, the next ComfyUI model's weights are kept here instead of being loaded."""
        import comfy.model_base

        def on_register(parent: nn.Module, name: str, child: nn.Module) -> None:
            if name == "diffusion_model" and isinstance(parent, comfy.model_base.BaseModel) and self._model is None:
                self._model = child
                self._hooks.append(child._register_load_state_dict_pre_hook(self._keep_aside))

        handle = register_module_module_registration_hook(on_register)
        try:
            yield self
        finally:
            handle.remove()
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()

    def _keep_aside(self, state_dict, prefix, *_args) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            self.tensors[key[len(prefix):]] = state_dict.pop(key)

    @property
    def captured(self) -> bool:
        return self._model is not None and bool(self.tensors)

    def load(self, diffusion_model: nn.Module, skip: Iterable[str] = ()) -> list[str]:
        """Load every kept weight except those under the module paths ``skip``; return the keys loaded.

        The call is ComfyUI's own (``load_state_dict(strict=False)`` on the diffusion model, as
        ``BaseModel.load_model_weights`` makes it), so its operations' loading hooks run as usual.
        """
        if not self.tensors:  # nothing was kept aside: the loader loaded the model in full (model_source.py)
            return []
        skip = tuple(skip)
        wanted = {k: v for k, v in self.tensors.items() if not _under(k, skip)}
        with paged_out_as_loaded(diffusion_model):  # the rank holds the stage about once, not twice, while it loads
            missing, unexpected = diffusion_model.load_state_dict(wanted, strict=False)
        if unexpected:
            raise RuntimeError(f"The model file has weights the model does not take: {unexpected[:5]}")
        self.tensors.clear()  # drop the file mapping's references: what was not read is never paged in
        return sorted(wanted)


def release_modules(diffusion_model: nn.Module, paths: Iterable[str]) -> int:
    """Replace the parameters and buffers of the modules at ``paths`` by meta tensors; return the count.

    These belong to other pipeline stages: nothing on this rank reads them, so they need no memory.
    """
    count = 0
    for path in paths:
        module = diffusion_model.get_submodule(path)
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None and not param.is_meta:
                    owner._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                           requires_grad=False)
                    count += 1
            for name, buf in list(owner._buffers.items()):
                if buf is not None and not buf.is_meta:
                    owner._buffers[name] = torch.empty_like(buf, device="meta")
                    count += 1
    return count


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers that are real tensors (not meta)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def foreign_module_paths(layers: Sequence[object], local_indices: Iterable[int]) -> list[str]:
    """ComfyUI module paths held only by the layers of other stages (``comfy_paths`` of stage layers).

    A path that contains, or lies inside, a path of a local layer is never foreign: sharing stays loaded.
    """
    local_indices = set(local_indices)
    local = {p for i in local_indices for p in getattr(layers[i], "comfy_paths", {}).values()}
    other = {p for i, layer in enumerate(layers) if i not in local_indices
             for p in getattr(layer, "comfy_paths", {}).values()}
    return sorted(p for p in other if not any(_under(p, (q,)) or _under(q, (p,)) for q in local))


def unshared_tensors(layers: Iterable[tuple[int, nn.Module]], model: nn.Module) -> list[str]:
    """The parameters and buffers of the stage ``layers`` (``(index, layer)``) that ``model`` does not hold.

    Loading fills the ComfyUI model's own tensors (:meth:`DeferredWeights.load`), so a stage-layer tensor
    that is not one of them (a copy made when the layer adopted it, or a device copy a move made before
    loading) keeps what it held before: training would run on it without an error.
    """
    held = {id(t) for _, t in (*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False))}
    out = []
    for index, layer in layers:
        for module_name, owner in layer.named_modules():
            for name, t in (*owner._parameters.items(), *owner._buffers.items()):
                if t is not None and id(t) not in held:
                    out.append(f"layer {index} ({type(layer).__name__}) {'.'.join(p for p in (module_name, name) if p)}")
    return out
