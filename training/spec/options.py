"""The parts of a run spec, one frozen dataclass per node that makes one: model recipe, cache item, LoRA,
optimizer, timesteps, train settings, validation, regularization.

Each part checks its own fields (``problems``) and names what to change; the run spec
(training/spec/run_spec.py) adds the checks that span parts. Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .choices import (
    ADAPTER_TYPES,
    DECAYING_SCHEDULES,
    LOSS_WEIGHTINGS,
    OPTIMIZERS,
    SAVE_DTYPES,
    SCHEDULE_FREE_OPTIMIZERS,
    SCHEDULES,
    STEP_SIZE_ESTIMATING_OPTIMIZERS,
    TIMESTEP_DISTRIBUTIONS,
    TIMESTEP_SHIFTS,
)


@dataclass(frozen=True)
class ModelRecipe:
    """How the training process rebuilds the exact MODEL the graph loaded, with ComfyUI's own loader."""

    loader: str  # "diffusion_model" | "checkpoint" | "gguf" (training/model/model_source.py replays each)
    path: str
    weight_dtype: str = "default"
    fingerprint: str = ""
    loras: tuple[tuple[str, float], ...] = ()  # (lora file, strength) merged before training
    sampling: SamplingOverride | None = None  # a ModelSampling* node's patch on the graph's MODEL
    extension_path: str = ""  # "gguf": the ComfyUI-GGUF folder the graph's loader ran from


@dataclass(frozen=True)
class SamplingOverride:
    """The ``model_sampling`` object patch of a ModelSamplingSD3 / AuraFlow / Flux node, to replay.

    ``base`` and ``prediction`` name ComfyUI classes in ``comfy.model_sampling`` (e.g.
    ``ModelSamplingDiscreteFlow`` + ``CONST``); ``parameters`` are what ``set_parameters`` takes.
    ``probe`` holds the patched object's sigmas at a few fixed timesteps, so the training process can
    prove that its rebuilt object is the graph's (a class with other parameters fails loudly).
    """

    base: str
    prediction: str
    parameters: tuple[tuple[str, float], ...]
    probe: tuple[float, ...]


@dataclass(frozen=True)
class TimestepSpec:
    """How training draws sigmas (see training/objective/timesteps.py for the exact maps).

    ``distribution`` draws u in (0, 1): ``uniform`` or ``logit_normal`` (sigmoid of N(mean, std)).
    ``shift`` maps u to sigma: ``model`` through the model's own ``model_sampling`` (what its
    samplers use, including a ModelSampling* node in the graph), ``none`` (sigma = u), ``fixed``
    (``time_snr_shift(shift_value, u)``) or ``resolution`` (shift e^mu, mu linear in the image token
    count from ``base_shift`` at 256 tokens to ``max_shift`` at 4096, like ComfyUI's ModelSamplingFlux).
    Sigmas outside ``[sigma_min, sigma_max]`` are redrawn (e.g. one Wan 2.2 expert's range).
    ``loss_weighting`` scales each item's loss by a function of its sigma (flow models only; ``none``:
    every sigma counts alike, as before the option existed).
    """

    distribution: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: str = "model"
    shift_value: float = 3.0
    base_shift: float = 0.5
    max_shift: float = 1.15
    sigma_min: float = 0.0
    sigma_max: float = 1.0
    loss_weighting: str = "none"

    def problems(self) -> list[str]:
        out = []
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            out.append(f"Loss weighting {self.loss_weighting!r} is not one of {', '.join(LOSS_WEIGHTINGS)}.")
        if self.distribution not in TIMESTEP_DISTRIBUTIONS:
            out.append(f"Timestep distribution {self.distribution!r} is not one of {', '.join(TIMESTEP_DISTRIBUTIONS)}.")
        if self.shift not in TIMESTEP_SHIFTS:
            out.append(f"Timestep shift {self.shift!r} is not one of {', '.join(TIMESTEP_SHIFTS)}.")
        if not self.logit_std > 0:
            out.append(f"logit_std must be positive (got {self.logit_std}).")
        if not self.shift_value > 0:
            out.append(f"shift_value must be positive (got {self.shift_value}).")
        if not 0.0 <= self.sigma_min < self.sigma_max <= 1.0:
            out.append(f"sigma_min and sigma_max must satisfy 0 <= sigma_min < sigma_max <= 1 "
                       f"(got {self.sigma_min} and {self.sigma_max}).")
        elif self.sigma_max - self.sigma_min < 0.01:
            out.append(f"The sigma range [{self.sigma_min}, {self.sigma_max}] is narrower than 0.01: widen it.")
        return out


