"""``LoRA Adapter`` and ``Optimizer``: small config nodes that produce frozen spec parts."""

from __future__ import annotations

import os

from comfy_api.latest import io

from ..training.block_range import BlockRangeError, parse_blocks
from ..training.lora_init import file_digest
from ..training.optimizers import missing_package_problem
from ..training.spec import (
    ADAPTER_TYPES,
    OPTIMIZERS,
    SAVE_DTYPES,
    SCHEDULES,
    TARGET_PRESETS,
    LoraSpec,
    OptimizerSpec,
    SpecError,
)
from .types import CATEGORY, LoraConfig, OptimizerConfig


class PipeTrainerLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerLoRA",
            display_name="LoRA Adapter (PipeTrainer)",
            category=CATEGORY,
            inputs=[
                io.Int.Input("rank", default=16, min=1, max=512, tooltip="LoRA rank (size of the low-rank update)."),
                io.Float.Input("alpha", default=16.0, min=0.01, max=1024.0, step=0.01,
                               tooltip="LoRA alpha; the update is scaled by alpha / rank. Free, not tied to rank."),
                io.Float.Input("dropout", default=0.0, min=0.0, max=0.9, step=0.01,
                               tooltip="Dropout on the LoRA input during training."),
                io.Combo.Input("targets", options=list(TARGET_PRESETS), default="attention_mlp",
                               tooltip="Which Linears get LoRA: attention only, attention + MLP, or every "
                                       "Linear of the transformer blocks (the family decides the names)."),
                # New inputs go last (saved workflows store widget values by position) and are optional.
                io.Combo.Input("adapter", options=list(ADAPTER_TYPES), default="lora", optional=True,
                               tooltip="lora: B @ A (low rank). lokr: a Kronecker product of two small matrices "
                                       "(LyCORIS LoKr; fewer parameters, set by factor). loha: the elementwise "
                                       "product of two low-rank products (LyCORIS LoHa). All load in the stock "
                                       "LoraLoader. DoRA is not offered: ComfyUI applies it differently from how "
                                       "it trains. lokr/loha need dropout 0 and no LoRA+, and cannot train on "
                                       "per-layer-quantized (scaled fp8 / mixed precision) models."),
                io.Int.Input("factor", default=-1, min=-1, max=1024, optional=True,
                             tooltip="lokr only: the Kronecker factor (the small matrix is factor x factor); "
                                     "-1 picks one near the square root of each dimension."),
                io.Combo.Input("save_dtype", options=list(SAVE_DTYPES), default="bf16", optional=True,
                               tooltip="dtype of the saved file: bf16 (half the size, what other trainers save) "
                                       "or fp32 (the trained weights exactly). Training is fp32 either way."),
                io.String.Input("blocks", default="", optional=True,
                                tooltip="Only these transformer blocks get adapters; empty = all. Plain numbers "
                                        "count through all block lists in the order they run (Flux: double blocks "
                                        "first, then single blocks continue the count), e.g. '0-9, 20'. "
                                        "'<list>:<range>' uses that list's own numbers, as in the LoRA file's keys, "
                                        "e.g. 'double_blocks:0-9, single_blocks:0-5' (a unique start such as "
                                        "'single:' is enough). A range past the model's blocks is an error that "
                                        "names its block counts."),
                io.Combo.Input("init_lora", options=_init_lora_options(), default="none", optional=True,
                               tooltip="Continue training from this LoRA (from the loras folder) instead of fresh "
                                       "weights. It must be a PipeTrainer-format file for this model, of the same "
                                       "adapter type, rank, alpha, targets and blocks (an error says which to set); "
                                       "training starts from its exact weights."),
            ],
            outputs=[LoraConfig.Output(display_name="lora", tooltip="LoRA settings for Train LoRA.")],
        )

    @classmethod
    def validate_inputs(cls, adapter: str | None = "lora", dropout: float | None = 0.0,
                        factor: int | None = -1, blocks: str | None = "") -> bool | str:
        """The inputs that combine with the adapter type (a linked one has no value yet: :meth:`execute`
        checks). ``factor`` is ignored unless the type is lokr, so switching types never fails on it.
        ``blocks`` syntax only: its range against the model is the Train node's preflight."""
        if adapter is None or dropout is None or factor is None or blocks is None:
            return True
        problems = cls._spec(8, 8.0, dropout, "attention_mlp", adapter, factor, "bf16", blocks).problems()
        return "\n".join(problems) if problems else True

    @classmethod
    def fingerprint_inputs(cls, init_lora: str | None = "none", **_: object) -> object:
        """A LoRA file rewritten under the same name must re-run the node (its digest is in the spec)."""
        path = _init_lora_path(init_lora)
        if not path:
            return ""
        try:
            stat = os.stat(path)
        except OSError:
            return path
        return (path, stat.st_size, stat.st_mtime_ns)

    @staticmethod
    def _spec(rank: int, alpha: float, dropout: float, targets: str, adapter: str, factor: int,
              save_dtype: str, blocks: str = "", init_lora: str = "", init_lora_digest: str = "") -> LoraSpec:
        return LoraSpec(rank=rank, alpha=alpha, dropout=dropout, targets=targets, adapter=adapter,
                        factor=factor if adapter == "lokr" else -1, save_dtype=save_dtype,
                        blocks=_canonical_blocks(blocks), init_lora=init_lora, init_lora_digest=init_lora_digest)

    @classmethod
    def execute(cls, rank: int, alpha: float, dropout: float, targets: str, adapter: str = "lora",
                factor: int = -1, save_dtype: str = "bf16", blocks: str = "",
                init_lora: str = "none") -> io.NodeOutput:
        path = _init_lora_path(init_lora)
        if init_lora and init_lora != "none" and not path:
            raise SpecError([f"init_lora {init_lora!r} is not in ComfyUI's loras folder: refresh the node and "
                             "choose an existing file, or 'none'."])
        spec = cls._spec(rank, alpha, dropout, targets, adapter, factor, save_dtype, blocks, path,
                         file_digest(path) if path else "")
        problems = spec.problems()
        if problems:
            raise SpecError(problems)
        return io.NodeOutput(spec)


