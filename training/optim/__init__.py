"""The optimiser of one pipeline stage: the optimizer types, LR schedules, LoRA+ and EMA (``optimizers``),
Prodigy's step size over every rank (``prodigy_ranks``) and gradient clipping by the whole LoRA's norm
(``clipping``).

May import torch, ``spec``, ``adapters.kinds`` and ``loop.collectives``.
"""
