"""The DeepSpeed pipeline engine of one rank, built so it never moves or broadcasts frozen weights.

``deepspeed.initialize`` builds a ``PipelineEngine`` that (1) moves the whole stage to the GPU, which
defeats block swap (swapped blocks must stay in pinned host memory from the start), and (2) broadcasts
every parameter from the first data-parallel replica to the others, frozen base weights included,
although every replica loads them itself from the model file. This module builds the same engine
class the same way ``deepspeed.initialize`` does for a ``PipelineModule`` (config object, then the
engine with the module's own topology), with ``dont_change_device=True`` (the trainer places the
stage itself, training/offload) and a broadcast of the trainable (LoRA) parameters only.

The broadcast override replaces a private DeepSpeed method: :func:`check_supported` refuses a
DeepSpeed whose engine no longer has it, naming the version to use, instead of silently broadcasting
everything (slow) or nothing.
"""

from __future__ import annotations

import torch


class UnsupportedDeepSpeed(RuntimeError):
    pass


def check_supported(engine_class: type | None = None) -> None:
    """Raise with what to do when this DeepSpeed (or ``engine_class``) lacks what the stage engine relies on."""
    import inspect

    import deepspeed
    from deepspeed.runtime.pipe.engine import PipelineEngine

    engine_class = engine_class or PipelineEngine
    problems = []
    if not callable(getattr(engine_class, "_broadcast_model", None)):
        problems.append("PipelineEngine._broadcast_model is gone")
    if "dont_change_device" not in inspect.signature(deepspeed.DeepSpeedEngine.__init__).parameters:
        problems.append("DeepSpeedEngine no longer takes dont_change_device")
    if problems:
        raise UnsupportedDeepSpeed(
            f"DeepSpeed {deepspeed.__version__} changed ({'; '.join(problems)}). PipeTrainer is tested with "
            "deepspeed==0.19.8: install that version ('pip install deepspeed==0.19.8').")


def _engine_class():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from ..training.loop.collectives import broadcast_trainable

    class StageEngine(PipelineEngine):
        """A ``PipelineEngine`` whose start-up broadcast carries only trainable parameters."""

        broadcast_tensors = 0  # how many tensors the start-up broadcast sent (the LoRA's, per replica group)

        def _broadcast_model(self):
            if self.dist_backend is None or self.dp_world_size == 1:
                return
            from deepspeed.utils import groups

            self.broadcast_tensors = broadcast_trainable(
                self.module, groups._get_broadcast_src_rank(), self.seq_data_parallel_group, self.device)

    return StageEngine


def build_stage_engine(module, optimizer: torch.optim.Optimizer, scheduler, params, config: dict):
    """The pipeline engine for ``module`` (a ``PipelineModule``), which stays where the trainer put it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    check_supported()
    mpu = module.mpu()
    engine = _engine_class()(
        args=None, model=module, optimizer=optimizer, model_parameters=params, training_data=None,
        lr_scheduler=scheduler, mpu=mpu, dist_init_required=False, collate_fn=None, config=config,
        config_class=DeepSpeedConfig(config, mpu), dont_change_device=True,
    )
    engine._configure_python_gc()
    return engine
