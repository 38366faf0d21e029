"""``Load GGUF Model (PipeTrainer)``: ComfyUI-GGUF's ``Unet Loader (GGUF)`` plus a replayable recipe.

The node runs the installed pack's own loader (found among ComfyUI's loaded nodes) and records the
file and the pack's folder: the training process imports that same folder's reader and layers
(training/quant/gguf.py), so the weights stay GGUF-quantized there too. Without ComfyUI-GGUF the node
stays in the menu and says where to get the pack.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..training.model.fingerprint import file_fingerprint
from ..training.quant.gguf import missing_gguf_message
from ..training.spec.options import ModelRecipe
from .model_source import attach_recipe
from .run.held_weights import attach_reload
from .types import CATEGORY

GGUF_NODE = "UnetLoaderGGUF"


def gguf_loader_class():
    """ComfyUI-GGUF's loader node class, or None when the pack is not installed (or failed to load)."""
    import nodes

    return nodes.NODE_CLASS_MAPPINGS.get(GGUF_NODE)


def _gguf_files() -> list[str]:
    try:
        return folder_paths.get_filename_list("unet_gguf")  # the folder key ComfyUI-GGUF registers
    except KeyError:
        return []


class PipeTrainerLoadGGUF(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerLoadGGUF",
            display_name="Load GGUF Model (PipeTrainer)",
            category=CATEGORY,
            description="Loads a .gguf diffusion model with ComfyUI-GGUF's own loader and remembers how, so the "
                        "training process can load the same quantized weights. Needs ComfyUI-GGUF installed.",
            inputs=[io.Combo.Input("unet_name", options=_gguf_files(),
                                   tooltip="A .gguf file in models/unet or models/diffusion_models "
                                           "(same list as Unet Loader (GGUF)).")],
            outputs=[io.Model.Output(tooltip="The GGUF model, usable by every stock node and by Train LoRA.")],
        )

    @classmethod
    def execute(cls, unet_name: str) -> io.NodeOutput:
        loader = gguf_loader_class()
        if loader is None:
            raise RuntimeError(missing_gguf_message("ComfyUI's custom_nodes folder"))
        model = loader().load_unet(unet_name)[0]
        attach_reload(model, loader().load_unet, (unet_name,), 0)  # ComfyUI's copy is freed while training runs
        path = folder_paths.get_full_path_or_raise("unet", unet_name)
        folder = str(Path(inspect.getfile(loader)).resolve().parent)
        attach_recipe(model, ModelRecipe("gguf", path, "default", file_fingerprint(path), extension_path=folder))
        return io.NodeOutput(model)
