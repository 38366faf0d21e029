"""``Training Adapter (PipeTrainer)``: a de-distillation LoRA merged into the base while training only.

For few-step (distilled) checkpoints such as FLUX.1 schnell or Z-Image Turbo: the adapter undoes the
distillation while the new LoRA trains, and is left out of the saved LoRA and of the MODEL every node
after this one samples with (training/pipelines/distillation.py says why; nodes/checks/training_adapter.py
checks and replays it).
"""

from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io

from ..training.adapters.init_lora import file_digest
from ..training.spec.choices import SpecError
from .checks.training_adapter import TrainingAdapter, attach_training_adapter
from .types import CATEGORY


class PipeTrainerTrainingAdapter(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerTrainingAdapter",
            display_name="Training Adapter (PipeTrainer)",
            category=CATEGORY,
            description="For distilled (few-step) checkpoints: merges a de-distillation LoRA into the base while "
                        "Train LoRA trains, and leaves it out of the saved LoRA, the previews and the MODEL "
                        "output, so the LoRA keeps the checkpoint's few-step sampling.",
            inputs=[
                io.Model.Input("model", tooltip="The distilled model, from a PipeTrainer loader."),
                io.Combo.Input("adapter", options=folder_paths.get_filename_list("loras"),
                               tooltip="The de-distillation (training) adapter made for this checkpoint, in "
                                       "models/loras."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01,
                               tooltip="The adapter's strength while training (1.0 as published)."),
            ],
            outputs=[io.Model.Output(tooltip="The same model for Train LoRA: the adapter is applied only inside "
                                             "training; samplers see the model without it.")],
        )

    @classmethod
    def fingerprint_inputs(cls, adapter: str | None = None, **_: object) -> object:
        """A file rewritten under the same name must re-run the node (its digest names the run's copy)."""
        path = folder_paths.get_full_path("loras", adapter) if adapter else None
        if not path:
            return ""
        stat = os.stat(path)
        return (path, stat.st_size, stat.st_mtime_ns)

    @classmethod
    def execute(cls, model, adapter: str, strength: float) -> io.NodeOutput:
        path = folder_paths.get_full_path("loras", adapter)
        if not path:
            raise SpecError([f"The training adapter {adapter!r} is not in ComfyUI's loras folder: refresh the node "
                             "and pick an existing file."])
        path = os.path.abspath(path)
        return io.NodeOutput(attach_training_adapter(model, TrainingAdapter(path, float(strength), file_digest(path))))
