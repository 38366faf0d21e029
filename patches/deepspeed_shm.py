"""Stop DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op at ``init_distributed``.

On the CPU accelerator, ``deepspeed.comm.torch.TorchBackend.__init__`` calls ``build_shm_op()``, which
compiles a C++ extension with g++ (90-120 s cold) and leaks two /dev/shm segments per run. Pipeline
training only needs point-to-point sends and small all-reduces that gloo handles, so the op is
useless here. We make ``build_shm_op`` return ``None`` (the value DeepSpeed itself uses when the op is
unavailable). Checked against DeepSpeed 0.19.x.
"""

from __future__ import annotations

import importlib
import sys

TARGET_MODULE = "deepspeed.comm.torch"
TARGET_FUNCTION = "build_shm_op"
_MARK = "_pipetrainer_disabled"


class PatchTargetMissing(RuntimeError):
    pass


def _no_shm_op():
    return None


setattr(_no_shm_op, _MARK, True)


def disable_shm_comm_build() -> None:
    """Replace ``deepspeed.comm.torch.build_shm_op``; raise if DeepSpeed no longer has it."""
    importlib.import_module(TARGET_MODULE)
    # ``import deepspeed.comm.torch as m`` would bind the torch package; the module lives in sys.modules.
    module = sys.modules[TARGET_MODULE]
    current = getattr(module, TARGET_FUNCTION, None)
    if current is None or not callable(current):
        raise PatchTargetMissing(
            f"{TARGET_MODULE}.{TARGET_FUNCTION} is gone in this DeepSpeed version; "
            "update patches/deepspeed_shm.py (pinned: deepspeed 0.19.8)."
        )
    if getattr(current, _MARK, False):
        return
    setattr(module, TARGET_FUNCTION, _no_shm_op)


def is_disabled() -> bool:
    module = sys.modules.get(TARGET_MODULE)
    return bool(module and getattr(getattr(module, TARGET_FUNCTION, None), _MARK, False))
