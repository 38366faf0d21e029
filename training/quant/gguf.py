"""GGUF models through ComfyUI-GGUF's own reader and layers, imported from the user's custom_nodes folder.

ComfyUI-GGUF is on no package registry: users clone it into ``custom_nodes``. The graph's loader ran
from that folder, and the node layer records it in the recipe. The training process imports only the
pack's model modules (``ops``, ``loader``, ``dequant``: they need torch, ``gguf`` and ComfyUI's model
code) under a private package name, never its node module (which needs ComfyUI's server). The
weights stay ``GGMLTensor`` (quantized bytes) in its ``nn.Linear`` subclasses, which dequantize per
layer in the forward; PEFT's LoRA wraps them like any Linear.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from ...patches.gguf_lean_backward import dequantize_again_in_backward

GGUF_REPO = "https://github.com/city96/ComfyUI-GGUF"
_PACKAGE = "pipetrainer_comfyui_gguf"


def missing_gguf_message(where: str) -> str:
    return (f"ComfyUI-GGUF was not found at {where}. Install it into ComfyUI's custom_nodes folder "
            f"(git clone {GGUF_REPO}, then pip install gguf) and restart ComfyUI.")


def import_gguf_pack(folder: str | Path) -> ModuleType:
    """ComfyUI-GGUF's package (its ``__init__`` not run) from ``folder``; its submodules import from it."""
    folder = Path(folder)
    if not (folder / "ops.py").is_file() or not (folder / "loader.py").is_file():
        raise FileNotFoundError(missing_gguf_message(str(folder)))
    package = sys.modules.get(_PACKAGE)
    if package is None or Path(package.__path__[0]) != folder:
        spec = importlib.util.spec_from_file_location(_PACKAGE, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = package  # the submodules' relative imports resolve through it
    return package


def gguf_module(folder: str | Path, name: str) -> ModuleType:
    import_gguf_pack(folder)
    return importlib.import_module(f"{_PACKAGE}.{name}")


def load_gguf_model(path: str, folder: str, compute_dtype: torch.dtype):
    """A ModelPatcher for a GGUF diffusion model, built as ComfyUI-GGUF's ``UnetLoaderGGUF`` builds it.

    Same reader (``gguf_sd_loader``), same operations (``GGMLOps``, default dequant/patch dtypes) and
    ComfyUI's ``load_diffusion_model_state_dict``; ``dtype`` is the compute dtype, which is what the
    non-quantized weights (norms, biases) are stored in.
    """
    import comfy.sd

    ops_module, loader = gguf_module(folder, "ops"), gguf_module(folder, "loader")
    ops = ops_module.GGMLOps()
    ops.Linear.dequant_dtype = None
    ops.Linear.patch_dtype = None
    sd = loader.gguf_sd_loader(path)
    for tensor in sd.values():  # the mark makes its layer add a meta "temp.weight" (a VRAM estimate) to
        if getattr(tensor, "is_largest_weight", False):  # every state_dict, which checkpoint saving cannot copy
            tensor.is_largest_weight = False
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops,
                                                                          "dtype": compute_dtype})
    if patcher is None:
        raise ValueError(f"ComfyUI could not detect the model type of {path}.")
    dequantize_again_in_backward(patcher.model.diffusion_model, ops_module.GGMLLayer)
    return patcher
