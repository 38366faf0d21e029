"""``Dataset``: a folder of images with same-name .txt captions."""

from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io

from ..training.dataset import CAPTION_POLICIES, DatasetError, scan_dataset
from .types import CATEGORY, Dataset


def resolve_folder(folder: str) -> str:
    """Absolute paths as given; relative ones inside ComfyUI's input folder."""
    folder = folder.strip()
    return folder if os.path.isabs(folder) else os.path.join(folder_paths.get_input_directory(), folder)


class PipeTrainerDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerDataset",
            display_name="Dataset",
            category=CATEGORY,
            inputs=[
                io.String.Input("folder", default="pipetrainer_demo",
                                tooltip="Folder of images with same-name .txt captions; relative paths are "
                                        "inside ComfyUI's input folder."),
                io.Int.Input("resolution", default=512, min=64, max=4096, step=16,
                             tooltip="Training resolution: images are resized to cover it and center-cropped."),
                io.Int.Input("repeats", default=1, min=1, max=1000,
                             tooltip="How many times each image appears per epoch."),
                io.Combo.Input("missing_caption", options=list(CAPTION_POLICIES), default="error",
                               tooltip="Images without a caption: 'error' names them and stops, 'skip' drops "
                                       "them, 'empty' trains them with an empty caption (both reported)."),
            ],
            outputs=[Dataset.Output(display_name="dataset", tooltip="The images and captions to cache."),
                     io.String.Output(display_name="report", tooltip="What was found, skipped or left empty.")],
        )

    @classmethod
    def validate_inputs(cls, folder: str, resolution: int, repeats: int, missing_caption: str) -> bool | str:
        if not folder.strip():
            return "folder is empty: give a folder of captioned images."
        return True

    @classmethod
    def execute(cls, folder: str, resolution: int, repeats: int, missing_caption: str) -> io.NodeOutput:
        try:
            dataset = scan_dataset(resolve_folder(folder), resolution, repeats, missing_caption)
        except DatasetError as exc:
            raise ValueError(str(exc)) from None
        return io.NodeOutput(dataset, dataset.report())
