"""TensorBoard event files in the run dir hold the same per-step numbers as events.jsonl (the source of
truth), written by rank 0 only; without the optional ``tensorboard`` package nothing is written and the
user is told once how to get them. The dev host installs ``tensorboard`` (requirements-dev.lock), so the
first test needs it and fails without it rather than skipping."""

from __future__ import annotations

import sys

import numpy as np
from pipetrainer.tests.helpers import make_spec, run_training
from pipetrainer.training.loop.tensorboard_log import ENABLE_HINT, TensorBoardLog, tensorboard_dir
from pipetrainer.training.process.rank import EXIT_OK
from pipetrainer.training.spec.options import OptimizerSpec


def _scalars(folder, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_run_writes_the_losses_of_its_events_as_tensorboard_scalars(fixture_paths, comfy_root, demo_cache,
                                                                      tmp_path):
    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=4,
                     pipeline_stages=2, gradient_checkpointing=False,
                     optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.0, schedule="cosine"))
    code, events = run_training(spec)
    assert code == EXIT_OK, events
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    folder = tensorboard_dir(spec.run_dir)
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 only, although two ranks trained

    def as_float32(key: str) -> list[tuple[int, float]]:  # TensorBoard stores scalars as float32
        return [(e["step"], float(np.float32(e[key]))) for e in steps]

    assert _scalars(folder, "loss/train") == as_float32("loss")
    assert _scalars(folder, "lr") == as_float32("lr")
    assert len({v for _, v in _scalars(folder, "lr")}) > 1  # the cosine schedule moved: real values, not a constant
    assert all(isinstance(e["grad_norm"], float) and e["grad_norm"] > 0 for e in steps)
    assert _scalars(folder, "grad_norm") == as_float32("grad_norm")
    assert _scalars(folder, "step_time_s") == as_float32("step_time")
    assert not [e for e in events if e["type"] == "notice" and "TensorBoard" in e.get("text", "")]


def test_without_the_package_nothing_is_written_and_the_hint_comes_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what Python does for a package that is not installed
    notes: list[str] = []
    log = TensorBoardLog.open(tmp_path, notes.append)
    for step in (1, 2, 3):
        log.scalars(step, {"loss/train": 0.5})
    log.close()
    assert notes == [ENABLE_HINT] and "pip install tensorboard" in ENABLE_HINT
    assert not log.enabled and not tensorboard_dir(tmp_path).exists()
