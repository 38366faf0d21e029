"""What the Train node tells the user while a run starts, trains, stops or ends.

Plain functions over the run's events (training/process/events.py), so they are tested without a server; the
node only sends the texts (ComfyUI's progress text, shown on the node) and draws the curve. Steps are
named exactly as the events name them: a resumed run counts on from its checkpoint's step, and the loss
curve is drawn against the same step numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

CHECKING = "checking the setup"
LAUNCHING = "launching the training process"


@dataclass
class RunView:
    """The steps and losses seen so far, and the text for each event worth showing."""

    total: int
    resumed_from: int = 0
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    validation_steps: list[int] = field(default_factory=list)
    validation_losses: list[float] = field(default_factory=list)

    @property
    def validation_points(self) -> list[tuple[int, float]]:
        return list(zip(self.validation_steps, self.validation_losses, strict=True))

    def add_history(self, events: list[dict]) -> None:
        """The steps and validations of the runs this one continues (their curve comes first)."""
        for event in events:
            self.on_event(event)

    def on_event(self, event: dict) -> str | None:
        """The text to show for ``event`` (None: nothing new to say)."""
        kind = event.get("type")
        if kind == "phase":
            if event.get("phase") == "first_step":
                self.resumed_from = int(event.get("resumed_from") or 0)
            return str(event.get("text", "")) or None
        if kind == "step":
            self.steps.append(int(event["step"]))
            self.losses.append(float(event["loss"]))
            return self.step_text(event)
        if kind == "validation":
            self.validation_steps.append(int(event["step"]))
            self.validation_losses.append(float(event["loss"]))
            return f"step {event['step']}/{self.total}  validation loss {event['loss']:.4f}"
        return None

    def step_text(self, event: dict) -> str:
        eta = event.get("eta_s")
        eta_txt = f"{eta:.0f} s" if isinstance(eta, (int, float)) else "?"
        text = (f"step {event['step']}/{event['total']}  loss {event['loss']:.4f}  "
                f"{event.get('it_s', 0):.2f} it/s  ETA {eta_txt}")
        if self.validation_losses:
            text += f"  val {self.validation_losses[-1]:.4f} (step {self.validation_steps[-1]})"
        if self.resumed_from:
            text += f"  (resumed from step {self.resumed_from})"
        return text


def done_text(lora_output: str, run_dir: str, view: RunView) -> str:
    """The end of a finished run: where the LoRA and the run folder are."""
    last = (f"step {view.steps[-1]}/{view.total}, loss {view.losses[-1]:.4f}" if view.steps
            else f"step {view.total}/{view.total}")
    if view.validation_losses:
        last += f", validation loss {view.validation_losses[-1]:.4f}"
    return (f"done: {last}\n"
            f"LoRA: {os.path.basename(lora_output)} (in {os.path.dirname(lora_output)})\n"
            f"run folder: {run_dir}")


def stopped_step(events: list[dict]) -> int | None:
    """The step of the checkpoint a stopped run kept, or None when it stopped before saving one."""
    saved = [e for e in events if e.get("type") == "saved" and e.get("checkpoint") and not e.get("final")]
    return int(saved[-1]["step"]) if saved else None


def stopped_text(events: list[dict], resume: bool) -> str:
    """What Cancel left behind, and how to go on."""
    step = stopped_step(events)
    if step is None:
        return "stopped before the first checkpoint: nothing to resume; queue again to start over"
    how = "queue again to resume" if resume else "turn resume on and queue again to continue"
    return f"stopped at step {step}; checkpoint kept; {how}"
