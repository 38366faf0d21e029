"""The ComfyUI launch flags that change how a model computes, carried from the ComfyUI process to the ranks.

Users start ComfyUI with flags that pick the attention backend (``--use-flash-attention``), precision
(``--force-fp32``, ``--bf16-unet``, ``--fast``), the GPU (``--cuda-device``) and memory modes. The
training process is a fresh Python that imports ComfyUI's model code, so without these it would quietly
compute differently from the graph that loaded the model. The node layer reads them from
``comfy.cli_args.args`` (never from ``sys.argv``) into a :class:`LaunchSettings` in the spec, so a run
dir reproduces the run; each rank turns them, with :func:`plan_rank_args`, into the values it sets on
its own ``comfy.cli_args.args`` before ``comfy.model_management`` is imported.

Rule for precision (README "Launch settings"): the nodes decide what trains. Train LoRA's
``training_dtype`` is the compute dtype and the loader's ``weight_dtype`` the storage; a ComfyUI
precision flag that asks for something else is set aside for training and the run log says which and
what was used. Attention backends that cannot train here fall back to PyTorch SDPA, also with one line.

Pure Python (no torch, no ComfyUI): the spec, the node layer and the tests import it freely.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# --use-<x> flags of ComfyUI's attention group; "auto" = none given (ComfyUI picks by device).
ATTENTION_FLAGS = {
    "pytorch": "use_pytorch_cross_attention",
    "flash": "use_flash_attention",
    "sage": "use_sage_attention",
    "split": "use_split_cross_attention",
    "quad": "use_quad_cross_attention",
}
ATTENTION_BACKENDS = ("auto", *ATTENTION_FLAGS)
# ComfyUI's attention function names (comfy.ldm.modules.attention) that a flag selects.
ATTENTION_FUNCTIONS = {"attention_pytorch": "pytorch", "attention_flash": "flash", "attention_sage": "sage",
                       "attention_split": "split", "attention_sub_quad": "quad"}
UPCAST_ATTENTION = {"auto": "", "force": "force_upcast_attention", "never": "dont_upcast_attention"}
# ComfyUI's --<x>-unet group: compute dtypes, then fp8 storage dtypes.
UNET_COMPUTE = ("fp32", "fp64", "bf16", "fp16")
UNET_STORAGE = ("fp8_e4m3fn", "fp8_e5m2", "fp8_e8m0fnu")
UNET_PRECISIONS = ("", *UNET_COMPUTE, *UNET_STORAGE)
VRAM_MODES = ("", "gpu_only", "highvram", "normalvram", "lowvram", "novram")
# Modes in which ComfyUI's loader keeps the whole model on the GPU: replayed to a rank, every rank would
# load the whole model onto its GPU, whatever its pipeline stage or blocks_to_swap. The ranks place their
# own stage instead (training/offload/placement.py), so these are never replayed.
WHOLE_MODEL_VRAM_MODES = ("gpu_only", "highvram")
DYNAMIC_VRAM = {"auto": "", "enable": "enable_dynamic_vram", "disable": "disable_dynamic_vram"}  # current ComfyUI
FAST_FP8_MATMUL = "fp8_matrix_mult"  # ComfyUI's fp8 matmul (torch._scaled_mm): no backward
_FAST_NAME = re.compile(r"[a-z0-9_]+")


@dataclass(frozen=True)
class LaunchSettings:
    """The ComfyUI process's launch flags that matter to a training process, plus its GPUs.

    ``gpus`` are device numbers as ComfyUI sees them (after ``--cuda-device`` / ``CUDA_VISIBLE_DEVICES``),
    one per rank in rank order; ``cuda_visible_devices`` is the same devices as CUDA names them, which
    the supervisor gives every rank as ``CUDA_VISIBLE_DEVICES`` (rank r then uses its device r, as
    DeepSpeed expects of LOCAL_RANK). Both are empty on CPU and in specs made outside the Train node
    (then ranks take devices 0..N-1 of whatever is visible).
    """

    attention: str = "auto"
    disable_xformers: bool = False
    upcast_attention: str = "auto"
    unet_precision: str = ""
    force_fp32: bool = False
    force_fp16: bool = False
    fast: tuple[str, ...] = ()
    supports_fp8_compute: bool = False
    deterministic: bool = False
    vram_mode: str = ""
    dynamic_vram: str = "auto"
    reserve_vram_gb: float | None = None
    disable_pinned_memory: bool = False
    disable_smart_memory: bool = False
    cuda_device: str = ""  # --cuda-device as given, for the record (the devices themselves are in gpus)
    cuda_device_order: str = ""  # CUDA_DEVICE_ORDER of the ComfyUI process, so device names mean the same
    gpus: tuple[int, ...] = ()
    cuda_visible_devices: str = ""

    def problems(self, device: str = "cpu", world_size: int = 1) -> list[str]:
        """Every problem, phrased as what to change (``device``/``world_size`` come from the run spec)."""
        out = []
        if self.attention not in ATTENTION_BACKENDS:
            out.append(f"Attention backend {self.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}.")
        if self.upcast_attention not in UPCAST_ATTENTION:
            out.append(f"upcast_attention {self.upcast_attention!r} is not one of {', '.join(UPCAST_ATTENTION)}.")
        if self.unet_precision not in UNET_PRECISIONS:
            out.append(f"unet_precision {self.unet_precision!r} is not one of {', '.join(p or '(none)' for p in UNET_PRECISIONS)}.")
        if self.vram_mode not in VRAM_MODES:
            out.append(f"vram_mode {self.vram_mode!r} is not one of {', '.join(m or '(none)' for m in VRAM_MODES)}.")
        if self.dynamic_vram not in DYNAMIC_VRAM:
            out.append(f"dynamic_vram {self.dynamic_vram!r} is not one of {', '.join(DYNAMIC_VRAM)}.")
        if self.force_fp32 and self.force_fp16:
            out.append("force_fp32 and force_fp16 exclude each other (ComfyUI accepts only one).")
        bad_fast = [f for f in self.fast if not isinstance(f, str) or not _FAST_NAME.fullmatch(f)]
        if bad_fast:
            out.append(f"--fast features must be ComfyUI feature names such as fp16_accumulation (got {bad_fast}).")
        if self.reserve_vram_gb is not None and self.reserve_vram_gb < 0:
            out.append(f"reserve_vram_gb must be >= 0 (got {self.reserve_vram_gb}).")
        if any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in self.gpus):
            out.append(f"gpus must be device numbers >= 0 (got {list(self.gpus)}).")
        elif len(set(self.gpus)) != len(self.gpus):
            out.append(f"gpus lists a device twice ({list(self.gpus)}): each rank needs its own GPU.")
        visible = [d for d in self.cuda_visible_devices.split(",") if d.strip()]
        if len(visible) != len(self.gpus):
            out.append(f"cuda_visible_devices ({self.cuda_visible_devices!r}) must name one device per entry of "
                       f"gpus ({list(self.gpus)}).")
        if self.gpus and device != "cuda":
            out.append(f"gpus {list(self.gpus)} is set but the run trains on {device}: clear gpus.")
        elif self.gpus and len(self.gpus) != world_size:
            out.append(f"gpus lists {len(self.gpus)} device(s) but the run has {world_size} rank(s) "
                       "(pipeline_stages x data_parallel): one GPU per rank.")
        return out

    def as_flags(self) -> list[str]:
        """The ComfyUI command-line flags these settings stand for (for logs and the cluster bundle)."""
        flags = []
        if self.attention != "auto":
            flags.append("--" + ATTENTION_FLAGS.get(self.attention, self.attention).replace("_", "-"))
        if self.disable_xformers:
            flags.append("--disable-xformers")
        if UPCAST_ATTENTION.get(self.upcast_attention):
            flags.append("--" + UPCAST_ATTENTION[self.upcast_attention].replace("_", "-"))
        if self.unet_precision:
            flags.append(f"--{self.unet_precision}-unet")
        flags += [f for f, on in (("--force-fp32", self.force_fp32), ("--force-fp16", self.force_fp16),
                                  ("--supports-fp8-compute", self.supports_fp8_compute),
                                  ("--deterministic", self.deterministic)) if on]
        if self.fast:
            flags += ["--fast", *self.fast]
        if self.vram_mode:
            flags.append("--" + self.vram_mode.replace("_", "-"))
        if DYNAMIC_VRAM.get(self.dynamic_vram):
            flags.append("--" + DYNAMIC_VRAM[self.dynamic_vram].replace("_", "-"))
        if self.reserve_vram_gb is not None:
            flags += ["--reserve-vram", f"{self.reserve_vram_gb:g}"]
        flags += [f for f, on in (("--disable-pinned-memory", self.disable_pinned_memory),
                                  ("--disable-smart-memory", self.disable_smart_memory)) if on]
        if self.cuda_device:
            flags += ["--cuda-device", self.cuda_device]
        return flags

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchSettings:
        d = dict(data)
        d["fast"] = tuple(str(f) for f in d.get("fast", ()))
        d["gpus"] = tuple(int(g) for g in d.get("gpus", ()))
        if d.get("reserve_vram_gb") is not None:
            d["reserve_vram_gb"] = float(d["reserve_vram_gb"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown launch settings {unknown}: this spec was written by another PipeTrainer version.")
        return cls(**d)


# ---- the node layer: ComfyUI's args -> LaunchSettings -------------------------------------------
def _flag_value(value: Any) -> str:
    return getattr(value, "value", value)  # ComfyUI's enums (PerformanceFeature) carry their flag text


def settings_from_args(args: Any, environ: Mapping[str, str], *, picked_attention: str = "",
                       gpus: tuple[int, ...] = ()) -> LaunchSettings:
    """Read the relevant flags from a ComfyUI ``args`` namespace (duck-typed: 0.3.75 and current).

    ``picked_attention`` is the attention function ComfyUI runs (``optimized_attention.__name__``): when
    no attention flag was given but ComfyUI picked flash or sage, that is what the user gets and what is
    recorded. ``gpus`` are the devices (ComfyUI's numbers) the ranks will use; their CUDA names come
    from the process's ``CUDA_VISIBLE_DEVICES`` when ComfyUI runs under one.
    """
    attention = next((name for name, flag in ATTENTION_FLAGS.items() if getattr(args, flag, False)), "auto")
    if attention == "auto" and ATTENTION_FUNCTIONS.get(picked_attention) in ("flash", "sage"):
        attention = ATTENTION_FUNCTIONS[picked_attention]
    upcast = next((name for name, flag in UPCAST_ATTENTION.items() if flag and getattr(args, flag, False)), "auto")
    unet = next((p for p in UNET_PRECISIONS if p and getattr(args, f"{p}_unet", False)), "")
    if unet == "fp16" and getattr(args, "force_fp16", False):
        unet = ""  # ComfyUI's parser sets fp16_unet for --force-fp16: one flag, recorded once
    vram = next((m for m in VRAM_MODES if m and getattr(args, m, False)), "")
    dynamic = next((name for name, flag in DYNAMIC_VRAM.items() if flag and getattr(args, flag, False)), "auto")
    fast = getattr(args, "fast", None) or ()
    reserve = getattr(args, "reserve_vram", None)
    cuda_device = getattr(args, "cuda_device", None)
    return LaunchSettings(
        attention=attention,
        disable_xformers=bool(getattr(args, "disable_xformers", False)),
        upcast_attention=upcast,
        unet_precision=unet,
        force_fp32=bool(getattr(args, "force_fp32", False)),
        force_fp16=bool(getattr(args, "force_fp16", False)),
        fast=tuple(sorted(str(_flag_value(f)) for f in fast)),
        supports_fp8_compute=bool(getattr(args, "supports_fp8_compute", False)),
        deterministic=bool(getattr(args, "deterministic", False)),
        vram_mode=vram,
        dynamic_vram=dynamic,
        reserve_vram_gb=None if reserve is None else float(reserve),
        disable_pinned_memory=bool(getattr(args, "disable_pinned_memory", False)),
        disable_smart_memory=bool(getattr(args, "disable_smart_memory", False)),
        cuda_device="" if cuda_device is None else str(cuda_device),
        cuda_device_order=environ.get("CUDA_DEVICE_ORDER", ""),
        gpus=tuple(gpus),
        cuda_visible_devices=cuda_names(gpus, environ.get("CUDA_VISIBLE_DEVICES")),
    )


def cuda_names(gpus: tuple[int, ...], visible: str | None) -> str:
    """``gpus`` (ComfyUI's device numbers) as CUDA_VISIBLE_DEVICES entries.

    Under ``CUDA_VISIBLE_DEVICES=1,3`` (what ``--cuda-device`` sets) ComfyUI's device 0 is CUDA's
    device 1: the entries are taken from that list, so a rank given them sees the same GPU.
    """
    entries = [e.strip() for e in visible.split(",")] if visible is not None and visible.strip() else None
    out = []
    for g in gpus:
        if entries is not None and g >= len(entries):
            raise ValueError(f"GPU {g} is not in CUDA_VISIBLE_DEVICES={visible!r}.")
        out.append(entries[g] if entries is not None else str(g))
    return ",".join(out)


# ---- the rank: LaunchSettings -> ComfyUI args for training -------------------------------------
@dataclass(frozen=True)
class RankPlan:
    """What a rank sets on ``comfy.cli_args.args`` (attribute -> value), the attention it trains with,
    and one note per flag it set aside (for the run log)."""

    comfy_args: dict[str, Any]
    attention: str
    notes: tuple[str, ...]


def flash_unusable_reason(device: str, train_dtype: str, flash_installed: bool,
                          capability: tuple[int, int] | None) -> str:
    """Why flash-attn cannot compute this run's attention ("" when it can)."""
    if device != "cuda":
        return f"this run trains on the {device.upper()} and flash-attn runs only on CUDA GPUs"
    if not flash_installed:
        return "the flash-attn package is not installed in this Python ('pip install flash-attn')"
    if train_dtype != "bf16":
        return f"flash-attn computes only in fp16/bf16 and training_dtype is {train_dtype}"
    if capability is not None and tuple(capability) < (8, 0):
        return (f"this GPU (compute capability {capability[0]}.{capability[1]}) is older than flash-attn 2 "
                "supports (8.0, Ampere)")
    return ""


def _attention_plan(settings: LaunchSettings, device: str, train_dtype: str, flash_installed: bool,
                    capability: tuple[int, int] | None) -> tuple[str, list[str]]:
    wanted = settings.attention
    if wanted == "flash":
        reason = flash_unusable_reason(device, train_dtype, flash_installed, capability)
        if reason:
            return "pytorch", [f"flash-attn was requested (ComfyUI --use-flash-attention) but cannot be used for "
                               f"training: {reason}. Training attention uses PyTorch SDPA instead."]
    if wanted == "sage":
        return "pytorch", ["SageAttention was requested (ComfyUI --use-sage-attention) but it has no backward pass, "
                           "so it cannot train. Training attention uses PyTorch SDPA instead (ComfyUI's own "
                           "sampling keeps SageAttention)."]
    return wanted, []


def _precision_notes(settings: LaunchSettings, train_dtype: str, weight_dtype: str) -> list[str]:
    wins = "the Train node's dtype wins over ComfyUI's precision flags; README: Launch settings"
    out = []
    if settings.force_fp32 and train_dtype != "fp32":
        out.append(f"ComfyUI runs with --force-fp32 but training_dtype is {train_dtype}: training computes in "
                   f"{train_dtype} ({wins}).")
    if settings.force_fp16:
        out.append(f"ComfyUI runs with --force-fp16: training computes in {train_dtype}, not fp16 (fp16 cannot "
                   f"train without loss scaling; {wins}).")
    unet = settings.unet_precision
    if unet in UNET_COMPUTE and unet != train_dtype:
        out.append(f"ComfyUI runs with --{unet}-unet but training_dtype is {train_dtype}: training computes in "
                   f"{train_dtype} ({wins}).")
    if unet in UNET_STORAGE and weight_dtype == "default":
        out.append(f"ComfyUI runs with --{unet}-unet, which stores the graph's diffusion model in {unet}; "
                   f"'Load Diffusion Model (PipeTrainer)' has weight_dtype default, so training stores it in "
                   f"{train_dtype}. Choose weight_dtype {unet} on that node to train on {unet} weights.")
    if FAST_FP8_MATMUL in settings.fast:
        out.append(f"ComfyUI runs with --fast {FAST_FP8_MATMUL}: not applied to training, because ComfyUI's fp8 "
                   f"matrix multiply (torch._scaled_mm) has no backward; fp8 weights are cast to {train_dtype}.")
    if settings.supports_fp8_compute:
        out.append("ComfyUI runs with --supports-fp8-compute: not applied to training (fp8 matrix multiplies have "
                   f"no backward); fp8 weights are cast to {train_dtype}.")
    return out


def plan_rank_args(settings: LaunchSettings, *, device: str, train_dtype: str, weight_dtype: str = "default",
                   flash_installed: bool = False, capability: tuple[int, int] | None = None) -> RankPlan:
    """The ComfyUI args a rank sets before importing ``comfy.model_management``, with the notes.

    ``flash_installed`` and ``capability`` (the rank's GPU, None on CPU) are facts of the rank's
    machine, so a cluster machine without flash-attn falls back with a note instead of exiting (ComfyUI
    exits at import when ``--use-flash-attention`` is set and flash-attn is missing).
    """
    attention, notes = _attention_plan(settings, device, train_dtype, flash_installed, capability)
    comfy_args: dict[str, Any] = {"cpu": device == "cpu"}
    comfy_args.update({flag: name == attention for name, flag in ATTENTION_FLAGS.items()})
    comfy_args["disable_xformers"] = settings.disable_xformers
    comfy_args.update({flag: name == settings.upcast_attention for name, flag in UPCAST_ATTENTION.items() if flag})
    # Loader dtypes are explicit in the training process, so ComfyUI's unet flags cannot change what
    # trains; they are still set so the rank's args mirror ComfyUI's.
    comfy_args.update({f"{p}_unet": p == settings.unet_precision for p in UNET_PRECISIONS if p})
    comfy_args["fp16_unet"] = comfy_args["fp16_unet"] or settings.force_fp16  # as ComfyUI's parser does
    comfy_args["force_fp32"] = settings.force_fp32
    comfy_args["force_fp16"] = settings.force_fp16
    comfy_args["fast"] = tuple(f for f in settings.fast if f != FAST_FP8_MATMUL)
    comfy_args["supports_fp8_compute"] = False
    comfy_args["deterministic"] = settings.deterministic
    if device == "cuda":  # on CPU, ComfyUI's --cpu is the memory mode
        replayed = "" if settings.vram_mode in WHOLE_MODEL_VRAM_MODES else settings.vram_mode
        comfy_args.update({m: m == replayed for m in VRAM_MODES if m})
        if replayed != settings.vram_mode:
            flag = "--" + settings.vram_mode.replace("_", "-")
            notes.append(f"ComfyUI runs with {flag}; the training ranks do not: it would put the whole model on "
                         "every rank's GPU, whatever the pipeline stages and blocks_to_swap. Each rank places only "
                         "its own stage on its GPU.")
        comfy_args.update({flag: name == settings.dynamic_vram for name, flag in DYNAMIC_VRAM.items() if flag})
    comfy_args["reserve_vram"] = settings.reserve_vram_gb
    comfy_args["disable_pinned_memory"] = settings.disable_pinned_memory
    comfy_args["disable_smart_memory"] = settings.disable_smart_memory
    notes += _precision_notes(settings, train_dtype, weight_dtype)
    return RankPlan(comfy_args, attention, tuple(notes))
