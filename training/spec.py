"""The run spec: everything the training process needs, frozen, validated, JSON round-trippable.

The node layer builds a :class:`RunSpec`, writes it to ``<run_dir>/spec.json`` and starts the worker
with that path. Nothing else crosses the process boundary, so the spec is the contract between the
ComfyUI process and the trainer. ``validate`` collects every problem at once instead of failing on the
first, so a user fixes a graph in one go. Pure Python (no torch): the node layer imports it freely.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_VERSION = 1

WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
TRAIN_DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("AdamW", "AdamW8bit")
SCHEDULES = ("constant", "cosine")
TIMESTEP_SAMPLING = ("uniform", "logit_normal", "shift")
TARGET_PRESETS = ("attention", "attention_mlp", "all_linear")
PARTITION_METHODS = ("parameters", "uniform")


class SpecError(ValueError):
    """Raised with every problem found in a spec, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("Invalid training setup:\n- " + "\n- ".join(self.problems))


@dataclass(frozen=True)
class ModelRecipe:
    """How the training process rebuilds the exact MODEL the graph loaded, with ComfyUI's own loader."""

    loader: str  # "diffusion_model": comfy.sd.load_diffusion_model
    path: str
    weight_dtype: str = "default"
    fingerprint: str = ""
    loras: tuple[tuple[str, float], ...] = ()  # (lora file, strength) merged before training


@dataclass(frozen=True)
class CacheItem:
    """One training example: where its cached latent and text embedding are, and where it came from.

    With keys set, ``latent_file``/``text_file`` are the cache's index file and the keys name the
    entries in it (see training/cache); without keys they are plain safetensors files. Items of one
    ``bucket`` share tensor shapes, so a micro-batch draws from one bucket.
    """

    latent_file: str
    text_file: str
    source: str
    caption: str
    latent_key: str = ""
    text_key: str = ""
    bucket: str = ""


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attention_mlp"


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "AdamW"
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: str = "constant"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 100
    batch_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    timestep_sampling: str = "shift"
    save_every: int = 0
    dtype: str = "fp32"
    gradient_checkpointing: bool = True
    max_grad_norm: float = 1.0  # 0 disables clipping
    pipeline_stages: int = 1
    partition_method: str = "parameters"
    data_parallel: int = 1  # replicas of the whole pipeline; ranks = pipeline_stages * data_parallel
    checkpoint_interval: int = 1  # layers per activation-checkpointed chunk (with gradient_checkpointing)
    blocks_to_swap: int = 0  # per stage: the last N blocks keep frozen weights in host memory (training/offload)


