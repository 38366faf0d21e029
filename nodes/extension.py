"""The ComfyUI extension: the list of PipeTrainer nodes (their node ids are public API)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .cache import PipeTrainerCache
from .checkpoint_source import PipeTrainerLoadCheckpoint
from .dataset import PipeTrainerDataset
from .family_options import PipeTrainerFamilyOptions
from .gguf_source import PipeTrainerLoadGGUF
from .gpus_memory import PipeTrainerGpusMemory
from .lora_adapter import PipeTrainerLoRA
from .model_source import PipeTrainerLoadDiffusionModel
from .optimizer import PipeTrainerOptimizer
from .preview_settings import PipeTrainerPreviewSettings
from .regularization import PipeTrainerRegularization
from .timesteps import PipeTrainerTimesteps
from .train import PipeTrainerTrain
from .training_adapter import PipeTrainerTrainingAdapter
from .validation import PipeTrainerValidation

NODES: list[type[io.ComfyNode]] = [
    PipeTrainerLoadDiffusionModel,
    PipeTrainerLoadCheckpoint,
    PipeTrainerLoadGGUF,
    PipeTrainerDataset,
    PipeTrainerCache,
    PipeTrainerLoRA,
    PipeTrainerOptimizer,
    PipeTrainerTimesteps,
    PipeTrainerValidation,
    PipeTrainerRegularization,
    PipeTrainerPreviewSettings,
    PipeTrainerTrainingAdapter,
    PipeTrainerGpusMemory,
    PipeTrainerFamilyOptions,
    PipeTrainerTrain,
]


class PipeTrainerExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