def _init_lora_options() -> list[str]:
    import folder_paths

    return ["none", *folder_paths.get_filename_list("loras")]


def _init_lora_path(name: str | None) -> str:
    """The absolute path of the loras-folder file ``name`` ("" for none or a file that is gone)."""
    if not name or name == "none":
        return ""
    import folder_paths

    path = folder_paths.get_full_path("loras", name)
    return os.path.abspath(path) if path else ""


def _canonical_blocks(text: str) -> str:
    """``blocks`` rewritten as ``"0-9, single_blocks:3"`` so spacing never changes the training hash
    (a malformed text is kept as typed: the spec's check reports it)."""
    try:
        return ", ".join(item.text() for item in parse_blocks(text))
    except BlockRangeError:
        return text


class PipeTrainerOptimizer(io.ComfyNode):
    """The optimizer, its learning-rate schedule, LoRA+ and the EMA. Every combination problem is reported
    at once, on the widgets involved, before the graph runs (:meth:`validate_inputs`)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        # New inputs go last (saved workflows store widget values by position) and are optional (an API
        # workflow saved before them still validates, with their defaults).
        return io.Schema(
            node_id="PipeTrainerOptimizer",
            display_name="Optimizer (PipeTrainer)",
            category=CATEGORY,
            inputs=[
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="AdamW",
                               tooltip="AdamW; AdamW8bit (bitsandbytes: less optimizer memory); Adafactor "
                                       "(factored second moments: less memory); Prodigy (estimates its own step "
                                       "size over every stage and replica: learning_rate 1.0); Lion (sign updates: use a 3-10x lower learning rate); CAME; "
                                       "AdamWScheduleFree (no schedule: the saved LoRA is its weight average)."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1.0, step=1e-6,
                               tooltip="Peak learning rate (Prodigy: 1.0)."),
                io.Float.Input("weight_decay", default=0.01, min=0.0, max=1.0, step=0.001,
                               tooltip="Decoupled weight decay on the adapter's matrices (never on 1-D weights)."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100000,
                             tooltip="Steps of linear warm-up to the learning rate: step k runs at (k+1)/warmup_steps "
                                     "of it. Must be fewer than the Train node's steps."),
                io.Combo.Input("schedule", options=list(SCHEDULES), default="constant",
                               tooltip="After warm-up: constant, or decay linearly / along a cosine / along cosines "
                                       "that restart (cycles) down to min_lr_ratio x the rate. Schedule-free "
                                       "optimizers take constant."),
                io.Float.Input("min_lr_ratio", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Where a decaying schedule ends, as a fraction of the learning rate."),
                io.Int.Input("cycles", default=1, min=1, max=1000, optional=True,
                             tooltip="cosine_with_restarts: how many cosine cycles after the warm-up."),
                io.Float.Input("lora_plus_ratio", default=0.0, min=0.0, max=1000.0, step=0.5, optional=True,
                               tooltip="LoRA+: lora_B learns at this multiple of the learning rate (16 is usual). "
                                       "0 or 1 = off. Not with Prodigy."),
                io.Float.Input("ema_decay", default=0.0, min=0.0, max=0.99999, step=0.0001, optional=True,
                               tooltip="Also save an exponential moving average of the adapter weights as "
                                       "<name>_ema.safetensors next to the LoRA (0.999 is usual). 0 = off."),
            ],
            outputs=[OptimizerConfig.Output(display_name="optimizer", tooltip="Optimizer settings for Train LoRA.")],
        )

    @classmethod
    def validate_inputs(cls, optimizer: str | None = None, learning_rate: float | None = None,
                        schedule: str | None = None, min_lr_ratio: float | None = 0.0, cycles: int | None = 1,
                        lora_plus_ratio: float | None = 0.0, ema_decay: float | None = 0.0) -> bool | str:
        """The inputs that combine: ComfyUI attaches the one message to each of them (and skips its own
        range and choice checks of them, which :meth:`OptimizerSpec.problems` makes). A linked input has no
        value yet (None): then :meth:`execute` checks; an absent optional one has its default.
        warmup_steps against the run's steps: the Train node."""
        values = (optimizer, learning_rate, schedule, min_lr_ratio, cycles, lora_plus_ratio, ema_decay)
        if any(v is None for v in values):
            return True
        spec = OptimizerSpec(name=optimizer, lr=learning_rate, schedule=schedule, min_lr_ratio=min_lr_ratio,
                             cycles=cycles, lora_plus_ratio=lora_plus_ratio, ema_decay=ema_decay)
        problems = spec.problems()
        missing = missing_package_problem(optimizer)
        if missing:
            problems.append(missing)
        return "\n".join(problems) if problems else True

    @classmethod
    def execute(cls, optimizer: str, learning_rate: float, weight_decay: float, warmup_steps: int,
                schedule: str, min_lr_ratio: float = 0.0, cycles: int = 1, lora_plus_ratio: float = 0.0,
                ema_decay: float = 0.0) -> io.NodeOutput:
        spec = OptimizerSpec(name=optimizer, lr=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps,
                             schedule=schedule, min_lr_ratio=min_lr_ratio, cycles=cycles,
                             lora_plus_ratio=lora_plus_ratio, ema_decay=ema_decay)
        problems = spec.problems()
        if problems:
            raise SpecError(problems)
        return io.NodeOutput(spec)
