"""``Load Diffusion Model (PipeTrainer)``: the stock diffusion-model loader plus a replayable recipe."""

from __future__ import annotations

import comfy.sd
import folder_paths
from comfy_api.latest import io

from ..training.model.fingerprint import file_fingerprint
from ..training.model.model_source import model_options, weight_dtype_of_options
from ..training.model.page_out import paging_out_while_loading
from ..training.spec.choices import WEIGHT_DTYPES
from ..training.spec.options import ModelRecipe
from .run.held_weights import attach_reload
from .types import CATEGORY

RECIPE_KEY = "pipetrainer.recipe"


def attach_recipe(model, recipe: ModelRecipe) -> None:
    """Store the recipe on the ModelPatcher so it survives the clones stock nodes make."""
    model.set_attachments(RECIPE_KEY, recipe)


def recipe_of(model) -> ModelRecipe | None:
    """How the training process can rebuild ``model``: the recipe a PipeTrainer loader attached, or,
    on ComfyUI >= 0.23, what the stock diffusion-model or checkpoint loader recorded; None otherwise."""
    recipe = getattr(model, "attachments", {}).get(RECIPE_KEY)
    if recipe is not None:
        return recipe
    init = getattr(model, "cached_patcher_init", None)  # ComfyUI >= 0.23 records how core loaders built it
    if not init or len(init) < 2 or not init[1]:
        return None
    name, args = getattr(init[0], "__name__", ""), init[1]
    if name == "load_diffusion_model":
        options = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
        return ModelRecipe("diffusion_model", args[0], weight_dtype_of_options(options), file_fingerprint(args[0]))
    if name == "load_checkpoint_guess_config":
        options = args[6] if len(args) > 6 and isinstance(args[6], dict) else {}
        return ModelRecipe("checkpoint", args[0], weight_dtype_of_options(options), file_fingerprint(args[0]))
    return None


def no_recipe_message(model) -> str:
    """What to do with a MODEL the training process cannot rebuild: the loader to use instead."""
    if type(model).__name__ == "GGUFModelPatcher":
        return ("This MODEL comes from ComfyUI-GGUF's 'Unet Loader (GGUF)': use 'Load GGUF Model (PipeTrainer)' "
                "instead (same file, same quantized weights), so the training process can load the same model.")
    return ("The MODEL was not loaded by 'Load Diffusion Model (PipeTrainer)' (a file in models/diffusion_models), "
            "'Load Checkpoint (PipeTrainer)' (an all-in-one file in models/checkpoints) or 'Load GGUF Model "
            "(PipeTrainer)' (a .gguf file, with ComfyUI-GGUF installed): load it with one of them so the training "
            "process can load the same weights.")


class PipeTrainerLoadDiffusionModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerLoadDiffusionModel",
            display_name="Load Diffusion Model (PipeTrainer)",
            category=CATEGORY,
            description="Loads a diffusion model exactly like the stock loader and remembers how, so the "
                        "training process can load the same weights the same way.",
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="A file in models/diffusion_models (same list as Load Diffusion Model)."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                               tooltip="Storage dtype of the frozen base weights; fp8 halves memory. "
                                       "Same choices as the stock loader."),
            ],
            outputs=[io.Model.Output(tooltip="The model, usable by every stock node and by Train LoRA.")],
        )

    @classmethod
    def execute(cls, unet_name: str, weight_dtype: str) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        options = model_options(weight_dtype)
        with paging_out_while_loading():  # the loader holds the model about once, not the mapped file beside it
            model = comfy.sd.load_diffusion_model(path, model_options=options)
        attach_reload(model, comfy.sd.load_diffusion_model, (path, options))  # ComfyUI's copy is freed in training
        attach_recipe(model, ModelRecipe("diffusion_model", path, weight_dtype, file_fingerprint(path)))
        return io.NodeOutput(model)
