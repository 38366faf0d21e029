"""``Load Checkpoint (PipeTrainer)``: the stock checkpoint loader plus a replayable recipe for its MODEL.

Why a loader variant rather than recognising the stock node's MODEL: ComfyUI 0.3.x records nothing
on a MODEL about the file it came from, so only a node that loads it can say how to rebuild it (on
ComfyUI >= 0.23 the stock loaders' MODELs are recognised too: nodes/model_source.py ``recipe_of``).
The variant has the stock node's inputs and outputs, so a graph reads the same and its CLIP and VAE
feed the caching and sampling nodes as usual; only the MODEL carries the recipe (the training process
loads the diffusion model alone from the same file, with ComfyUI's same loader).
"""

from __future__ import annotations

import comfy.sd
import folder_paths
from comfy_api.latest import io

from ..training.model.fingerprint import file_fingerprint
from ..training.model.model_source import model_options
from ..training.model.page_out import paging_out_while_loading
from ..training.spec.choices import WEIGHT_DTYPES
from ..training.spec.options import ModelRecipe
from .model_source import attach_recipe
from .run.held_weights import attach_reload
from .types import CATEGORY


class PipeTrainerLoadCheckpoint(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerLoadCheckpoint",
            display_name="Load Checkpoint (PipeTrainer)",
            category=CATEGORY,
            description="Loads an all-in-one checkpoint exactly like the stock Load Checkpoint and remembers how, "
                        "so the training process can load the same diffusion model the same way.",
            inputs=[
                io.Combo.Input("ckpt_name", options=folder_paths.get_filename_list("checkpoints"),
                               tooltip="A file in models/checkpoints (same list as Load Checkpoint)."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                               tooltip="Storage dtype of the frozen diffusion-model weights; fp8 halves memory. "
                                       "'default' keeps what the file holds (fp8 and scaled-fp8 files stay fp8)."),
            ],
            outputs=[
                io.Model.Output(tooltip="The diffusion model, usable by every stock node and by Train LoRA."),
                io.Clip.Output(tooltip="The checkpoint's text encoder (for caching text and for sampling)."),
                io.Vae.Output(tooltip="The checkpoint's VAE (for caching latents and for decoding)."),
            ],
        )

    @classmethod
    def execute(cls, ckpt_name: str, weight_dtype: str) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("checkpoints", ckpt_name)
        options = model_options(weight_dtype)
        with paging_out_while_loading():  # the diffusion model's part of the file is held once, not twice
            model, clip, vae = comfy.sd.load_checkpoint_guess_config(
                path, output_vae=True, output_clip=True, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                model_options=options)[:3]
        if model is None:
            raise ValueError(f"ComfyUI found no diffusion model in {ckpt_name}.")
        # the MODEL alone, as ComfyUI's own reload factory loads it (its copy is freed while training runs)
        attach_reload(model, comfy.sd.load_checkpoint_guess_config, (path, False, False, False, None, True, options), 0)
        attach_recipe(model, ModelRecipe("checkpoint", path, weight_dtype, file_fingerprint(path)))
        return io.NodeOutput(model, clip, vae)
