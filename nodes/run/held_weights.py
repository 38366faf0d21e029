"""The ComfyUI process's copy of the base model: released while the ranks train, reloaded when needed.

Why: the training ranks load their stages from the file themselves (training/model/stage_weights.py),
so the graph's MODEL, which the loader node filled, is idle for the whole run, and it is the largest
thing ComfyUI holds: a 20 B model is 40 GB of host RAM in bf16, twice that where ComfyUI upcasts (on
the CPU). While a run trains, the MODEL's diffusion-model parameters and buffers become meta tensors
(same shapes and dtypes: ComfyUI's memory accounting and preflight read only those), and they come back
when something needs them: a preview, the samplers after Train LoRA (the end of the run), a cancelled
or failed run. They come back from ComfyUI's own loader, called on the same file with the same options
(the MODEL's reload factory: ComfyUI's ``cached_patcher_init`` where the host records one, else the one
PipeTrainer's loader nodes attach), and the fresh tensors move into the same modules, so every clone of
the MODEL (stock nodes share one ``BaseModel``) sees them. A MODEL without a reload factory keeps its
weights, and the run log says so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ...training.model.fingerprint import file_fingerprint
from ...training.model.page_out import paging_out_while_loading
from ...training.model.stage_weights import resident_bytes

RELOAD_KEY = "pipetrainer.reload"


def attach_reload(model, factory: Callable[..., Any], args: tuple, index: int | None = None) -> None:
    """Record how to load ``model`` again: ``factory(*args)`` (its ``[index]`` when it returns a tuple),
    the shape of ComfyUI's own ``cached_patcher_init``. Stored as an attachment, so clones keep it."""
    model.set_attachments(RELOAD_KEY, (factory, args) if index is None else (factory, args, index))


def reload_factory(model) -> tuple | None:
    """PipeTrainer's reload factory of ``model``, else ComfyUI's ``cached_patcher_init``, else None."""
    own = getattr(model, "attachments", {}).get(RELOAD_KEY)
    return own or getattr(model, "cached_patcher_init", None) or None


def _load_again(factory: tuple):
    with paging_out_while_loading():  # ComfyUI's loader holds the model about once, beside the ranks' stages
        out = factory[0](*factory[1])
    return out[factory[2]] if len(factory) > 2 else out


class HeldWeights:
    """The graph MODEL's diffusion-model weights in the ComfyUI process, released and restored on demand.

    ``path`` / ``fingerprint``: the model file as the run spec recorded it; a restore refuses a file
    that changed since (the fresh weights would not be the ones the graph loaded).
    """

    def __init__(self, model, path: str | None = None, fingerprint: str | None = None) -> None:
        self.model = model
        self.path, self.fingerprint = path, fingerprint
        self.factory = reload_factory(model)
        self._released: list[tuple[str, str, str]] = []  # (module path, tensor name, "p" | "b")

    @property
    def diffusion_model(self) -> nn.Module:
        return self.model.model.diffusion_model

    @property
    def released(self) -> bool:
        return bool(self._released)

    def notes(self) -> list[str]:
        """What the run log says about ComfyUI's copy of the model: nothing when it is released (the usual
        case, in the README), a note when it stays in memory."""
        if self.factory is not None:
            return []
        return ["ComfyUI keeps its copy of the model in memory while training runs: its loader records no way to "
                "load it again (use a PipeTrainer loader node to free that memory)."]

    def release(self) -> int:
        """Turn the weights into meta tensors; return the bytes released (0 without a reload factory).

        ComfyUI must hold no loaded copy first (the Train node has unloaded every model): weights patched
        in place by a loaded LoRA are put back by that unload, not here.
        """
        if self.factory is None or self._released:
            return 0
        freed = resident_bytes(self.diffusion_model)
        for path, owner in self.diffusion_model.named_modules():
            for name, param in list(owner._parameters.items()):
                if param is not None and not param.is_meta:
                    owner._parameters[name] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
                    self._released.append((path, name, "p"))
            for name, buf in list(owner._buffers.items()):
                if buf is not None and not buf.is_meta:
                    owner._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device="meta")
                    self._released.append((path, name, "b"))
        return freed

    def restore(self) -> None:
        """Load the model again with its own loader and move the fresh tensors into the released slots."""
        if not self._released:
            return
        if self.path and self.fingerprint and file_fingerprint(self.path) != self.fingerprint:
            raise RuntimeError(f"{self.path} changed on disk while training ran, so ComfyUI cannot load the "
                               "graph's model again: queue the graph again to load the new file.")
        fresh = _load_again(self.factory).model.diffusion_model
        modules = dict(fresh.named_modules())
        ours = dict(self.diffusion_model.named_modules())
        for path, name, kind in self._released:
            source = modules[path]._parameters if kind == "p" else modules[path]._buffers
            target = ours[path]._parameters if kind == "p" else ours[path]._buffers
            tensor = source.get(name)
            if tensor is None or tuple(tensor.shape) != tuple(target[name].shape):
                raise RuntimeError(f"Reloading the model for ComfyUI gave another layout at "
                                   f"diffusion_model.{path}.{name}: queue the graph again to load it anew.")
            target[name] = tensor
        self._released.clear()

    def restore_or_report(self) -> str | None:
        """:meth:`restore`, returning the problem instead of raising it (for ``finally`` blocks)."""
        try:
            self.restore()
        except Exception as exc:  # noqa: BLE001 - reported to the user by the caller
            logging.exception("[PipeTrainer] reloading the model into ComfyUI failed")
            return f"ComfyUI could not load the model again after training ({exc})"
        return None

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """The weights back for the block (a preview), released again after it if they were released."""
        was_released = self.released
        self.restore()
        try:
            yield
        finally:
            if was_released:
                import comfy.model_management

                comfy.model_management.unload_all_models()  # puts back weights a loaded LoRA patched
                self.release()
