"""Which checkpoint a Train LoRA run continues: the newest one of this LoRA with the same settings, or
one the user picks from a list of every complete checkpoint in the runs folder.

The list is built whenever ComfyUI builds the node's schema (the frontend's node list on load or
refresh, and the check of each queue), as the stock loaders list model files. A checkpoint is listed
once rank 0 has marked it complete (training/loop/resume.py writes the marker after every stage saved), so
listing never reads a run's event log. An entry reads ``<run folder>/step<N>``: the run folder's name
starts with the LoRA's name and the run's date and time, which is what a user picks by. Entries are
relative to the runs folder, so a queued value can only name a folder inside it.

Whether a picked checkpoint may go on with the node's settings is decided by training/loop/resume.py's
:func:`check_resume` (refused, or allowed with warnings); the node asks before it starts any process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...training.loop.resume import SAVED_MARKER, check_resume, checkpoint_step, hash_changes
from ...training.process.events import read_all
from ...training.spec.choices import SpecError
from ...training.spec.run_spec import RunSpec
from . import paths

NEWEST = "newest"
CHECKPOINTS_DIR = "checkpoints"  # training/loop/engine.py's CHECKPOINT_DIR inside each run folder


def checkpoint_choices(runs_root: str) -> list[str]:
    """``newest``, then every complete checkpoint: newest save first."""
    root = Path(runs_root)
    found: list[tuple[float, str]] = []
    if root.is_dir():
        for marker in root.glob(f"*/{CHECKPOINTS_DIR}/*/{SAVED_MARKER}"):
            tag = marker.parent
            try:
                found.append((marker.stat().st_mtime, f"{tag.parent.parent.name}/{tag.name}"))
            except OSError:  # deleted while listing
                continue
    found.sort(key=lambda item: (-item[0], item[1]))
    return [NEWEST, *(name for _, name in found)]


def chosen_checkpoint(choice: str, runs_root: str) -> str:
    """The folder of a listed checkpoint ``<run folder>/step<N>``; raises naming what to do otherwise."""
    run, _, tag = choice.partition("/")
    folder = Path(runs_root) / run / CHECKPOINTS_DIR / tag
    if not run or not tag or "/" in tag or ".." in (run, tag) or not (folder / SAVED_MARKER).is_file():
        raise SpecError([f"resume_from {choice!r} is not a complete checkpoint in {runs_root}: choose one from "
                         "the list (press R in the browser to reload it), or 'newest'."])
    return str(folder)


def _earlier_runs(name: str, runs_root: str):
    """``(spec, newest existing checkpoint)`` of each earlier run of this LoRA that has one, newest run first."""
    if not os.path.isdir(runs_root):
        return
    stem = paths.lora_stem(name)
    for d in sorted((d for d in os.listdir(runs_root) if d.startswith(stem + "-")), reverse=True):
        run_dir = os.path.join(runs_root, d)
        try:
            earlier = RunSpec.load(os.path.join(run_dir, "spec.json"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        saved = [e["checkpoint"] for e in read_all(run_dir) if e.get("type") == "saved"]
        existing = [c for c in saved if os.path.isdir(c)]
        if existing:
            yield earlier, existing[-1]


def newest_checkpoint(name: str, training_hash: str, runs_root: str) -> str:
    """The newest checkpoint of an earlier run of this LoRA with the same training settings ("" if none)."""
    for earlier, checkpoint in _earlier_runs(name, runs_root):
        if earlier.training_hash() == training_hash:
            return checkpoint
    return ""


def resume_miss_note(name: str, spec: RunSpec, runs_root: str) -> str:
    """Why ``resume`` starts at step 0 although this LoRA has checkpoints: how the newest one's settings differ
    ("" when no earlier run of this LoRA has a checkpoint). Said on the node and in the run log, so a changed
    setting never restarts a run silently."""
    newest = next(iter(_earlier_runs(name, runs_root)), None)
    if newest is None:
        return ""
    earlier, checkpoint = newest
    changes = hash_changes(json.loads(json.dumps(earlier.to_dict())), spec)
    described = [text for _, text, _ in changes] or ["several fields together"]
    refused = [field for field, _, why in changes if why]
    then = (f"Set back {', '.join(refused)} to continue it" if refused else
            "Choose it in resume_from to continue it with these settings (the changes are shown as warnings)")
    where = f"{Path(checkpoint).parent.parent.name}/{Path(checkpoint).name}"
    return (f"resume: no checkpoint of {paths.lora_stem(name)} has these settings, so this run starts at step 0. "
            f"The newest, {where}, differs in {'; '.join(described)}. {then}, or turn resume off to silence this.")


def resume_source(resume: bool, choice: str, name: str, spec: RunSpec, runs_root: str) -> str:
    """The checkpoint folder ``spec`` continues from ("" to start fresh), from the node's two inputs."""
    if not resume:
        return ""
    if not choice or choice == NEWEST:
        return newest_checkpoint(name, spec.training_hash(), runs_root)
    return chosen_checkpoint(choice, runs_root)


def resume_warning(spec: RunSpec) -> str:
    """The warning for continuing ``spec.resume_from`` with changed settings ("" if none); raises
    :class:`SpecError` with the reason when the checkpoint cannot go on with them."""
    if not spec.resume_from:
        return ""
    check = check_resume(spec)
    if check.refused:
        raise SpecError([check.refused])
    return check.warning_text


def earlier_history(checkpoint: str) -> list[dict]:
    """The step and validation events that led to ``checkpoint``, oldest first: its run's up to its step,
    after those of the checkpoint that run continued, and so on back to a fresh start. A resumed run's loss
    curve starts with them, so it shows the whole run. Unreadable links end the walk (what was found stays)."""
    chain: list[list[dict]] = []
    seen: set[str] = set()
    while checkpoint and checkpoint not in seen:
        seen.add(checkpoint)
        step = checkpoint_step(checkpoint)
        run_dir = Path(checkpoint).parent.parent
        if step is None or not run_dir.is_dir():
            break
        chain.append([e for e in read_all(run_dir)
                      if e.get("type") in ("step", "validation") and int(e.get("step", step + 1)) <= step])
        try:
            checkpoint = RunSpec.load(run_dir / "spec.json").resume_from
        except (OSError, ValueError, KeyError, TypeError):
            break
    history: list[dict] = []
    for events in reversed(chain):  # a later run's steps replace an earlier run's from its resumed step on
        first = min((int(e["step"]) for e in events if e["type"] == "step"), default=None)
        history = [e for e in history if first is None or int(e["step"]) < first] + events
    return history
