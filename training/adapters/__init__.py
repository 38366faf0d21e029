"""Adapter types and LoRA files: the type registry (``kinds``: LoRA, LoKr, LoHa), injection into stage
layers with PEFT (``inject``), ComfyUI's key for each weight (``keys``), writing the file (``lora_file``),
continuing from a file (``init_lora``), the ``blocks`` range, parameter counts for the disk estimate
(``size``) and the preflight checks against a model (``problems``).

May import ``spec``, ``pipelines`` (targets), ``quant`` and torch/PEFT (PEFT only inside functions, so the
node layer can read the registry, ``block_range`` and ``size`` without it). An adapter type is one entry
in ``kinds``.
"""
