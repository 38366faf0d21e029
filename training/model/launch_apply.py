"""The rank's side of the launch settings: set ComfyUI's args as the ComfyUI process had them, and say so.

Called once per rank, after the rank picked its device and before anything imports
``comfy.model_management``. What is set, what was set aside and which attention function ComfyUI then
picked go to the rank's log and (from rank 0, once) to ``events.jsonl`` as ``comfy_args`` and ``note``
events, so the run dir shows how the run computed.
"""

from __future__ import annotations

import importlib.util

import torch

from ..process.events import EventWriter
from ..spec.run_spec import RunSpec
from .comfy_env import attention_in_use, comfy_args_report, use_comfyui
from .launch_settings import RankPlan, plan_rank_args


def apply_launch_settings(spec: RunSpec, rank: int, device: torch.device, events: EventWriter) -> RankPlan:
    """Set ComfyUI's args for this rank from ``spec.launch``; report them; return the plan."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    plan = plan_rank_args(spec.launch, device=spec.device, train_dtype=spec.train.dtype,
                          weight_dtype=spec.model.weight_dtype,
                          flash_installed=importlib.util.find_spec("flash_attn") is not None, capability=capability)
    unknown = use_comfyui(spec.comfyui_path, spec.device, plan.comfy_args)
    notes = list(plan.notes)
    notes += [f"The ComfyUI at {spec.comfyui_path} has no '{name}' option: that launch setting is not applied."
              for name in unknown]
    if plan.attention == "flash":
        from ...patches.comfy_flash_backward import enable_flash_attention_backward

        if not enable_flash_attention_backward():
            notes.append("This torch has no torch.library.custom_op, so ComfyUI could not define its flash-attn op "
                         "and its attention_flash falls back to PyTorch SDPA.")
    attention = attention_in_use()
    effective = comfy_args_report(name for name in plan.comfy_args if name not in unknown)
    flags = " ".join(spec.launch.as_flags()) or "(none)"
    print(f"[pipetrainer] ComfyUI launch settings: {flags}; training attention: {attention}", flush=True)
    for note in notes:
        print(f"[pipetrainer] note: {note}", flush=True)
    if rank == 0:
        events.emit("comfy_args", args=effective, attention=attention, flags=spec.launch.as_flags())
        for note in notes:
            events.emit("note", message=note)
    return plan
