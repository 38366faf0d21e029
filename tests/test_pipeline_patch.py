"""The DeepSpeed pipeline patches and the global-norm clipping fail loudly when their targets change.

The backward patch falls back to DeepSpeed's own backward when it cannot apply (training stays
correct) and says which it did in the rank log: both paths are checked here, the applied one in a
real 2-stage run.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from pipetrainer.patches import deepspeed_pipe_backward as patch
from pipetrainer.tests.helpers import make_spec, run_training
from pipetrainer.training.optim.clipping import clip_by_global_norm, squared_norms


def test_deepspeed_still_backpropagates_stage_outputs_one_tensor_at_a_time():
    assert patch.needs_single_backward()


def _engine_class_with_backward(backward):
    """A DeepSpeed PipelineEngine whose BackwardPass runs ``backward``: how a changed DeepSpeed looks."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class ChangedEngine(PipelineEngine):
        _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.BackwardPass: backward}

    return ChangedEngine


def _single_pass_backward(self, buffer_id):  # a DeepSpeed that fixed the per-tensor loop itself
    outputs = self.pipe_buffers["outputs"][buffer_id]
    torch.autograd.backward([t for t in outputs if t.is_floating_point()], list(self.grad_layer))


def test_a_deepspeed_without_the_per_tensor_loop_keeps_its_backward_and_the_log_says_so(capsys):
    engine_type = _engine_class_with_backward(_single_pass_backward)
    engine = engine_type.__new__(engine_type)  # the patch reads the engine's class before any state
    assert not patch.needs_single_backward(engine_type)
    assert patch.use_single_backward(engine) is False
    assert not patch.is_applied(engine) and "_INSTRUCTION_MAP" not in vars(engine)
    said = capsys.readouterr().out
    assert said.startswith("[pipetrainer] DeepSpeed pipeline backward patch NOT applied: DeepSpeed's pipeline "
                           "backward no longer loops")
    assert "Falling back to DeepSpeed's own backward" in said and "update patches/deepspeed_pipe_backward.py" in said


def test_an_engine_without_the_state_the_patch_uses_keeps_its_backward_and_the_log_says_so(capsys):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    engine_type = _engine_class_with_backward(PipelineEngine._exec_backward_pass)  # still loops per tensor
    engine = engine_type.__new__(engine_type)  # but has none of the engine attributes
    assert patch.needs_single_backward(engine_type)
    assert patch.use_single_backward(engine) is False
    assert not patch.is_applied(engine)
    said = capsys.readouterr().out
    assert "NOT applied: DeepSpeed's PipelineEngine lacks pipe_buffers, grad_layer" in said


@pytest.mark.slow
def test_a_real_run_applies_both_deepspeed_patches_and_says_so_in_every_rank_log(
        fixture_paths, demo_cache, comfy_root, tmp_path):
    stages = 2
    spec = make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run", comfy_root, steps=1,
                     pipeline_stages=stages)
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] in ("error", "failed")]
    for rank in range(stages):
        log = (Path(spec.run_dir) / "logs" / f"rank{rank}.log").read_text()
        assert "[pipetrainer] DeepSpeed pipeline backward patch applied" in log, log[-2000:]
        assert "[pipetrainer] DeepSpeed shared-memory op patch applied" in log, log[-2000:]
        assert "NOT applied" not in log


def test_the_engine_state_the_single_backward_uses_still_exists():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    source = inspect.getsource(PipelineEngine)
    for attr in ("pipe_buffers", "grad_layer", "is_pipe_partitioned", "is_grad_partitioned", "using_bf16_optimizer"):
        assert f"self.{attr}" in source, attr
    assert "self._running_engine_backward = True" in inspect.getsource(PipelineEngine._exec_backward_pass)


def test_deepspeed_pipeline_clipping_is_still_per_stage_without_zero():
    """Why we clip ourselves: DeepSpeed sums norms over the model-parallel group, not the pipeline."""
    from deepspeed.runtime import utils

    src = inspect.getsource(utils.clip_grad_norm_)
    assert "get_model_parallel_group()" in src and "get_pipe_parallel_group" not in src


def test_clipping_matches_torch_on_one_process():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    norm = clip_by_global_norm(a, 0.5)
    ref = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert abs(norm - float(ref)) < 1e-5
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert squared_norms([]).numel() == 0
