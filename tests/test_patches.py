"""Each patch of third-party code fails loudly here when its upstream target changes, and says in the
run log whether it is applied or fell back (patches/deepspeed_shm.py falls back: the op only costs time)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

import pytest
from pipetrainer.patches import deepspeed_shm


def test_deepspeed_still_builds_the_shm_op_in_the_torch_backend():
    importlib.import_module(deepspeed_shm.TARGET_MODULE)
    module = sys.modules[deepspeed_shm.TARGET_MODULE]
    assert callable(getattr(module, deepspeed_shm.TARGET_FUNCTION))
    # The call site we neutralise: TorchBackend.__init__ asks build_shm_op() for the op.
    assert "build_shm_op()" in inspect.getsource(module.TorchBackend.__init__)
    assert deepspeed_shm.why_not_applicable(module) is None


def test_disabling_makes_the_backend_get_no_shm_op_and_says_so_once(tmp_path, capsys):
    importlib.import_module(deepspeed_shm.TARGET_MODULE)
    fresh = _deepspeed_comm_torch_edited(tmp_path, "", "")  # an unpatched copy of this DeepSpeed's module
    assert deepspeed_shm.disable_shm_comm_build(fresh) is True
    assert capsys.readouterr().out == ("[pipetrainer] DeepSpeed shared-memory op patch applied: "
                                       "init_distributed builds no CPU shm op.\n")
    assert deepspeed_shm.disable_shm_comm_build(fresh) is True  # idempotent, and silent the second time
    assert capsys.readouterr().out == ""
    assert fresh.build_shm_op() is None


def test_disabling_patches_the_module_deepspeed_uses():
    assert deepspeed_shm.disable_shm_comm_build() is True
    module = sys.modules[deepspeed_shm.TARGET_MODULE]
    assert deepspeed_shm.is_disabled()
    assert module.build_shm_op() is None


def _deepspeed_comm_torch_edited(tmp_path, old: str, new: str):
    """DeepSpeed's own ``deepspeed.comm.torch`` source with one edit, loaded as a sibling module: what
    a future DeepSpeed that changed this code would look like to the patch."""
    real = sys.modules[deepspeed_shm.TARGET_MODULE]
    source = inspect.getsource(real)
    assert old in source
    path = tmp_path / "torch_changed.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("deepspeed.comm.torch_changed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_deepspeed_that_no_longer_calls_build_shm_op_is_left_alone_and_the_log_says_why(tmp_path, capsys):
    importlib.import_module(deepspeed_shm.TARGET_MODULE)
    changed = _deepspeed_comm_torch_edited(tmp_path, "self.shm_comm_op = build_shm_op()",
                                           "self.shm_comm_op = None")
    original = changed.build_shm_op
    assert deepspeed_shm.disable_shm_comm_build(changed) is False
    assert changed.build_shm_op is original
    said = capsys.readouterr().out
    assert said.startswith("[pipetrainer] DeepSpeed shared-memory op patch NOT applied")
    assert "no longer calls build_shm_op()" in said and "Falling back" in said and "update patches/deepspeed_shm.py" in said


def test_a_deepspeed_without_build_shm_op_is_left_alone_and_the_log_says_why(tmp_path, capsys):
    importlib.import_module(deepspeed_shm.TARGET_MODULE)
    changed = _deepspeed_comm_torch_edited(tmp_path, "def build_shm_op():", "def _renamed_build():")
    assert not hasattr(changed, "build_shm_op")
    assert deepspeed_shm.disable_shm_comm_build(changed) is False
    assert not hasattr(changed, "build_shm_op")
    said = capsys.readouterr().out
    assert "NOT applied" in said and "build_shm_op is gone" in said


def test_the_stage_engine_targets_exist_in_this_deepspeed_and_a_missing_one_is_refused():
    """patches/deepspeed_stage_engine.py overrides PipelineEngine._broadcast_model and passes
    dont_change_device: this fails as soon as the installed DeepSpeed drops either."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from pipetrainer.patches.deepspeed_stage_engine import UnsupportedDeepSpeed, check_supported

    check_supported()

    class WithoutBroadcast(PipelineEngine):
        _broadcast_model = None

    with pytest.raises(UnsupportedDeepSpeed, match=r"_broadcast_model is gone.*deepspeed==0.19.8"):
        check_supported(WithoutBroadcast)


def test_the_gguf_patch_leaves_a_layer_without_the_hook_call_alone_and_says_why(capsys):
    """A ComfyUI-GGUF whose layer no longer calls ``forward_ggml_cast_weights`` keeps its own forward."""
    import torch
    from pipetrainer.patches.gguf_lean_backward import dequantize_again_in_backward, why_not_applicable

    class ChangedLayer(torch.nn.Linear):
        def forward_comfy_cast_weights(self, input):
            return super().forward(input)

    model = torch.nn.Sequential(ChangedLayer(4, 4))
    assert "no longer calls" in why_not_applicable(ChangedLayer)
    assert dequantize_again_in_backward(model, ChangedLayer) == 0
    assert "forward_ggml_cast_weights" not in vars(model[0])
    assert "GGUF lean-backward patch NOT applied" in capsys.readouterr().out
