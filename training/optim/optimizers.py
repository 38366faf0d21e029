"""The optimizer of one pipeline stage: a kept package's optimizer, torch's LR schedules, LoRA+, and an EMA.

- **Optimizers** come from kept packages, never written here: a registry maps the spec's name to a
  builder and to the package that provides it, so adding one is one entry and a missing package is
  named with its pip command before a run starts (:func:`missing_package_problem`).
- **Parameter groups**: matrices decay, 1-D tensors (biases, DoRA magnitudes) never do, and with LoRA+
  the ``lora_B`` matrices learn at ``lora_plus_ratio`` times the learning rate.
- **Schedules** are torch's own schedulers (LinearLR warm-up, then ConstantLR, LinearLR,
  CosineAnnealingLR or CosineAnnealingWarmRestarts, joined by SequentialLR), run on a one-weight probe
  with a learning rate of 1: what they yield is a factor, which a ``LambdaLR`` applies to every group's
  own learning rate. So a min-LR is a fraction of each group's rate (LoRA+ groups included), and a
  checkpoint holds only the step count (``LambdaLR`` keeps no plain function in its state): a resumed
  run continues exactly, on the curve of its own spec, as before.
- **Schedule-free** optimizers train on one sequence of weights and should be used (and saved) at
  another, their average: :meth:`StageOptimizer.lora_weights` swaps those in for the LoRA file and
  puts the training weights back bit for bit, because the optimizer's own eval-to-train switch is not
  an exact round trip and a resumed run must continue from the same bits as an uninterrupted one.
- **EMA** of the trainable weights through ``torch.optim.swa_utils`` (updated after every optimizer
  step), saved as its own LoRA file; its state goes into each checkpoint, one file per rank.
- **Prodigy on several ranks** estimates one step size from the sums over every rank (each pipeline
  stage alone would estimate its own): training/optim/prodigy_ranks.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim import lr_scheduler

from ..adapters.kinds import REGISTRY
from ..spec.choices import SCHEDULE_FREE_OPTIMIZERS
from ..spec.options import OptimizerSpec

# PEFT's names of the factors LoRA+ speeds up (LoRA's up projection, lora_B): every registered
# adapter type's ``up`` factors (training/adapters/kinds.py); types without one get no LoRA+ group.
LORA_PLUS_MARKERS = tuple(m for kind in REGISTRY.values() for m in kind.up_markers())
EMA_SUFFIX = "_ema"


# ---- the registry ---------------------------------------------------------------------------------


def _adamw(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def _adamw8bit(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def _adafactor(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # An external learning rate (the schedule's): Adafactor's own relative step would ignore it.
    return Adafactor(groups, lr=o.lr, weight_decay=o.weight_decay, scale_parameter=False, relative_step=False,
                     warmup_init=False)


def _prodigy(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    from prodigyopt import Prodigy

    # Its authors advise the safeguard with a warm-up: the step-size estimate then ignores the small rates.
    settings = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                    safeguard_warmup=o.warmup_steps > 0)
    summed = _several_ranks()  # the estimate over every rank's parameters (training/optim/prodigy_ranks.py)
    if summed:
        from .prodigy_ranks import RankSummedProdigy

        optimizer = RankSummedProdigy(groups, **settings)
    else:
        optimizer = Prodigy(groups, **settings)
    # A checkpoint from another number of ranks (data_parallel may change on resume) restores its own
    # flag with the groups: this run's layout decides whether the sums are all-reduced.
    optimizer.register_load_state_dict_post_hook(
        lambda opt: [group.__setitem__("fsdp_in_use", summed) for group in opt.param_groups])
    return optimizer


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _lion(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    from pytorch_optimizer import Lion

    return Lion(groups, lr=o.lr, weight_decay=o.weight_decay)  # Lion's own betas, not Adam's


def _came(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    from pytorch_optimizer import CAME

    return CAME(groups, lr=o.lr, weight_decay=o.weight_decay)  # CAME's own three betas


def _adamw_schedule_free(groups: list[dict], o: OptimizerSpec) -> torch.optim.Optimizer:
    import schedulefree

    optimizer = schedulefree.AdamWScheduleFree(groups, lr=o.lr, betas=o.betas, eps=o.eps,
                                               weight_decay=o.weight_decay, warmup_steps=o.warmup_steps)
    optimizer.train()  # it refuses to step before; a loaded checkpoint brings back the same (train) mode
    return optimizer


def _group_lr(group: dict) -> float:
    return float(group["lr"])


@dataclass(frozen=True)
class OptimizerKind:
    """How one optimizer name is built, which import provides it, and what the user installs if it is missing."""

    build: Callable[[list[dict], OptimizerSpec], torch.optim.Optimizer]
    module: str  # a top-level module (find_spec of a submodule would import its package)
    pip: str  # "" = part of torch
    lr_of: Callable[[dict], float] = _group_lr  # the rate it really applies to a group, for the step events


REGISTRY: dict[str, OptimizerKind] = {
    "AdamW": OptimizerKind(_adamw, "torch", ""),
    "AdamW8bit": OptimizerKind(_adamw8bit, "bitsandbytes", "bitsandbytes"),
    "Adafactor": OptimizerKind(_adafactor, "transformers", "transformers"),
    # Prodigy's step is d * lr: d is its estimate of the right step size.
    "Prodigy": OptimizerKind(_prodigy, "prodigyopt", "prodigyopt", lambda g: float(g["d"] * g["lr"])),
    "Lion": OptimizerKind(_lion, "pytorch_optimizer", "pytorch-optimizer"),
    "CAME": OptimizerKind(_came, "pytorch_optimizer", "pytorch-optimizer"),
    # Schedule-free warms up inside the optimizer: "scheduled_lr" is the rate of its last step.
    "AdamWScheduleFree": OptimizerKind(_adamw_schedule_free, "schedulefree", "schedulefree",
                                       lambda g: float(g["scheduled_lr"] or g["lr"])),
}


def missing_package_problem(name: str) -> str | None:
    """What to install when the package of optimizer ``name`` is not importable here; None if it is."""
    kind = REGISTRY.get(name)
    if kind is None or not kind.pip or importlib.util.find_spec(kind.module) is not None:
        return None
    return (f"{name} needs the {kind.pip} package: run 'pip install {kind.pip}' in ComfyUI's Python "
            "(or 'pip install -r requirements.txt' in the PipeTrainer folder), or choose AdamW.")


# ---- parameter groups -----------------------------------------------------------------------------


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], o: OptimizerSpec) -> list[dict]:
    """The optimizer's groups: ``decay`` (matrices), ``lora_plus`` (``lora_B`` at ``lora_plus_ratio`` × lr,
    when on) and ``no_decay`` (1-D tensors: decaying a bias or a DoRA magnitude towards 0 is not a
    regulariser but damage). Empty groups are left out; the order is fixed, so every rank and a resumed
    run get the same groups, and group 0 is always the base learning rate's."""
    decay, plus, flat = [], [], []
    lora_plus = o.lora_plus_ratio > 1
    for name, p in named_params:
        if p.ndim < 2:
            flat.append(p)
        elif lora_plus and any(marker in name for marker in LORA_PLUS_MARKERS):
            plus.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "group": "decay", "weight_decay": o.weight_decay, "lr": o.lr},
        {"params": plus, "group": "lora_plus", "weight_decay": o.weight_decay, "lr": o.lr * o.lora_plus_ratio},
        {"params": flat, "group": "no_decay", "weight_decay": 0.0, "lr": o.lr},
    ]
    return [g for g in groups if g["params"]]


