"""bench/gpu.py's measurements: host and pinned memory, the GPU's bf16 peak, and the FLOPs behind MFU.

Kept apart from the case runner (bench/_gpu_cases.py) because these are the figures' definitions, read
against the MFU formula in bench/gpu.py's docstring: ``Flops`` holds F_base, F_lora and F_attn of one
forward and turns them into model and hardware FLOPs per step; :func:`forward_flops` counts them with
forward hooks. Torch is imported inside the functions, so the script parses its arguments and finds the
pack (bench/_pack.py) before anything heavy loads.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

PEAK_TFLOPS = (  # dense bf16 tensor-core peak, by a substring of torch.cuda.get_device_name (first match)
    ("H200 NVL", 835.0), ("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.4),
    ("A100", 312.0),
)


@dataclass
class Flops:
    base: float  # F_base, F_lora, F_attn of one forward (see bench/gpu.py's docstring)
    lora: float
    attn: float

    @property
    def model(self) -> float:
        return 2 * self.base + 3 * self.lora + 3 * self.attn

    @property
    def hardware(self) -> float:
        return 3 * self.base + 4 * self.lora + 4 * self.attn


def host_rss_gib() -> float:
    """The process's resident set now (Linux ``VmRSS``; elsewhere the peak so far)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def pinned_gib() -> dict:
    """Pinned host memory held by torch's allocator (``host_memory_stats``, torch >= 2.7; {} if absent).

    ``owned`` counts cached blocks too, and every block is rounded up to a power of two: the swapped
    weights can need up to twice their size in pinned memory."""
    import torch

    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    if stats_of is None or not torch.cuda.is_available():
        return {}
    try:
        stats = stats_of()
    except RuntimeError:
        return {}
    keys = {"owned": "allocated_bytes.current", "active": "active_bytes.current"}
    return {name: stats[key] / 2**30 for name, key in keys.items() if key in stats}


def peak_tflops(device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def forward_flops(stage, layers, inputs, hidden: int, blocks: int, tokens: int, batch: int) -> Flops:
    """Count F_base and F_lora with forward hooks on every ``nn.Linear`` during one no-grad forward."""
    import torch
    from torch import nn

    names = {id(m): n for n, m in stage.named_modules()}
    sums = {"base": 0.0, "lora": 0.0}

    def count(module, args, _output) -> None:
        if isinstance(module, nn.Linear) and id(module) in names:
            rows = args[0].numel() // module.in_features
            kind = "lora" if (".lora_A." in names[id(module)] or ".lora_B." in names[id(module)]) else "base"
            sums[kind] += 2.0 * rows * module.in_features * module.out_features

    handle = nn.modules.module.register_module_forward_hook(count)
    try:
        with torch.no_grad():
            out = inputs
            for layer in layers:
                out = layer(out)
    finally:
        handle.remove()
    return Flops(sums["base"], sums["lora"], 4.0 * batch * tokens**2 * hidden * blocks)
