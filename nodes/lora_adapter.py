"""``LoRA Adapter (PipeTrainer)``: rank, alpha, dropout, targets, adapter type, blocks and init file, as a frozen spec part."""

from __future__ import annotations

import os

from comfy_api.latest import io

from ..training.adapters.block_range import BlockRangeError, parse_blocks
from ..training.adapters.init_lora import file_digest
from ..training.spec.choices import ADAPTER_TYPES, SAVE_DTYPES, STREAM_TARGET_PRESETS, TARGET_PRESETS, SpecError
from ..training.spec.options import LoraSpec
from .node_problems import refuse_once
from .types import CATEGORY, LoraConfig


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
                io.Combo.Input("targets", options=[*TARGET_PRESETS, *STREAM_TARGET_PRESETS], default="attention_mlp",
                               tooltip="Which Linears get LoRA: attention only, attention + MLP, or every "
                                       "Linear of the transformer blocks (the family decides the names)."),
                # New inputs go last (saved workflows store widget values by position) and are optional.
                io.Combo.Input("adapter", options=list(ADAPTER_TYPES), default="lora", optional=True,
                               tooltip="lora: B @ A. lokr / loha: LyCORIS LoKr / LoHa (fewer parameters; dropout "
                                       "0, no LoRA+, not on per-layer-quantized models). All load in the stock "
                                       "LoraLoader. README: LoRA Adapter."),
                io.Int.Input("factor", default=-1, min=-1, max=1024, optional=True,
                             tooltip="lokr only: the Kronecker factor (the small matrix is factor x factor); "
                                     "-1 picks one near the square root of each dimension."),
                io.Combo.Input("save_dtype", options=list(SAVE_DTYPES), default="bf16", optional=True,
                               tooltip="dtype of the saved file: bf16 (half the size, what other trainers save) "
                                       "or fp32 (the trained weights exactly). Training is fp32 either way."),
                io.String.Input("blocks", default="", optional=True,
                                tooltip="Only these transformer blocks get adapters; empty = all. '0-9, 20' "
                                        "counts through all block lists in order; 'double_blocks:0-9, single:0-5'"
                                        " uses a list's own numbers (README: LoRA Adapter)."),
                io.Combo.Input("init_lora", options=_init_lora_options(), default="none", optional=True,
                               tooltip="Continue from this PipeTrainer LoRA (loras folder) instead of fresh "
                                       "weights: same model, adapter type, rank, alpha, targets and blocks (an "
                                       "error says which to set)."),
            ],
            outputs=[LoraConfig.Output(display_name="lora", tooltip="LoRA settings for Train LoRA.")],
        )

    @classmethod
    def validate_inputs(cls, adapter: str | None = "lora", dropout: float | None = 0.0,
                        factor: int | None = -1, blocks: str | None = "") -> bool | str:
        """The inputs that combine with the adapter type (a linked one has no value yet: :meth:`execute`
        checks). ``factor`` is ignored unless the type is lokr, so switching types never fails on it.
        ``blocks`` syntax only: its range against the model is the Train node's preflight. Reported once on
        the node (nodes/node_problems.py)."""
        if adapter is None or dropout is None or factor is None or blocks is None:
            return True
        return refuse_once(cls._spec(8, 8.0, dropout, "attention_mlp", adapter, factor, "bf16", blocks).problems())

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


