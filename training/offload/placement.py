"""Put one pipeline stage on its compute device, leaving the swapped blocks' frozen weights in host memory.

Moving the whole stage to the GPU first and offloading the swapped blocks afterwards (what a
``module.to(device)`` before the swapper attaches does) needs the whole stage to fit once, which is
exactly what block swap is for avoiding. Here the swapped blocks are chosen first
(:func:`last_swappable`), everything else goes to the device, and the swapped blocks' frozen
tensors never leave the host: only their trainable (LoRA) parameters move, after injection
(:func:`move_trainable`). The swapper then pins the host tensors and streams them block by block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .stages import blocks_to_swap_problem, is_swappable


def last_swappable(layers: Sequence[nn.Module], blocks_to_swap: int) -> list[nn.Module]:
    """The last ``blocks_to_swap`` swappable layers of one stage, in forward order (raises if too few)."""
    if blocks_to_swap <= 0:
        return []
    candidates = [layer for layer in layers if is_swappable(layer)]
    problem = blocks_to_swap_problem(blocks_to_swap, [len(candidates)])
    if problem:
        raise ValueError(problem)
    return candidates[len(candidates) - blocks_to_swap:]


def place_stage(layers: Sequence[nn.Module], swapped: Sequence[nn.Module], device: torch.device | str) -> None:
    """Move every layer but the swapped ones to ``device``; the swapped ones stay where they are (host)."""
    keep = {id(m) for m in swapped}
    for layer in layers:
        if id(layer) not in keep:
            layer.to(device)


def move_trainable(layers: Sequence[nn.Module], device: torch.device | str) -> int:
    """Put the trainable parameters (LoRA) of ``layers`` on ``device``; return how many moved.

    Each moved parameter is a new ``nn.Parameter`` in its owner module (``.data`` assignment cannot
    cross every pair of devices): collect the parameters for the optimizer after this call.
    """
    moved = 0
    device = torch.device(device)
    for layer in layers:
        for owner in layer.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None and param.requires_grad and param.device != device:
                    owner._parameters[name] = nn.Parameter(param.detach().to(device), requires_grad=True)
                    moved += 1
    return moved
