"""Each patch of third-party code fails loudly here when its upstream target changes, and says in the
run log whether it is applied or fell back (patches/deepspeed_shm.py falls back: the op only costs time)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

import pytest
import torch
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


# ---- patches/deepspeed_stage_module.py: PipelineModule left where the trainer puts it -------------------


def test_deepspeed_pipeline_module_still_moves_the_stage_at_the_end_of_its_init():
    """The call the patch skips: when DeepSpeed drops it, this fails and the patch is revisited."""
    from deepspeed.pipe import PipelineModule
    from pipetrainer.patches.deepspeed_stage_module import moves_stage_in_init

    assert moves_stage_in_init()
    assert inspect.getsource(PipelineModule.__init__).count(".to(") == 1  # and moves the module no other way


def _deepspeed_pipe_module_edited(tmp_path, old: str, new: str):
    """DeepSpeed's own ``deepspeed.runtime.pipe.module`` source with one edit, loaded as a sibling module."""
    import deepspeed.runtime.pipe.module as real

    source = inspect.getsource(real)
    assert source.count(old) == 1
    path = tmp_path / "module_changed.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("deepspeed.runtime.pipe.module_changed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.ones(4))

    def forward(self, x):
        return self.linear(x) * self.table


def _tensors(layers):
    return [(t, t.device, t.data_ptr()) for layer in layers for t in (*layer.parameters(), *layer.buffers())]


def test_the_stage_module_stays_where_it_is_while_plain_pipeline_module_moves_it(tmp_path, capsys):
    """On the stand-in device (DeepSpeed's accelerator device is meta) DeepSpeed's own PipelineModule
    moves every layer there; the patched build leaves each tensor as it was and says so once."""
    from deepspeed.pipe import PipelineModule
    from pipetrainer.patches.deepspeed_stage_module import build_stage_module
    from pipetrainer.tests.standin_device import standin_rank

    with standin_rank(tmp_path):
        plain = [_Layer(), _Layer()]
        PipelineModule(layers=plain, num_stages=1, partition_method="uniform")
        assert {t.device.type for layer in plain for t in (*layer.parameters(), *layer.buffers())} == {"meta"}
        capsys.readouterr()
        layers = [_Layer(), _Layer()]
        before = _tensors(layers)
        module = build_stage_module(layers, num_stages=1, partition_method="uniform")
        assert _tensors(layers) == before
        assert "placement patch applied" in capsys.readouterr().out
        module.to("meta")  # after the build, to() is torch's own again
        assert {t.device.type for layer in layers for t in (*layer.parameters(), *layer.buffers())} == {"meta"}


def test_a_deepspeed_that_moves_the_stage_another_way_is_refused(tmp_path):
    from pipetrainer.patches.deepspeed_stage_engine import UnsupportedDeepSpeed
    from pipetrainer.patches.deepspeed_stage_module import build_stage_module, moves_stage_in_init
    from pipetrainer.tests.standin_device import standin_rank

    call = "self.to(get_accelerator().device_name(self.local_rank))"
    changed = _deepspeed_pipe_module_edited(
        tmp_path, call, "self._apply(lambda t: t.to(get_accelerator().device_name(self.local_rank)))")
    assert not moves_stage_in_init(changed.PipelineModule)
    with standin_rank(tmp_path), pytest.raises(UnsupportedDeepSpeed, match=r"moved the pipeline stage.*0\.19\.8"):
        build_stage_module([_Layer()], base=changed.PipelineModule, num_stages=1, partition_method="uniform")


def test_a_deepspeed_that_no_longer_moves_the_stage_builds_and_the_log_says_so(tmp_path, capsys):
    from pipetrainer.patches.deepspeed_stage_module import build_stage_module
    from pipetrainer.tests.standin_device import standin_rank

    changed = _deepspeed_pipe_module_edited(tmp_path, "self.to(get_accelerator().device_name(self.local_rank))",
                                            "pass")
    layers = [_Layer()]
    before = _tensors(layers)
    with standin_rank(tmp_path):
        build_stage_module(layers, base=changed.PipelineModule, num_stages=1, partition_method="uniform")
    assert _tensors(layers) == before
    assert "no longer moves the stage" in capsys.readouterr().out