@dataclass(frozen=True)
class RunSpec:
    """One training run. Paths are absolute and resolved by the node layer."""

    model: ModelRecipe
    items: tuple[CacheItem, ...]
    lora: LoraSpec
    optimizer: OptimizerSpec
    train: TrainSpec
    run_dir: str
    lora_output: str  # final file, e.g. <ComfyUI>/models/loras/<name>.safetensors
    comfyui_path: str
    device: str = "cpu"  # "cpu" or "cuda"
    parent_pid: int = 0  # the ComfyUI process; the trainer stops if it disappears
    resume_from: str = ""  # a checkpoint directory to continue from
    version: int = SPEC_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- validation -------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every problem with this spec, phrased as what to change."""
        out: list[str] = []
        t, o, lo = self.train, self.optimizer, self.lora
        if self.model.weight_dtype not in WEIGHT_DTYPES:
            out.append(f"weight_dtype {self.model.weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}.")
        if not self.items:
            out.append("The cache has no items: add captioned images to the dataset folder.")
        if lo.rank < 1:
            out.append(f"LoRA rank must be at least 1 (got {lo.rank}).")
        if lo.alpha <= 0:
            out.append(f"LoRA alpha must be positive (got {lo.alpha}).")
        if not 0.0 <= lo.dropout < 1.0:
            out.append(f"LoRA dropout must be in [0, 1) (got {lo.dropout}).")
        if lo.targets not in TARGET_PRESETS:
            out.append(f"LoRA target preset {lo.targets!r} is not one of {', '.join(TARGET_PRESETS)}.")
        if o.name not in OPTIMIZERS:
            out.append(f"Optimizer {o.name!r} is not one of {', '.join(OPTIMIZERS)}.")
        if not o.lr > 0:
            out.append(f"Learning rate must be positive (got {o.lr}).")
        if o.weight_decay < 0:
            out.append(f"Weight decay must be >= 0 (got {o.weight_decay}).")
        if o.warmup_steps < 0:
            out.append(f"Warmup steps must be >= 0 (got {o.warmup_steps}).")
        if o.schedule not in SCHEDULES:
            out.append(f"Schedule {o.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if t.steps < 1:
            out.append(f"Steps must be at least 1 (got {t.steps}).")
        if t.batch_size < 1:
            out.append(f"Batch size must be at least 1 (got {t.batch_size}).")
        if t.grad_accum < 1:
            out.append(f"Gradient accumulation must be at least 1 (got {t.grad_accum}).")
        if t.save_every < 0:
            out.append(f"save_every must be >= 0 (0 = only at the end; got {t.save_every}).")
        if t.max_grad_norm < 0:
            out.append(f"max_grad_norm must be >= 0 (0 disables clipping; got {t.max_grad_norm}).")
        if t.timestep_sampling not in TIMESTEP_SAMPLING:
            out.append(
                f"Timestep sampling {t.timestep_sampling!r} is not one of {', '.join(TIMESTEP_SAMPLING)}."
            )
        if t.dtype not in TRAIN_DTYPES:
            out.append(f"Training dtype {t.dtype!r} is not one of {', '.join(TRAIN_DTYPES)}.")
        if t.pipeline_stages < 1:
            out.append(f"Pipeline stages must be at least 1 (got {t.pipeline_stages}).")
        if t.data_parallel < 1:
            out.append(f"Data-parallel replicas must be at least 1 (got {t.data_parallel}).")
        if t.checkpoint_interval < 1:
            out.append(f"Activation checkpoint interval must be at least 1 layer (got {t.checkpoint_interval}).")
        if t.blocks_to_swap < 0:
            out.append(f"blocks_to_swap must be >= 0 (0 turns block swap off; got {t.blocks_to_swap}).")
        if t.partition_method not in PARTITION_METHODS:
            out.append(
                f"Partition method {t.partition_method!r} is not one of {', '.join(PARTITION_METHODS)}."
            )
        if self.device not in ("cpu", "cuda"):
            out.append(f"Device {self.device!r} must be 'cpu' or 'cuda'.")
        for name, value in (("run_dir", self.run_dir), ("lora_output", self.lora_output),
                            ("model path", self.model.path), ("comfyui_path", self.comfyui_path)):
            if not value or not Path(value).is_absolute():
                out.append(f"{name} must be an absolute path (got {value!r}).")
        if self.lora_output and not self.lora_output.endswith(".safetensors"):
            out.append(f"lora_output must end in .safetensors (got {self.lora_output!r}).")
        if self.version != SPEC_VERSION:
            out.append(f"Spec version {self.version} is not supported (expected {SPEC_VERSION}).")
        return out

    def validated(self) -> RunSpec:
        """Return self, or raise :class:`SpecError` listing every problem."""
        problems = self.problems()
        if problems:
            raise SpecError(problems)
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the run: every pipeline stage of every data-parallel replica."""
        return self.train.pipeline_stages * self.train.data_parallel

    # ---- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        d = dict(data)
        model = dict(d.pop("model"))
        model["loras"] = tuple((str(p), float(s)) for p, s in model.get("loras", ()))
        opt = dict(d.pop("optimizer"))
        opt["betas"] = tuple(opt.get("betas", (0.9, 0.999)))
        return cls(
            model=ModelRecipe(**model),
            items=tuple(CacheItem(**i) for i in d.pop("items")),
            lora=LoraSpec(**d.pop("lora")),
            optimizer=OptimizerSpec(**opt),
            train=TrainSpec(**d.pop("train")),
            **d,
        )

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def training_hash(self) -> str:
        """Hash of what determines the trained weights (not paths, not the step count).

        Two runs with the same training hash can continue each other's checkpoints.
        """
        d = self.to_dict()
        keep = {
            "model": {**{k: d["model"][k] for k in ("loader", "weight_dtype", "fingerprint")},
                      "loras": [(Path(p).name, s) for p, s in d["model"]["loras"]]},
            "items": [(i["latent_key"] or i["latent_file"].rsplit("/", 1)[-1],
                       i["text_key"] or i["text_file"].rsplit("/", 1)[-1]) for i in d["items"]],
            "lora": d["lora"],
            "optimizer": d["optimizer"],
            # blocks_to_swap moves weights, never changes them: runs with and without it continue each other.
            "train": {k: v for k, v in d["train"].items() if k not in ("steps", "save_every", "blocks_to_swap")},
        }
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