# ---- schedules ------------------------------------------------------------------------------------


def torch_schedule(optimizer: torch.optim.Optimizer, o: OptimizerSpec, total_steps: int) -> lr_scheduler.LRScheduler:
    """``o``'s schedule as torch's own schedulers on ``optimizer``.

    Warm-up: step k < warmup_steps runs at (k + 1) / warmup_steps of the rate (the first step already
    learns; the last warm-up step is at the full rate). Then the main schedule over the remaining
    steps, decaying towards ``min_lr_ratio`` × the rate."""
    warmup = o.warmup_steps
    rest = max(1, total_steps - warmup)
    floor = o.min_lr_ratio
    if o.schedule == "linear":
        main = lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=floor, total_iters=rest)
    elif o.schedule == "cosine":
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=rest, eta_min=floor)
    elif o.schedule == "cosine_with_restarts":
        main = lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=math.ceil(rest / o.cycles), eta_min=floor)
    else:
        main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup <= 1:  # a 1-step warm-up runs its only step at the full rate: no warm-up
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def schedule_factor(o: OptimizerSpec, total_steps: int) -> Callable[[int], float]:
    """The learning-rate factor at each step, computed by :func:`torch_schedule` on a probe whose rate is 1.

    A plain function (a closure), so ``LambdaLR`` keeps it out of checkpoints. Factors are computed on
    demand and remembered: steps only move forward, and a resumed run's first call catches up once."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with warnings.catch_warnings():  # the probe never steps its optimizer, and SequentialLR passes epochs
        warnings.simplefilter("ignore", UserWarning)
        schedule = torch_schedule(probe, o, total_steps)
    factors = [float(probe.param_groups[0]["lr"])]

    def factor(step: int) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            while len(factors) <= step:
                schedule.step()
                factors.append(float(probe.param_groups[0]["lr"]))
        return factors[step]

    return factor


# ---- EMA ------------------------------------------------------------------------------------------


class AdapterEMA:
    """An exponential moving average of the trainable weights, by ``torch.optim.swa_utils``.

    Only those weights are copied (the frozen base is not): ``AveragedModel`` averages a
    ``ParameterList`` that holds the live parameters. The first update copies the weights; each later
    one moves the average towards them by ``1 - decay``."""

    def __init__(self, params: list[nn.Parameter], decay: float):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.decay = decay
        self._live = nn.ParameterList(params)
        self._average = AveragedModel(self._live, multi_avg_fn=get_ema_multi_avg_fn(decay))
        self._average.requires_grad_(False)

    def update(self) -> None:
        self._average.update_parameters(self._live)

    def values(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._average.module.parameters()]

    def state_dict(self) -> dict:
        return self._average.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._average.load_state_dict(state)


def _ema_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"ema_rank{rank:05d}.pt"


def ema_path(lora_path: str | Path) -> Path:
    """Where the EMA LoRA of ``lora_path`` goes: ``<name>_ema.safetensors`` beside it."""
    path = Path(lora_path)
    return path.with_name(f"{path.stem}{EMA_SUFFIX}{path.suffix}")


# ---- one stage's optimizer ------------------------------------------------------------------------


@dataclass
class StageOptimizer:
    """What the engine gets from :func:`build_stage_optimizer`: the optimizer and scheduler it hands
    DeepSpeed, and what saving needs (the schedule-free weights, the EMA)."""

    optimizer: torch.optim.Optimizer
    scheduler: lr_scheduler.LRScheduler
    params: list[nn.Parameter]
    kind: OptimizerKind
    schedule_free: bool
    ema: AdapterEMA | None = None

    def current_lr(self) -> float:
        """The rate the last step applied to group 0 (the base rate's group), as the optimizer sees it."""
        return self.kind.lr_of(self.optimizer.param_groups[0])

    @contextmanager
    def lora_weights(self) -> Iterator[None]:
        """Inside: the parameters hold the weights the LoRA file gets. Schedule-free: the average (the
        optimizer's eval mode, what its authors say to evaluate and save); afterwards the training weights
        are put back bit for bit. Otherwise the training weights themselves."""
        if not self.schedule_free:
            yield
            return
        kept = [p.detach().clone() for p in self.params]
        self.optimizer.eval()
        try:
            yield
        finally:
            self.optimizer.train()
            _copy_into(self.params, kept)  # train() alone does not give back the same bits

    @contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Inside: the parameters hold the EMA; afterwards the training weights, bit for bit."""
        if self.ema is None:
            raise RuntimeError("ema_weights needs ema_decay > 0 on the Optimizer node.")
        kept = [p.detach().clone() for p in self.params]
        _copy_into(self.params, self.ema.values())
        try:
            yield
        finally:
            _copy_into(self.params, kept)

    def save_state(self, tag_dir: str | Path, rank: int) -> None:
        """Write what DeepSpeed's checkpoint lacks (the EMA) into the checkpoint folder, atomically."""
        if self.ema is None:
            return
        path = _ema_file(Path(tag_dir), rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.ema.state_dict(), tmp)
        os.replace(tmp, path)

    def load_state(self, tag_dir: str | Path, rank: int) -> bool:
        """Restore what :meth:`save_state` wrote. False when the EMA is on but the checkpoint has none
        (its run had no EMA): the average then starts from the loaded weights at the next step."""
        if self.ema is None:
            return True
        path = _ema_file(Path(tag_dir), rank)
        if not path.is_file():
            return False
        self.ema.load_state_dict(torch.load(path, weights_only=True, map_location=self.params[0].device))
        return True


def _copy_into(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def build_stage_optimizer(o: OptimizerSpec, named_params: Iterable[tuple[str, nn.Parameter]],
                          total_steps: int) -> StageOptimizer:
    """The optimizer, schedule and EMA for the trainable ``named_params`` of one stage."""
    named = list(named_params)
    if o.name not in REGISTRY:
        raise ValueError(f"Unknown optimizer {o.name!r}: choose one of {', '.join(REGISTRY)}.")
    kind = REGISTRY[o.name]
    groups = param_groups(named, o)
    if o.lora_plus_ratio > 1 and not any(g["group"] == "lora_plus" for g in groups):
        raise ValueError(f"LoRA+ (lora_plus_ratio {o.lora_plus_ratio:g}) found no lora_B weight to speed up on "
                         "this stage: it applies to LoRA adapters only; set lora_plus_ratio to 0.")
    try:
        optimizer = kind.build(groups, o)
    except ImportError as exc:
        raise RuntimeError(missing_package_problem(o.name) or f"{o.name} could not be imported: {exc}") from exc
    schedule_free = o.name in SCHEDULE_FREE_OPTIMIZERS
    # Schedule-free optimizers warm up themselves and take no schedule: the factor stays 1.
    factor = schedule_factor(dataclasses.replace(o, schedule="constant", warmup_steps=0) if schedule_free else o,
                             total_steps)
    scheduler = lr_scheduler.LambdaLR(optimizer, factor)
    params = [p for g in groups for p in g["params"]]
    ema = None
    if o.ema_decay > 0:
        ema = AdapterEMA(params, o.ema_decay)
        optimizer.register_step_post_hook(lambda *_: ema.update())
    return StageOptimizer(optimizer, scheduler, params, kind, schedule_free, ema)

