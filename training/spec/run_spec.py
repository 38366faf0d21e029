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

from ..model.launch_settings import LaunchSettings
from .choices import (
    PARTITION_METHODS,
    STREAM_TARGET_PRESETS,
    TARGET_PRESETS,
    TRAIN_DTYPES,
    UNTRAINABLE_TRAIN_DTYPES,
    UNTRAINABLE_WEIGHT_DTYPES,
    WEIGHT_DTYPES,
    SpecError,
)
from .options import (
    BLOCKS_TO_SWAP_AUTO,
    CacheItem,
    LoraSpec,
    ModelRecipe,
    OptimizerSpec,
    RegularizationSpec,
    SamplingOverride,
    TimestepSpec,
    TrainSpec,
    ValidationSpec,
)

SPEC_VERSION = 2


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
    # Where every save's LoRA also goes, named by run and step, so the stock LoraLoader lists it (a
    # subfolder of ComfyUI's loras folder, resolved by the node layer); empty: the run dir only.
    step_loras_dir: str = ""
    version: int = SPEC_VERSION
    # Options of the model's family (e.g. Flux guidance), checked against the family's typed options
    # by training.pipelines.options; JSON scalars only.
    family_options: dict[str, Any] = field(default_factory=dict)
    # How the ComfyUI process was launched (attention, precision, memory flags) and the run's GPUs;
    # the ranks apply it before ComfyUI loads (training/model/launch_settings.py). Not in training_hash.
    launch: LaunchSettings = LaunchSettings()
    # The held-out set and how often it is evaluated; not in training_hash (it never changes the weights).
    validation: ValidationSpec = ValidationSpec()
    # Regularization images mixed in by micro-batch; in training_hash only when on.
    regularization: RegularizationSpec = RegularizationSpec()

    # ---- validation -------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every problem with this spec, phrased as what to change."""
        out: list[str] = []
        t, o, lo = self.train, self.optimizer, self.lora
        if self.model.weight_dtype in UNTRAINABLE_WEIGHT_DTYPES:
            out.append(f"weight_dtype {self.model.weight_dtype!r} cannot train: "
                       f"{UNTRAINABLE_WEIGHT_DTYPES[self.model.weight_dtype]}.")
        elif self.model.weight_dtype not in WEIGHT_DTYPES:
            out.append(f"weight_dtype {self.model.weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}.")
        if not self.items:
            out.append("The cache has no items: add captioned images to the dataset folder.")
        out += list(dict.fromkeys(p for item in self.items for p in item.caption_problems()))
        if lo.rank < 1:
            out.append(f"LoRA rank must be at least 1 (got {lo.rank}).")
        if lo.alpha <= 0:
            out.append(f"LoRA alpha must be positive (got {lo.alpha}).")
        if not 0.0 <= lo.dropout < 1.0:
            out.append(f"LoRA dropout must be in [0, 1) (got {lo.dropout}).")
        if lo.targets not in (*TARGET_PRESETS, *STREAM_TARGET_PRESETS):
            out.append(f"LoRA target preset {lo.targets!r} is not one of "
                       f"{', '.join((*TARGET_PRESETS, *STREAM_TARGET_PRESETS))}.")
        out += lo.problems()
        if lo.adapter != "lora" and o.lora_plus_ratio > 1:
            out.append(f"LoRA+ (lora_plus_ratio {o.lora_plus_ratio:g}) speeds up LoRA's lora_B; adapter type "
                       f"{lo.adapter} has no such matrix: set lora_plus_ratio to 0.")
        out += o.problems(steps=t.steps)
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
        out += t.timesteps.problems()
        if t.dtype in UNTRAINABLE_TRAIN_DTYPES:
            out.append(f"Training dtype {t.dtype!r} is not supported: {UNTRAINABLE_TRAIN_DTYPES[t.dtype]}.")
        elif t.dtype not in TRAIN_DTYPES:
            out.append(f"Training dtype {t.dtype!r} is not one of {', '.join(TRAIN_DTYPES)}.")
        if t.pipeline_stages < 1:
            out.append(f"Pipeline stages must be at least 1 (got {t.pipeline_stages}).")
        if t.data_parallel < 1:
            out.append(f"Data-parallel replicas must be at least 1 (got {t.data_parallel}).")
        if t.checkpoint_interval < 1:
            out.append(f"Activation checkpoint interval must be at least 1 layer (got {t.checkpoint_interval}).")
        if t.blocks_to_swap == BLOCKS_TO_SWAP_AUTO:
            out.append("blocks_to_swap is auto (-1), which the Train node turns into a number from its memory plan "
                       "before the run starts: a spec written another way needs a number (0 turns block swap off).")
        elif t.blocks_to_swap < 0:
            out.append(f"blocks_to_swap must be >= 0, or -1 for auto in the Train node (0 turns block swap off; "
                       f"got {t.blocks_to_swap}).")
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
        if self.step_loras_dir and not Path(self.step_loras_dir).is_absolute():
            out.append(f"step_loras_dir must be an absolute path or empty (got {self.step_loras_dir!r}).")
        if self.lora_output and not self.lora_output.endswith(".safetensors"):
            out.append(f"lora_output must end in .safetensors (got {self.lora_output!r}).")
        if self.version != SPEC_VERSION:
            out.append(f"Spec version {self.version} is not supported (expected {SPEC_VERSION}).")
        out += self.launch.problems(self.device, self.world_size)
        out += self.validation.problems()
        out += self.regularization.problems()
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
        if model.get("sampling"):
            sampling = dict(model["sampling"])
            model["sampling"] = SamplingOverride(
                base=sampling["base"], prediction=sampling["prediction"],
                parameters=tuple((str(k), float(v)) for k, v in sampling["parameters"]),
                probe=tuple(float(v) for v in sampling["probe"]))
        train = dict(d.pop("train"))
        train["timesteps"] = TimestepSpec(**train.get("timesteps", {}))
        opt = dict(d.pop("optimizer"))
        opt["betas"] = tuple(opt.get("betas", (0.9, 0.999)))
        d["launch"] = LaunchSettings.from_dict(d.get("launch", {}))
        validation = dict(d.pop("validation", {}))
        validation["items"] = tuple(CacheItem(**i) for i in validation.get("items", ()))
        d["validation"] = ValidationSpec(**validation)
        regularization = dict(d.pop("regularization", {}))
        regularization["items"] = tuple(CacheItem(**i) for i in regularization.get("items", ()))
        d["regularization"] = RegularizationSpec(**regularization)
        return cls(
            model=ModelRecipe(**model),
            items=tuple(CacheItem(**i) for i in d.pop("items")),
            lora=LoraSpec(**d.pop("lora")),
            optimizer=OptimizerSpec(**opt),
            train=TrainSpec(**train),
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
        # blocks_to_swap moves weights, never changes them: runs with and without it continue each other.
        train = {k: v for k, v in d["train"].items() if k not in ("steps", "save_every", "blocks_to_swap")}
        if train["timesteps"]["loss_weighting"] == "none":  # as before the option existed: old hashes hold
            train["timesteps"] = {k: v for k, v in train["timesteps"].items() if k != "loss_weighting"}
        keep = {
            "model": {**{k: d["model"][k] for k in ("loader", "weight_dtype", "fingerprint", "sampling")},
                      "loras": [(Path(p).name, s) for p, s in d["model"]["loras"]]},
            "family_options": d["family_options"],
            "items": [(i["latent_key"] or i["latent_file"].rsplit("/", 1)[-1],
                       i["text_key"] or i["text_file"].rsplit("/", 1)[-1], *_caption_options(i)) for i in d["items"]],
            "lora": _hashed_lora(d["lora"]),
            "optimizer": d["optimizer"],
            "train": train,
        }
        if self.regularization.enabled:  # left out when off, so runs without it keep their hashes
            reg = d["regularization"]
            keep["regularization"] = {
                "items": [(i["latent_key"] or i["latent_file"].rsplit("/", 1)[-1],
                           i["text_key"] or i["text_file"].rsplit("/", 1)[-1]) for i in reg["items"]],
                "weight": reg["weight"], "ratio": reg["ratio"]}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


# LoraSpec fields added after runs were already saved: at these values they are left out of the
# training hash, so a checkpoint of an older run (which trained exactly that) still continues.
_LORA_FIELDS_HASHED_WHEN_CHANGED = {"adapter": "lora", "factor": -1, "blocks": "", "init_lora_digest": ""}
# The file's dtype is not the trained weights; an init LoRA counts by its content digest, not its path.
_LORA_FIELDS_NOT_HASHED = ("save_dtype", "init_lora")


def _caption_options(item: dict[str, Any]) -> tuple:
    """An item's caption options for the training hash; none when off, so older runs keep their hash."""
    if not (item.get("text_variants") or item.get("caption_dropout")):
        return ()
    return (list(item.get("text_variants") or ()), item.get("empty_text_key", ""), item.get("caption_dropout", 0.0))


def _hashed_lora(lora: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in lora.items()
            if k not in _LORA_FIELDS_NOT_HASHED and _LORA_FIELDS_HASHED_WHEN_CHANGED.get(k, object()) != v}
