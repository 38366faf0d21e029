"""The node layer: thin ComfyUI nodes that validate inputs, build the run spec and follow the run.

One module per node at this level (``model_source``, ``dataset``, ``cache``, ``lora_adapter``, ``optimizer``,
``train``, ...), listed in ``extension``; socket types in ``types``. The machinery they share is in two
sub-packages: ``checks`` (preflight and what the graph did to the MODEL) and ``run`` (starting, following
and stopping the process tree, previews, checkpoints, paths).

Runs in the ComfyUI process: may import ComfyUI's server API and the pure-Python parts of ``training``,
never deepspeed, peft or the training process's torch-heavy modules.
"""
