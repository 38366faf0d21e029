"""What a checkpoint holds beyond DeepSpeed's files, so a resumed run continues exactly, or refuses.

- Each rank's RNG states (torch CPU, and CUDA on a GPU rank): LoRA dropout draws from them, so
  without them a run resumed at step N drops other activations than an uninterrupted run would. One
  file per rank, because DeepSpeed writes its ``client_state`` once per pipeline stage, from the first
  data-parallel replica only. A fresh run seeds them from the spec's seed (:func:`seed_rank_rngs`).
- The run spec with its training hash: a hand-set ``resume_from`` is checked against it like the
  Train node's automatic resume checks the earlier run's spec.json, and a mismatch names the fields.

A changed setting is one of two kinds (:func:`check_resume`). Some change how training goes on from
the checkpoint but not what its weights are (the learning rate and its schedule, the seed, the data,
the batch): continuing is allowed, with a warning that names them, because "train on with a lower LR"
is a normal thing to want. The others change what the saved weights mean or how they are laid out (the
base model, the LoRA rank, alpha and targets, the optimizer whose state is saved, the stage split):
continuing would load tensors into a model they do not belong to, so it is refused with the reason.
Any field not known to be safe is refused, so a setting added to the training hash later is safe by
default.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..spec.run_spec import RunSpec

SPEC_FILE = "pipetrainer_spec.json"
SAVED_MARKER = "pipetrainer_saved.json"
_MISSING = object()


def seed_rank_rngs(seed: int, rank: int) -> None:
    """Seed this rank's global RNGs (CPU and CUDA) from the run's seed.

    LoRA dropout draws from them, and torch seeds them at random in every new process, so without
    this two runs of one spec drop different activations and a straight run cannot be compared with
    a resumed one. Each rank gets its own stream."""
    torch.manual_seed((seed * 1_000_003 + rank) % (2**63))


def _rng_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rng_rank{rank:05d}.pt"


def save_rng_states(tag_dir: str | Path, rank: int, device: torch.device) -> None:
    """Write this rank's RNG states into the checkpoint folder ``tag_dir`` (atomically)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    path = _rng_file(Path(tag_dir), rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(states, tmp)
    os.replace(tmp, path)


def restore_rng_states(tag_dir: str | Path, rank: int, device: torch.device) -> bool:
    """Restore what :func:`save_rng_states` wrote; False if the checkpoint has none for ``rank``."""
    path = _rng_file(Path(tag_dir), rank)
    if not path.exists():
        return False
    states = torch.load(path, weights_only=True)
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    return True


def save_checkpoint_spec(tag_dir: str | Path, spec: RunSpec) -> None:
    """Record the spec and training hash of the run that writes the checkpoint ``tag_dir``."""
    path = Path(tag_dir) / SPEC_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"training_hash": spec.training_hash(), "spec": spec.to_dict()}, indent=2,
                              sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def write_saved_marker(tag_dir: str | Path, step: int, lora: str) -> None:
    """Mark the checkpoint ``tag_dir`` complete (every stage saved, its LoRA written): the Train node
    lists a checkpoint as a resume choice only with this file, without reading the run's events."""
    path = Path(tag_dir) / SAVED_MARKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "lora": lora}), encoding="utf-8")
    os.replace(tmp, path)


def recorded_spec(checkpoint: str | Path) -> RunSpec | None:
    """The spec of the run that wrote ``checkpoint`` (None when there is no readable record)."""
    try:
        record = _checkpoint_record(Path(checkpoint))
        return RunSpec.from_dict(record[1]) if record else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def apply_changed_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, before: list[dict[str, Any]],
                                  after: list[dict[str, Any]]) -> list[str]:
    """Put the new run's optimizer settings into an optimizer and LR scheduler just loaded from a
    checkpoint; return the names of the settings changed.

    Loading a checkpoint restores each param group's hyperparameters and the scheduler's base LRs as
    they were saved, so without this a continued run with a new LR would silently keep the old one.
    ``before`` and ``after`` are the param groups of fresh optimizers (with their LambdaLR) built from
    the old and the new spec: only what differs between them is the user's change, so state that an
    optimizer keeps in its groups (e.g. an adaptive step size) stays as loaded. The LR of the coming
    step is then the new schedule's value at the loaded step, as the scheduler computes it."""
    groups = optimizer.param_groups
    if not len(groups) == len(before) == len(after):
        raise ValueError(f"The checkpoint's optimizer has {len(groups)} parameter groups, a fresh one "
                         f"{len(after)}: continue with the optimizer settings of the checkpoint's run.")
    changed: set[str] = set()
    for i, (group, old, new) in enumerate(zip(groups, before, after, strict=True)):
        for key, value in new.items():
            if key in ("params", "lr") or old.get(key, _MISSING) == value:
                continue
            group[key] = value
            changed.add(key)
            if key == "initial_lr":
                scheduler.base_lrs[i] = value
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is not None:  # LambdaLR: the (possibly new) schedule at the loaded step
        for group, base, factor in zip(groups, scheduler.base_lrs, lambdas, strict=True):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]
    return sorted("lr" if key == "initial_lr" else key for key in changed)