@dataclass(frozen=True)
class CacheItem:
    """One training example: where its cached latent and text embedding are, and where it came from.

    With keys set, ``latent_file``/``text_file`` are the cache's index file and the keys name the
    entries in it (see training/cache); without keys they are plain safetensors files. Items of one
    ``bucket`` share tensor shapes, so a micro-batch draws from one bucket.

    Caption options (training/data/captions.py): ``text_variants`` are the keys of the caption's cached
    tag-shuffled variants (``text_key`` is the first; empty: ``text_key`` only), one drawn per
    micro-batch; with probability ``caption_dropout`` the item trains on ``empty_text_key`` (the
    empty caption's entry) instead.
    """

    latent_file: str
    text_file: str
    source: str
    caption: str
    latent_key: str = ""
    text_key: str = ""
    bucket: str = ""
    text_variants: tuple[str, ...] = ()
    empty_text_key: str = ""
    caption_dropout: float = 0.0

    def __post_init__(self) -> None:  # from JSON: a list; items are hashed (dict keys, sets)
        object.__setattr__(self, "text_variants", tuple(self.text_variants))

    def caption_problems(self) -> list[str]:
        """What is wrong with the item's caption options, phrased as the fix."""
        out = []
        if not 0.0 <= self.caption_dropout <= 1.0:
            out.append(f"caption_dropout is a probability in [0, 1] (got {self.caption_dropout}): fix it on the "
                       "Dataset node.")
        elif self.caption_dropout > 0 and not self.empty_text_key:
            out.append(f"caption_dropout {self.caption_dropout:g} needs the empty caption's cached embedding, "
                       "which this cache lacks: run the Cache node again.")
        if self.text_variants and self.text_variants[0] != self.text_key:
            out.append("A cached item's first tag-shuffle variant is not its text entry: run the Cache node again.")
        return out


