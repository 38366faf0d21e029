"""A DeepSpeed ``PipelineModule`` that leaves its layers where they are while it is built.

DeepSpeed 0.19.8's ``PipelineModule.__init__`` ends with
``self.to(get_accelerator().device_name(self.local_rank))``. The trainer builds the module before the
stage's weights are loaded (training/model/stage_weights.py), before it places the stage with the
swapped blocks left on the host (training/offload/placement.py) and before the block swapper attaches
(training/offload/block_swap.py). On a GPU rank that one call allocates the whole local stage on the
GPU, swapped blocks included, and the weights are then loaded into GPU memory. On a CPU rank the call
moves nothing, so only a stand-in device shows it (tests/test_setup_residency.py).

:func:`build_stage_module` builds a subclass whose ``to`` does nothing while DeepSpeed's ``__init__``
runs and is the plain ``nn.Module.to`` afterwards. The trainer then places the stage itself, as the
engine already lets it (``dont_change_device``, patches/deepspeed_stage_engine.py).

Guard. :func:`moves_stage_in_init` says whether this DeepSpeed's ``__init__`` still makes that call
(tests/test_patches.py fails when it stops, so the patch is revisited). When it does not, the subclass
has nothing to skip and one ``[pipetrainer]`` line says so. Whatever DeepSpeed does, after the build
every parameter and buffer of the layers must be the same tensor, on the same device and at the same
address as before. If one is not, DeepSpeed moved the stage some other way, and the build **refuses**
(:class:`UnsupportedDeepSpeed`, naming the version to install). A fallback would leave a stage that
does not fit the GPU and a buffer that loading never fills.
"""

from __future__ import annotations

import inspect

from torch import nn

from .deepspeed_stage_engine import UnsupportedDeepSpeed

_MOVE_CALL = "self.to(get_accelerator().device_name(self.local_rank))"
_BUILDING = "_pipetrainer_building"  # in the instance __dict__ while DeepSpeed's __init__ runs
_SKIPPED = "_pipetrainer_skipped_move"
_TESTED = "deepspeed 0.19.8"


def moves_stage_in_init(module_class: type | None = None) -> bool:
    """True while ``PipelineModule.__init__`` (or ``module_class``'s) ends by moving the module to the device."""
    if module_class is None:
        from deepspeed.pipe import PipelineModule

        module_class = PipelineModule
    try:
        return _MOVE_CALL in inspect.getsource(module_class.__init__)
    except (OSError, TypeError):
        return False


def _slots(layers) -> list[tuple[nn.Module, str, bool, object]]:
    """``(owner, name, is_parameter, tensor)`` of every parameter and buffer of the module layers."""
    out = []
    for layer in layers:
        if isinstance(layer, nn.Module):
            for owner in layer.modules():
                out += [(owner, n, True, t) for n, t in owner._parameters.items() if t is not None]
                out += [(owner, n, False, t) for n, t in owner._buffers.items() if t is not None]
    return out


def _where(t) -> tuple[object, int | None]:
    try:
        return t.device, t.data_ptr()
    except RuntimeError:  # a wrapper tensor subclass (ComfyUI's QuantizedTensor) has no storage of its own
        return t.device, None


def _moved_tensors(before: list[tuple[nn.Module, str, bool, object]], where: dict[int, tuple]) -> list[str]:
    """The slots of ``before`` that now hold another tensor, or the same one on another device or address."""
    moved = []
    for owner, name, is_parameter, tensor in before:
        now = (owner._parameters if is_parameter else owner._buffers).get(name)
        if now is not tensor or _where(now) != where[id(tensor)]:
            moved.append(f"{type(owner).__name__}.{name}")
    return moved


def _stage_module_class(base: type):
    class StageModule(base):
        """A ``PipelineModule`` that DeepSpeed's own ``__init__`` cannot move to the device."""

        def __init__(self, *args, **kwargs):
            self.__dict__[_BUILDING] = True  # before nn.Module.__init__: DeepSpeed calls self.to at its end
            try:
                super().__init__(*args, **kwargs)
            finally:
                self.__dict__.pop(_BUILDING, None)

        def to(self, *args, **kwargs):
            if self.__dict__.get(_BUILDING, False):
                self.__dict__[_SKIPPED] = True
                return self
            return super().to(*args, **kwargs)

    return StageModule


def build_stage_module(layers, base: type | None = None, **kwargs):
    """``PipelineModule(layers=layers, **kwargs)`` (or ``base``'s), with every layer's tensors where they were."""
    if base is None:
        from deepspeed.pipe import PipelineModule

        base = PipelineModule
    before = _slots(layers)
    where = {id(t): _where(t) for _, _, _, t in before}
    module = _stage_module_class(base)(layers=layers, **kwargs)
    moved = _moved_tensors(before, where)
    if moved:
        import deepspeed

        raise UnsupportedDeepSpeed(
            f"DeepSpeed {deepspeed.__version__} moved the pipeline stage while building PipelineModule "
            f"({len(moved)} tensor(s), e.g. {', '.join(moved[:3])}). The trainer must place the stage itself, "
            f"after loading its weights and with swapped blocks left on the host. PipeTrainer is tested with "
            f"{_TESTED}: install it ('pip install deepspeed==0.19.8') or update patches/deepspeed_stage_module.py.")
    if module.__dict__.pop(_SKIPPED, False):
        print("[pipetrainer] DeepSpeed PipelineModule placement patch applied: the stage stays on the host "
              "until the trainer places it, after loading.", flush=True)
    else:
        print("[pipetrainer] DeepSpeed's PipelineModule no longer moves the stage while it is built: the "
              f"placement patch had nothing to skip (written for {_TESTED}; patches/deepspeed_stage_module.py).",
              flush=True)
    return module