def _checkpoint_record(checkpoint: Path) -> tuple[str, dict[str, Any]] | None:
    """``(training hash, spec dict)`` of the run that wrote ``checkpoint``: from the checkpoint itself,
    else from the spec.json of the run dir it sits in (``<run>/checkpoints/<tag>``)."""
    own = checkpoint / SPEC_FILE
    if own.is_file():
        record = json.loads(own.read_text(encoding="utf-8"))
        return record["training_hash"], record["spec"]
    run_spec = checkpoint.parent.parent / "spec.json"
    if run_spec.is_file():
        data = json.loads(run_spec.read_text(encoding="utf-8"))
        return RunSpec.from_dict(data).training_hash(), data
    return None


# Fields (paths in the spec's JSON) whose change leaves the checkpoint's weights meaningful: continuing
# is allowed with a warning. A prefix ending in "." covers every field below it.
_MAY_CHANGE = (
    "optimizer.",  # but not optimizer.name (see _REFUSED_BECAUSE): LR, schedule, betas, decay, eps
    "train.seed", "train.batch_size", "train.grad_accum", "train.data_parallel", "train.timesteps.",
    "train.dtype", "train.gradient_checkpointing", "train.checkpoint_interval", "train.max_grad_norm",
    "lora.dropout", "items", "family_options.",
    "regularization", "regularization.",  # data, like items: the regularization images, weight and share
)
# Why a change of these fields makes the checkpoint unusable (checked before _MAY_CHANGE).
_REFUSED_BECAUSE = {
    "model.": "the LoRA was trained on another base model",
    "lora.rank": "the LoRA matrices have another shape",
    "lora.alpha": "the same weights would apply at another scale",
    "lora.targets": "the LoRA sits on other layers",
    "lora.adapter": "the checkpoint holds another adapter type's weights",
    "lora.factor": "the LoKr matrices have another shape",
    "optimizer.name": "the saved optimizer state belongs to another optimizer",
    "train.pipeline_stages": "the checkpoint is split by pipeline stage",
    "train.partition_method": "the checkpoint is split by pipeline stage",
}


def _matches(name: str, pattern: str) -> bool:
    return name.startswith(pattern) if pattern.endswith(".") else name == pattern


@dataclass(frozen=True)
class ResumeCheck:
    """Whether ``spec.resume_from`` may continue into ``spec``: ``refused`` is the reason it may not
    (phrased as what to do), ``warnings`` name the settings that differ but may change."""

    refused: str | None = None
    warnings: tuple[str, ...] = ()
    checkpoint_step: int | None = None

    @property
    def warning_text(self) -> str:
        if not self.warnings:
            return ""
        at = f" (step {self.checkpoint_step})" if self.checkpoint_step is not None else ""
        return (f"continuing checkpoint{at} with changed settings: {'; '.join(self.warnings)}. Training goes "
                "on from that step with the new values.")


def checkpoint_step(checkpoint: str | Path) -> int | None:
    """The step a checkpoint folder (``.../step<N>``) was saved at, or None for another name."""
    name = Path(checkpoint).name
    digits = name[len("step"):]
    return int(digits) if name.startswith("step") and digits.isdigit() else None


def check_resume(spec: RunSpec) -> ResumeCheck:
    """Compare ``spec`` with the settings recorded for ``spec.resume_from`` (see the module docstring)."""
    checkpoint = Path(spec.resume_from)
    step = checkpoint_step(checkpoint)
    if not checkpoint.is_dir():
        return ResumeCheck(f"resume_from {checkpoint} is not a checkpoint folder: point it at a "
                           "<run dir>/checkpoints/step<N> folder, or clear it to start fresh.")
    try:
        record = _checkpoint_record(checkpoint)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return ResumeCheck(f"The training settings of checkpoint {checkpoint} cannot be read ({type(exc).__name__}: "
                           f"{exc}): resume from another checkpoint, or clear resume_from to start fresh.")
    if record is None:
        return ResumeCheck(f"Checkpoint {checkpoint} has no record of its training settings ({SPEC_FILE}, or "
                           "spec.json two folders up), so resuming could mix runs: resume from a checkpoint in "
                           "its run dir, or clear resume_from to start fresh.")
    old_hash, old_spec = record
    warnings = _schedule_warnings(old_spec, spec)
    new_hash = spec.training_hash()
    if old_hash == new_hash:
        return ResumeCheck(None, tuple(warnings), step)
    changes = hash_changes(old_spec, spec)
    if not changes:  # the hash differs, but no single field explains it: do not guess
        changes = [("", "several fields together", "no single field explains the difference")]
    refused = [f"{text} ({why})" for _, text, why in changes if why]
    if refused:
        return ResumeCheck(
            f"Checkpoint {checkpoint} cannot be continued with these settings (its training hash {old_hash}, "
            f"this run's {new_hash}). Differing: {'; '.join(refused)}. Set them back, choose a checkpoint of "
            "a run with these settings in resume_from, or turn resume off to start fresh.", (), step)
    return ResumeCheck(None, tuple(warnings + [text for _, text, _ in changes]), step)


