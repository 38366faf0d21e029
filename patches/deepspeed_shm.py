"""Stop DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op at ``init_distributed``.

On the CPU accelerator, ``deepspeed.comm.torch.TorchBackend.__init__`` calls ``build_shm_op()``, which
compiles a C++ extension with g++ (90-120 s cold) and leaks two /dev/shm segments per run. Pipeline
training only needs point-to-point sends and small all-reduces that gloo handles, so the op is
useless here. We make ``build_shm_op`` return ``None`` (the value DeepSpeed itself uses when the op is
unavailable). Checked against DeepSpeed 0.19.x.

When DeepSpeed no longer has that function, or ``TorchBackend.__init__`` no longer calls it, the patch
**falls back**: DeepSpeed's own initialisation runs unchanged and one ``[pipetrainer]`` line in the
rank log says so. Falling back rather than refusing is the choice because the op costs start-up
time and shared memory, never correctness (and CUDA runs do not build it at all).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType

TARGET_MODULE = "deepspeed.comm.torch"
TARGET_FUNCTION = "build_shm_op"
_CALL_SITE = f"{TARGET_FUNCTION}()"
_MARK = "_pipetrainer_disabled"


def _no_shm_op():
    return None


setattr(_no_shm_op, _MARK, True)


def _target_module() -> ModuleType:
    importlib.import_module(TARGET_MODULE)
    # ``import deepspeed.comm.torch as m`` would bind the torch package; the module lives in sys.modules.
    return sys.modules[TARGET_MODULE]


def why_not_applicable(module: ModuleType) -> str | None:
    """Why replacing ``build_shm_op`` in this ``deepspeed.comm.torch`` would not stop the build, or None."""
    current = getattr(module, TARGET_FUNCTION, None)
    if current is None or not callable(current):
        return f"{TARGET_MODULE}.{TARGET_FUNCTION} is gone"
    backend = getattr(module, "TorchBackend", None)
    try:
        calls = backend is not None and _CALL_SITE in inspect.getsource(backend.__init__)
    except (OSError, TypeError):
        calls = False
    if not calls:
        return f"{TARGET_MODULE}.TorchBackend.__init__ no longer calls {_CALL_SITE}"
    return None


def disable_shm_comm_build(module: ModuleType | None = None) -> bool:
    """Replace ``deepspeed.comm.torch.build_shm_op`` (or ``module``'s); True when it is replaced.

    Otherwise DeepSpeed's own code is left alone and a ``[pipetrainer]`` line says why and what it costs.
    Calling it again is a no-op that returns True.
    """
    module = module if module is not None else _target_module()
    if getattr(getattr(module, TARGET_FUNCTION, None), _MARK, False):
        return True
    reason = why_not_applicable(module)
    if reason is not None:
        print(f"[pipetrainer] DeepSpeed shared-memory op patch NOT applied: {reason} (the patch was written for "
              "deepspeed 0.19.8). Falling back to DeepSpeed's own start-up: on CPU ranks it may compile its "
              "shared-memory all-reduce with g++ (1-2 minutes) and leave /dev/shm segments behind; training is "
              "unaffected. If DeepSpeed changed, update patches/deepspeed_shm.py or install deepspeed==0.19.8.",
              flush=True)
        return False
    setattr(module, TARGET_FUNCTION, _no_shm_op)
    print("[pipetrainer] DeepSpeed shared-memory op patch applied: init_distributed builds no CPU shm op.",
          flush=True)
    return True


def is_disabled() -> bool:
    module = sys.modules.get(TARGET_MODULE)
    return bool(module and getattr(getattr(module, TARGET_FUNCTION, None), _MARK, False))
