"""The training process: everything that runs in the ranks and their supervisor, never in ComfyUI.

Sub-packages, one job each (docs/architecture.md follows one run through them):
``spec`` the run spec (the contract with the node layer), ``process`` the process tree, ``model`` loading and
placing ComfyUI's model, ``pipelines`` one module per model family, ``adapters`` adapter types and LoRA files,
``data`` datasets and micro-batches, ``cache`` the latent/text cache, ``objective`` noise levels and the loss,
``optim`` the optimiser, ``loop`` the training loop on one rank, ``offload`` block swap, ``quant`` quantized bases.

Imports ComfyUI's model code (``comfy.*``) but never its server (``server``, ``nodes``, ``execution``,
``comfy_api``, ``folder_paths``). Submodules are imported on demand: the node layer reads the pure-Python
ones (``spec``, ``process.events``, ``data.dataset``, ...) without torch.
"""