@dataclass(frozen=True)
class LoraSpec:
    """The adapter. ``adapter`` is its type (training/adapters/kinds.py); ``factor`` is LoKr's Kronecker
    factor (-1: near the square root of each dimension). ``save_dtype`` is the file's dtype: the
    LoRA Adapter node defaults to bf16 (what other trainers save); a spec without it (written before
    the choice existed) saves fp32, as those runs did. ``blocks`` limits the targets to some transformer
    blocks (training/adapters/block_range.py; empty: all). ``init_lora`` is a LoRA file (absolute path) training
    starts from, ``init_lora_digest`` its content hash (training/adapters/init_lora.py); empty: fresh adapters."""

    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attention_mlp"
    adapter: str = "lora"
    factor: int = -1
    save_dtype: str = "fp32"
    blocks: str = ""
    init_lora: str = ""
    init_lora_digest: str = ""

    def problems(self) -> list[str]:
        out = []
        if self.adapter not in ADAPTER_TYPES:
            out.append(f"Adapter type {self.adapter!r} is not one of {', '.join(ADAPTER_TYPES)}.")
        if self.save_dtype not in SAVE_DTYPES:
            out.append(f"save_dtype {self.save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}.")
        if self.adapter != "lokr" and self.factor != -1:
            out.append(f"factor ({self.factor}) applies to adapter type lokr only: set it to -1.")
        if self.factor != -1 and self.factor < 2:
            out.append(f"LoKr factor must be -1 (automatic) or at least 2 (got {self.factor}).")
        if self.adapter != "lora" and self.dropout > 0:
            out.append(f"dropout ({self.dropout:g}) is LoRA's input dropout; adapter type {self.adapter} has "
                       "none here: set dropout to 0.")
        from ..adapters.block_range import blocks_problems

        out += blocks_problems(self.blocks)
        if self.init_lora and not Path(self.init_lora).is_absolute():
            out.append(f"init_lora must be an absolute path (got {self.init_lora!r}).")
        if self.init_lora and not self.init_lora_digest:
            out.append(f"init_lora {self.init_lora!r} has no content digest: the LoRA Adapter node records it.")
        return out


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer and its schedule (built by training/optim/optimizers.py).

    ``warmup_steps``: step k < warmup_steps runs at (k + 1) / warmup_steps of the rate. Decaying
    schedules end at ``min_lr_ratio`` × the rate; ``cycles`` cosines for ``cosine_with_restarts``.
    ``lora_plus_ratio`` > 1 trains ``lora_B`` at that multiple of the rate (LoRA+; 0 or 1 = off).
    ``ema_decay`` > 0 also saves an exponential moving average of the adapter weights as its own file.
    ``betas``/``eps`` are the Adam family's (Lion and CAME keep their packages' own betas).
    """

    name: str = "AdamW"
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: str = "constant"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    min_lr_ratio: float = 0.0
    cycles: int = 1
    lora_plus_ratio: float = 0.0
    ema_decay: float = 0.0

    def problems(self, steps: int | None = None) -> list[str]:
        """Every problem with these settings, combinations included, phrased as what to change.
        With ``steps`` (the Train node's), also what does not fit into the run."""
        out: list[str] = []
        if self.name not in OPTIMIZERS:
            out.append(f"Optimizer {self.name!r} is not one of {', '.join(OPTIMIZERS)}.")
        if not self.lr > 0:
            out.append(f"Learning rate must be positive (got {self.lr}).")
        if self.weight_decay < 0:
            out.append(f"Weight decay must be >= 0 (got {self.weight_decay}).")
        if self.warmup_steps < 0:
            out.append(f"Warmup steps must be >= 0 (got {self.warmup_steps}).")
        if self.schedule not in SCHEDULES:
            out.append(f"Schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            out.append(f"min_lr_ratio is a fraction of the learning rate, in [0, 1] (got {self.min_lr_ratio}).")
        if self.cycles < 1:
            out.append(f"cycles must be at least 1 (got {self.cycles}).")
        if not (self.lora_plus_ratio == 0 or self.lora_plus_ratio >= 1):
            out.append(f"lora_plus_ratio must be 0 (off) or at least 1: lora_B learns at that multiple of the "
                       f"learning rate (16 is usual; got {self.lora_plus_ratio}).")
        if not 0.0 <= self.ema_decay < 1.0:
            out.append(f"ema_decay must be in [0, 1): 0 turns the EMA off, 0.99-0.9999 are usual (got {self.ema_decay}).")
        if self.name in SCHEDULE_FREE_OPTIMIZERS:
            if self.schedule != "constant":
                out.append(f"{self.name} is schedule-free: it takes no learning-rate schedule (got {self.schedule!r}). "
                           "Set schedule to constant; warmup_steps still applies (the optimizer warms up itself).")
            if self.ema_decay > 0:
                out.append(f"{self.name} already averages its weights (the saved LoRA is that average): "
                           "set ema_decay to 0.")
        if self.name in STEP_SIZE_ESTIMATING_OPTIMIZERS:
            if self.lr != 1.0:
                out.append(f"{self.name} estimates its own step size and wants learning_rate 1.0 (got {self.lr:g}): "
                           "set learning_rate to 1.0.")
            if self.lora_plus_ratio > 1:
                out.append(f"{self.name} takes one learning rate for all weights, so LoRA+ cannot raise lora_B's: "
                           "set lora_plus_ratio to 0, or choose another optimizer.")
        if self.schedule not in DECAYING_SCHEDULES and self.min_lr_ratio > 0:
            out.append(f"min_lr_ratio ({self.min_lr_ratio:g}) applies only to a decaying schedule "
                       f"({', '.join(DECAYING_SCHEDULES)}): choose one, or set min_lr_ratio to 0.")
        if self.schedule != "cosine_with_restarts" and self.cycles > 1:
            out.append(f"cycles ({self.cycles}) applies only to schedule cosine_with_restarts: choose it, "
                       "or set cycles to 1.")
        if steps is not None and steps >= 1:
            if self.warmup_steps and self.warmup_steps >= steps:
                out.append(f"warmup_steps ({self.warmup_steps}) must be fewer than the Train node's steps ({steps}): "
                           "the warm-up would take the whole run. Lower warmup_steps or raise steps.")
            elif self.schedule == "cosine_with_restarts" and self.cycles > steps - self.warmup_steps:
                out.append(f"cycles ({self.cycles}) is more than the {steps - self.warmup_steps} steps after "
                           "warm-up: lower cycles or raise steps.")
        return out


BLOCKS_TO_SWAP_AUTO = -1
"""``TrainSpec.blocks_to_swap`` as the Train node receives it for "auto": the node resolves it into a number
from the memory plan (training/offload/memory_plan.py) before it writes the spec, so ranks never see it."""


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 100
    batch_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    timesteps: TimestepSpec = TimestepSpec()
    save_every: int = 0
    dtype: str = "bf16"  # compute dtype of the frozen base; LoRA weights are always fp32
    gradient_checkpointing: bool = True
    max_grad_norm: float = 1.0  # 0 disables clipping
    pipeline_stages: int = 1
    partition_method: str = "parameters"
    data_parallel: int = 1  # replicas of the whole pipeline; ranks = pipeline_stages * data_parallel
    checkpoint_interval: int = 1  # layers per activation-checkpointed chunk (with gradient_checkpointing)
    # Per stage: the last N blocks keep frozen weights in host memory (training/offload); 0 = off.
    # BLOCKS_TO_SWAP_AUTO (-1) only until the Train node resolves it: a written spec holds a number.
    blocks_to_swap: int = 0


@dataclass(frozen=True)
class ValidationSpec:
    """A held-out set the run evaluates every ``every`` steps (and before the first step of a fresh run)
    at fixed sigmas and fixed noise, so its loss compares across steps and across runs; ``every`` 0: off."""

    items: tuple[CacheItem, ...] = ()
    every: int = 0
    sigmas: int = 4  # noise levels per held-out item

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def problems(self) -> list[str]:
        out = []
        if self.every < 0:
            out.append(f"Validation every_n_steps must be >= 0 (0 = off; got {self.every}).")
        if self.enabled and not self.items:
            out.append("Validation has no held-out items: raise the validation fraction or wire a validation cache.")
        if self.sigmas < 1:
            out.append(f"Validation needs at least 1 noise level per item (got {self.sigmas}).")
        return out


@dataclass(frozen=True)
class RegularizationSpec:
    """Regularization (prior) images: a second cache mixed into training by whole micro-batches.

    Micro-batch ``i`` of each replica is a regularization one when ``floor((i + 1) * ratio)`` exceeds
    ``floor(i * ratio)`` (training/data/regularization.py), so any ``N`` consecutive micro-batches hold
    ``floor(N * ratio)`` or one more of them; their loss is scaled by ``weight``. No items: off.
    """

    items: tuple[CacheItem, ...] = ()
    weight: float = 1.0
    ratio: float = 0.5

    @property
    def enabled(self) -> bool:
        return bool(self.items)

    def problems(self) -> list[str]:
        if not self.enabled:
            return []
        out = []
        if not 0.0 < self.ratio < 1.0:
            out.append(f"Regularization ratio is the share of micro-batches drawn from the regularization images, "
                       f"above 0 and below 1 (got {self.ratio}): 0.5 alternates them with the training images.")
        if not 0.0 <= self.weight <= 100.0:
            out.append(f"Regularization weight scales their loss and must be in [0, 100] (got {self.weight}); "
                       "1.0 weighs them like training images.")
        return out