def resume_problem(spec: RunSpec) -> str | None:
    """Why ``spec.resume_from`` cannot continue into ``spec``, phrased as what to do; None if it can
    (possibly with warnings: :func:`check_resume`)."""
    return check_resume(spec).refused


def _schedule_warnings(old: dict[str, Any], new: RunSpec) -> list[str]:
    """Settings outside the training hash that still change how training goes on: the step count,
    where the LR schedule is stretched over it (cosine). With a constant schedule more or fewer steps
    only end the run elsewhere, which needs no warning."""
    before = old.get("train", {}).get("steps")
    if before is None or before == new.train.steps or new.optimizer.schedule == "constant":
        return []
    return [f"train.steps: {before} -> {new.train.steps} (the {new.optimizer.schedule} LR schedule is "
            "recomputed for the new total)"]


def _refused_switch(name: str, before: Any, after: Any) -> str | None:
    """Optimizer settings whose value may change, but not be switched on (or off) mid-run."""
    def on(value: Any, threshold: float) -> bool:
        return isinstance(value, (int, float)) and value > threshold

    if name == "optimizer.lora_plus_ratio" and on(before, 1) != on(after, 1):
        return "LoRA+ on or off changes the optimizer's parameter groups"
    if name == "optimizer.ema_decay" and not on(before, 0) and on(after, 0):
        return "the checkpoint holds no EMA to continue"
    return None


def hash_changes(old: dict[str, Any], new: RunSpec) -> list[tuple[str, str, str]]:
    """``(field, description, why refused or "")`` for each field of :func:`hash_differences`."""
    new_dict = json.loads(json.dumps(new.to_dict()))
    out = []
    for path, before, after in _hash_relevant(old, new, new_dict):
        name = ".".join(path)
        why = next((reason for pattern, reason in _REFUSED_BECAUSE.items() if _matches(name, pattern)), None)
        why = why or _refused_switch(name, before, after)
        if why is None and not any(_matches(name, pattern) for pattern in _MAY_CHANGE):
            why = "a setting not known to be safe to change when continuing"
        out.append((name, _describe(path, before, after), why or ""))
    return out


def hash_differences(old: dict[str, Any], new: RunSpec) -> list[str]:
    """The fields of ``new`` whose value from ``old`` alone would change ``new``'s training hash,
    as ``"optimizer.lr: 0.001 -> 0.002"``. Found by putting each differing value back, so the list
    follows :meth:`RunSpec.training_hash` without repeating which fields it covers."""
    new_dict = json.loads(json.dumps(new.to_dict()))  # tuples as lists, as in the recorded JSON
    return [_describe(path, before, after) for path, before, after in _hash_relevant(old, new, new_dict)]


def _hash_relevant(old: dict[str, Any], new: RunSpec, new_dict: dict[str, Any]):
    """The leaf differences between ``old`` and ``new_dict`` that change ``new``'s training hash."""
    target = new.training_hash()
    for path, before, after in _leaf_differences(old, new_dict, ()):
        trial = copy.deepcopy(new_dict)
        _put(trial, path, before)
        try:
            matters = RunSpec.from_dict(trial).training_hash() != target
        except (ValueError, KeyError, TypeError):
            matters = True
        if matters:
            yield path, before, after


def _leaf_differences(old: Any, new: Any, path: tuple[str, ...]):
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            yield from _leaf_differences(old.get(key, _MISSING), new.get(key, _MISSING), (*path, key))
    elif old != new:
        yield path, old, new


def _put(data: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data[key]
    if value is _MISSING:
        data.pop(path[-1], None)
    else:
        data[path[-1]] = value


def _describe(path: tuple[str, ...], before: Any, after: Any) -> str:
    name = ".".join(path)
    if name == "items":
        n_before = len(before) if isinstance(before, list) else 0
        n_after = len(after) if isinstance(after, list) else 0
        return f"items (the cached dataset: {n_before} -> {n_after} items, other content)"

    def show(value: Any) -> str:
        if value is _MISSING:
            return "(absent)"
        text = json.dumps(value, sort_keys=True)
        return text if len(text) <= 60 else text[:57] + "..."

    return f"{name}: {show(before)} -> {show(after)}"
