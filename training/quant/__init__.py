"""Quantized base models: what a file holds (:mod:`.formats`), ComfyUI's quantized layer types and
the LoRA for layers PEFT cannot wrap (:mod:`.layers`), and host-specific guards (:mod:`.guards`)."""
