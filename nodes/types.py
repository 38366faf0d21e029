"""Custom socket types passed between our nodes (their values are frozen spec objects)."""

from comfy_api.latest import io

Dataset = io.Custom("PIPETRAINER_DATASET")
Cache = io.Custom("PIPETRAINER_CACHE")
LoraConfig = io.Custom("PIPETRAINER_LORA")
OptimizerConfig = io.Custom("PIPETRAINER_OPTIMIZER")
TimestepConfig = io.Custom("PIPETRAINER_TIMESTEPS")
ValidationConfig = io.Custom("PIPETRAINER_VALIDATION")
LoraModel = io.Custom("LORA_MODEL")  # the stock LoraModelLoader's input type
LossMap = io.Custom("LOSS_MAP")  # the stock LossGraphNode's input type

CATEGORY = "PipeTrainer"
