"""One backward pass over all of a pipeline stage's outputs, instead of one per output tensor.

DeepSpeed 0.19's ``PipelineEngine._exec_backward_pass`` runs ``out.backward(gradient=grad,
retain_graph=True)`` once per float output of a non-last stage. Our stages pass several float tensors
(image tokens, conditioning vector, text tokens), so every shared layer is back-propagated (and, with
activation checkpointing, recomputed) once per output, and parameter gradients become a sum of
partial gradients in a different order than in a 1-stage run: 1-stage and N-stage runs then drift by
~1e-7 per step instead of being bitwise equal. A single ``torch.autograd.backward`` over all outputs
is the plain autograd semantics and restores both the speed and the bitwise oracle.

The patch is per engine (the engine's own instruction map), not global, and only replaces the plain
case (no pipe/grad partitioning, no BF16 optimizer wrapper). Checked against DeepSpeed 0.19.8.

When it cannot apply (DeepSpeed no longer loops per tensor, or the engine state it relies on is
gone, or the engine is not the plain case) it **falls back** to DeepSpeed's own backward and says so
once, in the rank's log, as a ``[pipetrainer]`` line. Falling back rather than refusing is the
choice because DeepSpeed's backward trains correctly: the patch buys speed and the bitwise
1-stage/N-stage oracle, not correctness.
"""

from __future__ import annotations

import inspect

import torch

_MARK = "_pipetrainer_single_backward"
_PER_TENSOR_LOOP = "retain_graph=(i < len(out_tensors) - 1)"
_ENGINE_ATTRS = ("pipe_buffers", "grad_layer", "is_pipe_partitioned", "is_grad_partitioned",
                 "using_bf16_optimizer", "_running_engine_backward")
_TESTED = "deepspeed 0.19.8"


def _backward_instruction(engine_type: type):
    """``(BackwardPass, the function the engine class runs for it)``, or None if that map is gone."""
    from deepspeed.runtime.pipe import schedule

    table = getattr(engine_type, "_INSTRUCTION_MAP", None)
    if not isinstance(table, dict) or schedule.BackwardPass not in table:
        return None
    return schedule.BackwardPass, table[schedule.BackwardPass]


def _loops_per_tensor(backward) -> bool:
    try:
        return _PER_TENSOR_LOOP in inspect.getsource(backward)
    except (OSError, TypeError):  # no source to read: cannot tell, so do not replace it
        return False


def needs_single_backward(engine_type: type | None = None) -> bool:
    """True while DeepSpeed's pipeline engine back-propagates a stage's outputs one tensor at a time."""
    if engine_type is None:
        from deepspeed.runtime.pipe.engine import PipelineEngine

        engine_type = PipelineEngine
    found = _backward_instruction(engine_type)
    return found is not None and _loops_per_tensor(found[1])


def why_not_applicable(engine) -> str | None:
    """Why the single backward cannot replace this engine's backward pass, or None when it can."""
    found = _backward_instruction(type(engine))
    if found is None:
        return ("DeepSpeed's PipelineEngine has no _INSTRUCTION_MAP[BackwardPass] any more "
                f"(the patch was written for {_TESTED})")
    if not _loops_per_tensor(found[1]):
        return ("DeepSpeed's pipeline backward no longer loops over a stage's outputs one tensor at a time "
                f"(the patch was written for {_TESTED})")
    missing = [a for a in _ENGINE_ATTRS if not hasattr(engine, a)]
    if missing:
        return f"DeepSpeed's PipelineEngine lacks {', '.join(missing)} (the patch was written for {_TESTED})"
    configured = [name for name, on in (("pipe partitioning", engine.is_pipe_partitioned),
                                        ("grad partitioning", engine.is_grad_partitioned),
                                        ("DeepSpeed's BF16 optimizer", engine.using_bf16_optimizer)) if on]
    if configured:
        return f"this engine uses {', '.join(configured)}, which the patch leaves to DeepSpeed"
    return None


def _plain_case(engine) -> bool:
    return not (engine.is_last_stage() or engine.is_pipe_partitioned or engine.is_grad_partitioned
                or engine.using_bf16_optimizer)


def use_single_backward(engine) -> bool:
    """Make this pipeline ``engine`` run one autograd pass over all float outputs of its stage.

    Returns True when the patch is in place. Otherwise the engine keeps DeepSpeed's own backward and
    one ``[pipetrainer]`` line in the rank log says why and what that costs (a rank builds one engine,
    so this speaks once per rank).
    """
    reason = why_not_applicable(engine)
    if reason is not None:
        print(f"[pipetrainer] DeepSpeed pipeline backward patch NOT applied: {reason}. Falling back to "
              "DeepSpeed's own backward (one pass per stage output): training stays correct, but shared "
              "layers are back-propagated once per output, and runs with N pipeline stages are no longer "
              "bit-identical to 1-stage runs. If DeepSpeed changed, update patches/deepspeed_pipe_backward.py "
              f"or install {_TESTED.replace(' ', '==')}.", flush=True)
        return False
    instruction, original = _backward_instruction(type(engine))

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
    print("[pipetrainer] DeepSpeed pipeline backward patch applied: one autograd pass over each stage's "
          "outputs (bit-identical 1-stage and N-stage runs).", flush=True)
    return True


def is_applied(engine) -> bool:
    found = _backward_instruction(type(engine))
    table = getattr(engine, "_INSTRUCTION_MAP", None) or {}
    return found is not None and bool(getattr(table.get(found[0]), _MARK, False))
