"""Hardware presets: what another trainer's example config for one model family and GPU size sets.

A family declares its presets (``presets = (Preset(...), ...)`` on its adapter); Train LoRA's ``preset`` input
lists them all and, for a model of that family, takes the preset's values in place of the LoRA Adapter's,
the Optimizer's and its own, naming each value it changed (nodes/presets.py). Each preset names the example
config it follows, so a user can read the original; only settings that config sets for its hardware are
here (rank, optimizer and rate, batch size, checkpointing, compute dtype). Settings this pack plans itself
stay with the user: block swap (``-1`` = auto fits the actual GPU), steps, and the dataset's resolutions,
which the preset only reports because the cache is already built when Train LoRA runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """One example config's settings. ``rank`` is also its alpha (every source config sets them equal);
    ``quantized_base``: how that config stores the frozen base (empty: as loaded)."""

    label: str
    source: str
    rank: int
    lr: float = 1e-4
    optimizer: str = "AdamW8bit"
    batch_size: int = 1
    gradient_checkpointing: bool = True
    training_dtype: str = "bf16"
    quantized_base: str = "8-bit"
    resolutions: tuple[int, ...] = (512, 768, 1024)

    def settings(self) -> dict[str, object]:
        """The Train LoRA settings it sets, by their widget names."""
        return {"batch_size": self.batch_size, "gradient_checkpointing": self.gradient_checkpointing,
                "training_dtype": self.training_dtype}


AI_TOOLKIT = "ai-toolkit's config/examples/{}.yaml"


def ai_toolkit(label: str, config: str, rank: int, **values) -> Preset:
    """A preset following one of ai-toolkit's example configs (adamw8bit, lr 1e-4, batch 1, gradient
    checkpointing and bf16 in all of them unless given)."""
    return Preset(label, AI_TOOLKIT.format(config), rank, **values)
