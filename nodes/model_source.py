"""``Load Diffusion Model (PipeTrainer)``: the stock diffusion-model loader plus a replayable recipe."""

from __future__ import annotations

import comfy.sd
import folder_paths
from comfy_api.latest import io

from ..training.fingerprint import file_fingerprint
from ..training.model_source import model_options
from ..training.spec import WEIGHT_DTYPES, ModelRecipe
from .types import CATEGORY

RECIPE_KEY = "pipetrainer.recipe"


def attach_recipe(model, recipe: ModelRecipe) -> None:
    """Store the recipe on the ModelPatcher so it survives the clones stock nodes make."""
    model.set_attachments(RECIPE_KEY, recipe)


def recipe_of(model) -> ModelRecipe | None:
    recipe = getattr(model, "attachments", {}).get(RECIPE_KEY)
    if recipe is not None:
        return recipe
    init = getattr(model, "cached_patcher_init", None)  # ComfyUI >= 0.23 records how core loaders built it
    if init and getattr(init[0], "__name__", "") == "load_diffusion_model" and init[1]:
        args = init[1]
        path = args[0]
        return ModelRecipe("diffusion_model", path, "default", file_fingerprint(path))
    return None


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
        model = comfy.sd.load_diffusion_model(path, model_options=model_options(weight_dtype))
        attach_recipe(model, ModelRecipe("diffusion_model", path, weight_dtype, file_fingerprint(path)))
        return io.NodeOutput(model)
