"""The base model in the training process: replaying the graph's loader (``model_source``), ComfyUI's
environment and launch flags (``comfy_env``, ``launch_settings``, ``launch_apply``), a file's fingerprint,
a ModelSampling node's patch, which layers each stage holds (``partition``) and materialising only
those weights (``stage_weights``).

May import ComfyUI's model code, ``spec``, ``quant`` and ``objective``; never the loop or the process tree.
``fingerprint`` and ``launch_settings`` are pure Python (the node layer uses them).
"""
