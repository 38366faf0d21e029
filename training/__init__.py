"""The training process: spec, supervisor, ranks, engine, loss and LoRA saving.

Imports ComfyUI's model code (``comfy.*``) but never its server. Submodules are imported on demand so
that the node layer can read :mod:`training.spec` and :mod:`training.events` without torch.
"""
