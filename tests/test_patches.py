"""Each patch of third-party code fails loudly here when its upstream target changes."""

from __future__ import annotations

import importlib
import inspect
import sys

from pipetrainer.patches import deepspeed_shm


def test_deepspeed_still_builds_the_shm_op_in_the_torch_backend():
    importlib.import_module(deepspeed_shm.TARGET_MODULE)
    module = sys.modules[deepspeed_shm.TARGET_MODULE]
    assert callable(getattr(module, deepspeed_shm.TARGET_FUNCTION))
    # The call site we neutralise: TorchBackend.__init__ asks build_shm_op() for the op.
    assert "build_shm_op()" in inspect.getsource(module.TorchBackend.__init__)


def test_disabling_makes_the_backend_get_no_shm_op():
    deepspeed_shm.disable_shm_comm_build()
    deepspeed_shm.disable_shm_comm_build()  # idempotent
    module = sys.modules[deepspeed_shm.TARGET_MODULE]
    assert deepspeed_shm.is_disabled()
    assert module.build_shm_op() is None
