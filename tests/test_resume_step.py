"""Resume continues at the saved step: a real 1-stage run of 2 steps, then a resumed run to step 3.

Fast-tier on purpose (two short CPU runs, no text encoder: the example is a random latent and
embedding written as plain safetensors), so a resume that forgets the step fails in about half a
minute instead of hanging a 2-stage run in the slow tier.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pipetrainer.tests.helpers import make_spec, run_training
from pipetrainer.training.process.rank import EXIT_OK
from pipetrainer.training.spec.options import CacheItem
from safetensors.torch import save_file


def _random_item(folder: Path) -> CacheItem:
    """One cached example shaped for the tiny MMDiT (16-channel 8x8 latent, CLIP-L-wide embeddings)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    save_file({"latent": torch.randn(16, 8, 8, generator=g)}, str(folder / "latent.safetensors"))
    save_file({"cond": torch.randn(6, 768, generator=g), "pooled": torch.randn(768, generator=g)},
              str(folder / "text.safetensors"))
    return CacheItem(str(folder / "latent.safetensors"), str(folder / "text.safetensors"), "random.png", "random")


def test_a_resumed_run_continues_at_the_saved_step(fixture_paths, comfy_root, tmp_path):
    """Oracle: the step numbers of the events. A resume that forgets the saved step starts again at 1
    (and trains 3 more steps on top of the checkpoint) instead of running step 3 alone."""
    items = [_random_item(tmp_path / "cache")]
    first = make_spec(fixture_paths.mmdit, items, tmp_path / "first", comfy_root, steps=2,
                      gradient_checkpointing=False)
    code, events = run_training(first)
    assert code == EXIT_OK, events
    saved = [e for e in events if e["type"] == "saved" and e["final"]]
    assert [e["step"] for e in saved] == [2], events
    checkpoint = saved[0]["checkpoint"]
    assert Path(checkpoint).is_dir()
    resumed = make_spec(fixture_paths.mmdit, items, tmp_path / "resumed", comfy_root, steps=3,
                        gradient_checkpointing=False, resume_from=checkpoint)
    code, events = run_training(resumed)
    assert code == EXIT_OK, events
    assert [e["resumed_step"] for e in events if e["type"] == "setup"] == [2], events
    assert [e["step"] for e in events if e["type"] == "step"] == [3], events
