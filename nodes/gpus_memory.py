"""``GPUs & Memory (PipeTrainer)``: where the ranks run and how their memory is spent, apart from Train LoRA.

A single-GPU image LoRA needs none of it, so these settings live on an optional node: pipeline stages,
data-parallel replicas, the GPUs, block swap (``-1`` = auto: the memory plan picks the fewest swapped blocks
that fit), the stage partition and gradient checkpointing. Connected to Train LoRA's ``gpus_and_memory``,
its values are the run's; Train LoRA keeps widgets of the same names so that saved workflows load with their
values, and a value of them that this node overrides is named on the Train node before step 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from comfy_api.latest import io

from ..training.spec.choices import PARTITION_METHODS
from ..training.spec.options import BLOCKS_TO_SWAP_AUTO
from .types import CATEGORY

GpusMemoryConfig = io.Custom("PIPETRAINER_GPUS_MEMORY")


@dataclass(frozen=True)
class GpusMemory:
    """The values of the node, by the names Train LoRA's settings use."""

    pipeline_stages: int = 1
    data_parallel: int = 1
    gpus: str = ""
    blocks_to_swap: int = BLOCKS_TO_SWAP_AUTO
    partition_method: str = "parameters"
    gradient_checkpointing: bool = True
    checkpoint_interval: int = 1

    def merged(self, settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``settings`` with this node's values, and a note for each Train LoRA widget they override."""
        out, notes = dict(settings), []
        for name, value in asdict(self).items():
            own = settings.get(name)
            if own is not None and own != value:
                notes.append(f"{name}: GPUs & Memory's {value!r} is used (Train LoRA's {own!r} is set aside).")
            out[name] = value
        return out, notes


class PipeTrainerGpusMemory(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerGpusMemory",
            display_name="GPUs & Memory (PipeTrainer)",
            category=CATEGORY,
            description="Optional: pipeline stages, GPUs, block swap and checkpointing for Train LoRA.",
            inputs=[
                io.Int.Input("blocks_to_swap", default=BLOCKS_TO_SWAP_AUTO, min=BLOCKS_TO_SWAP_AUTO, max=1024,
                             tooltip="-1 = auto: the fewest blocks kept in CPU memory with which each stage fits "
                                     "its GPU (the plan is shown on Train LoRA). 0 = off, N = the last N blocks."),
                io.Int.Input("pipeline_stages", default=1, min=1, max=64,
                             tooltip="Split the model over this many GPUs (pipeline parallel)."),
                io.Int.Input("data_parallel", default=1, min=1, max=64,
                             tooltip="Copies of the pipeline that split each batch; ranks = stages x copies."),
                io.String.Input("gpus", default="",
                                tooltip="One GPU per rank, e.g. '1,2' (ComfyUI's numbering). Empty: ComfyUI's "
                                        "first GPUs."),
                io.Combo.Input("partition_method", options=list(PARTITION_METHODS), default="parameters",
                               tooltip="Split stages by parameter count or by layer count."),
                io.Boolean.Input("gradient_checkpointing", default=True,
                                 tooltip="Recompute activations in backward: much less memory, ~30% slower."),
                io.Int.Input("checkpoint_interval", default=1, min=1, max=64,
                             tooltip="Layers per recomputed chunk (more: fewer boundaries, more memory)."),
            ],
            outputs=[GpusMemoryConfig.Output(display_name="gpus_and_memory",
                                             tooltip="For Train LoRA's gpus_and_memory input.")],
        )

    @classmethod
    def execute(cls, blocks_to_swap: int, pipeline_stages: int, data_parallel: int, gpus: str,
                partition_method: str, gradient_checkpointing: bool, checkpoint_interval: int) -> io.NodeOutput:
        return io.NodeOutput(GpusMemory(pipeline_stages, data_parallel, gpus.strip(), blocks_to_swap, partition_method,
                                        gradient_checkpointing, checkpoint_interval))
