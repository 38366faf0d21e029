"""The DeepSpeed pipeline patches and the global-norm clipping fail loudly when their targets change."""

from __future__ import annotations

import inspect

import torch
from pipetrainer.patches import deepspeed_pipe_backward as patch
from pipetrainer.training.clipping import clip_by_global_norm, squared_norms


def test_deepspeed_still_backpropagates_stage_outputs_one_tensor_at_a_time():
    assert patch.needs_single_backward()


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
