"""The run spec: the one frozen, validated, JSON round-trippable value that crosses from the node layer to
the training process.

``choices`` names every option's allowed values, ``options`` holds one dataclass per spec part (model
recipe, cache item, LoRA, optimizer, timesteps, train, validation, regularization), ``run_spec`` the whole
run with the checks that span parts and the training hash. Pure Python: may import only the standard
library and other pure-Python modules of the pack (``model.launch_settings``, ``adapters.block_range``).
"""
