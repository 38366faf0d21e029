"""One backward pass over all of a pipeline stage's outputs, instead of one per output tensor.

DeepSpeed 0.19's ``PipelineEngine._exec_backward_pass`` runs ``out.backward(gradient=grad,
retain_graph=True)`` once per float output of a non-last stage. Our stages pass several float tensors
(image tokens, conditioning vector, text tokens), so every shared layer is back-propagated (and, with
activation checkpointing, recomputed) once per output, and parameter gradients become a sum of
partial gradients in a different order than in a 1-stage run: 1-stage and N-stage runs then drift by
~1e-7 per step instead of being bitwise equal. A single ``torch.autograd.backward`` over all outputs
is the plain autograd semantics and restores both the speed and the bitwise oracle.

The patch is per engine (the engine's own instruction map), not global, and only replaces the plain
case (no pipe/grad partitioning, no BF16 optimizer wrapper); every other case keeps DeepSpeed's code.
Checked against DeepSpeed 0.19.8; :func:`needs_single_backward` turns it off if DeepSpeed stops
looping per tensor.
"""

from __future__ import annotations

import inspect

import torch

_MARK = "_pipetrainer_single_backward"
_PER_TENSOR_LOOP = "retain_graph=(i < len(out_tensors) - 1)"
_ENGINE_ATTRS = ("pipe_buffers", "grad_layer", "is_pipe_partitioned", "is_grad_partitioned",
                 "using_bf16_optimizer", "_running_engine_backward")


class PatchTargetMissing(RuntimeError):
    pass


def _backward_instruction():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not hasattr(PipelineEngine, "_INSTRUCTION_MAP") or schedule.BackwardPass not in PipelineEngine._INSTRUCTION_MAP:
        raise PatchTargetMissing(
            "deepspeed PipelineEngine._INSTRUCTION_MAP[BackwardPass] is gone in this DeepSpeed version; "
            "update patches/deepspeed_pipe_backward.py (pinned: deepspeed 0.19.8)."
        )
    return schedule.BackwardPass, PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass]


def needs_single_backward() -> bool:
    """True while DeepSpeed back-propagates a stage's outputs one tensor at a time."""
    _, original = _backward_instruction()
    return _PER_TENSOR_LOOP in inspect.getsource(original)


def _plain_case(engine) -> bool:
    return not (engine.is_last_stage() or engine.is_pipe_partitioned or engine.is_grad_partitioned
                or engine.using_bf16_optimizer)


def use_single_backward(engine) -> None:
    """Make this pipeline ``engine`` run one autograd pass over all float outputs of its stage."""
    instruction, original = _backward_instruction()
    if not needs_single_backward():
        return
    missing = [a for a in _ENGINE_ATTRS if not hasattr(engine, a)]
    if missing:
        raise PatchTargetMissing(
            f"deepspeed PipelineEngine lacks {', '.join(missing)}; update patches/deepspeed_pipe_backward.py "
            "(pinned: deepspeed 0.19.8)."
        )

    def backward_pass(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if not (_plain_case(self) and isinstance(outputs, tuple)):
            return original(self, buffer_id)
        tensors = [t for t in outputs if t.is_floating_point()]
        grads = list(self.grad_layer)
        if len(tensors) != len(grads):
            raise RuntimeError(f"pipeline stage {self.stage_id}: {len(tensors)} float outputs but {len(grads)} "
                               "received gradients")
        self._running_engine_backward = True
        try:
            torch.autograd.backward(tensors, grads)
        finally:
            self._running_engine_backward = False
        self.pipe_buffers["output_tensors"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None

    setattr(backward_pass, _MARK, True)
    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, instruction: backward_pass}


def is_applied(engine) -> bool:
    instruction, _ = _backward_instruction()
    return bool(getattr(engine._INSTRUCTION_MAP.get(instruction), _MARK, False))
