"""TensorBoard event files in ``<run_dir>/tensorboard/``: the run's numbers in a viewer users know.

``events.jsonl`` stays the source of truth (the Train node and the tests read it); this writes the same
per-step values a second time, for people who follow runs in TensorBoard (``tensorboard --logdir
<ComfyUI>/output/pipetrainer/runs`` shows every run side by side). ``tensorboard`` is an optional
dependency: without it nothing is written and the run log says once how to turn it on, instead of
failing a run over a viewer. Only rank 0 writes: the loss, LR and global grad norm are the same on
every rank, and one writer per run keeps one file per run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"
ENABLE_HINT = ("TensorBoard logs are off because the tensorboard package is not installed: "
               "`pip install tensorboard` in ComfyUI's Python to get them in <run dir>/tensorboard "
               "(events.jsonl has the same numbers).")


def tensorboard_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TENSORBOARD_DIR


class TensorBoardLog:
    """Scalars per step into one SummaryWriter, or nothing when there is no writer."""

    def __init__(self, writer: Any = None):
        self._writer = writer

    @classmethod
    def open(cls, run_dir: str | Path, note: Callable[[str], None]) -> TensorBoardLog:
        """A log writing into ``<run_dir>/tensorboard``; without the package, ``note`` gets the hint once
        and the log writes nothing."""
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it; its absence is the common case)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            note(ENABLE_HINT)
            return cls(None)
        except Exception as exc:  # noqa: BLE001 - a broken optional viewer must not fail a run
            note(f"TensorBoard logs are off: importing tensorboard failed ({type(exc).__name__}: {exc}). "
                 "Reinstall it (`pip install -U tensorboard`) or uninstall it; events.jsonl has the same numbers.")
            return cls(None)
        return cls(SummaryWriter(log_dir=str(tensorboard_dir(run_dir))))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write each value that is not None under its tag at ``step``, then flush, so a run that is
        killed later still has every step it reported."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def images(self, step: int, images: Mapping[str, Any]) -> None:
        """Write each image (an [H, W, 3] uint8 array) under its tag at ``step``, then flush: the Train
        node's previews (nodes/run/previews.py) go beside the rank's scalars, from the ComfyUI process."""
        if self._writer is None:
            return
        for tag, image in images.items():
            self._writer.add_image(tag, image, step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
