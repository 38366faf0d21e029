"""Resume: exact with LoRA dropout (each rank's RNG states are in the checkpoint), and a hand-set
``resume_from`` of a run whose weights mean something else (another rank) is refused before training,
naming what differs; other changed settings are named as warnings (tests/test_continue.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.training.loop.resume import SPEC_FILE, check_resume, resume_problem, save_checkpoint_spec
from pipetrainer.training.process.rank import EXIT_FAILED, EXIT_OK
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec
from safetensors.torch import load_file

SETTINGS = dict(seed=7, grad_accum=2, lora=LoraSpec(rank=8, alpha=8.0, dropout=0.1))


def _spec(fixture_paths, comfy_root, demo_cache, run_dir: Path, **changes):
    return make_spec(fixture_paths.mmdit, demo_cache.items, run_dir, comfy_root, **{**SETTINGS, **changes})


def _checkpoint(events: list[dict], step: int) -> str:
    return next(e["checkpoint"] for e in events if e["type"] == "saved" and e["step"] == step)


def _same_lora(a: str, b: str) -> bool:
    x, y = load_file(a), load_file(b)
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
def test_resume_with_lora_dropout_continues_bit_exactly(fixture_paths, comfy_root, demo_cache, tmp_path):
    straight = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "straight", steps=4)
    code, straight_events = run_training(straight)
    assert code == EXIT_OK, straight_events
    first = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "first", steps=2)
    code, first_events = run_training(first)
    assert code == EXIT_OK, first_events
    checkpoint = _checkpoint(first_events, 2)
    assert (Path(checkpoint) / "rng_rank00000.pt").is_file() and (Path(checkpoint) / SPEC_FILE).is_file()
    assert losses(first_events) == losses(straight_events)[:2]

    resumed = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "resumed", steps=4, resume_from=checkpoint)
    code, resumed_events = run_training(resumed)
    assert code == EXIT_OK, resumed_events
    assert next(e for e in resumed_events if e["type"] == "setup")["resumed_step"] == 2
    assert losses(resumed_events) == losses(straight_events)[2:]  # fp32: bitwise
    assert _same_lora(resumed.lora_output, straight.lora_output)

    # The oracle can fail: without the RNG states the dropout masks after the resume are other ones.
    (Path(checkpoint) / "rng_rank00000.pt").unlink()
    blind = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "blind", steps=4, resume_from=checkpoint)
    code, blind_events = run_training(blind)
    assert code == EXIT_OK, blind_events
    assert losses(blind_events) != losses(straight_events)[2:]
    assert not _same_lora(blind.lora_output, straight.lora_output)


def test_each_pipeline_stage_gets_back_its_own_rng_state_not_rank_0s(tmp_path):
    """With 2 stages each rank drops activations from its own RNG stream (seeded per rank); a checkpoint must
    give rank 1 rank 1's state back. The states are saved as the engine saves them (every rank into the same
    checkpoint folder, rank 1 first, so one shared file would be left with rank 0's state) and restored as
    the engine restores them; a dropout mask drawn after the restore is the one rank 1 would have drawn next
    without the interruption, and not rank 0's."""
    from pipetrainer.training.loop.resume import restore_rng_states, save_rng_states, seed_rank_rngs

    cpu = torch.device("cpu")
    ones = torch.ones(4096)
    tag = tmp_path / "checkpoints" / "step0000002"
    saved, next_mask = {}, {}
    with torch.random.fork_rng(devices=[]):  # this process's RNG stays as it was
        for rank, draws in ((1, 3), (0, 2)):  # as a training rank: seeded, some steps of dropout, then saved
            seed_rank_rngs(7, rank)
            for _ in range(draws):
                torch.nn.functional.dropout(ones, p=0.1)
            save_rng_states(tag, rank, cpu)
            saved[rank] = torch.get_rng_state()
            next_mask[rank] = torch.nn.functional.dropout(ones, p=0.1) == 0  # the uninterrupted next draw
        assert not torch.equal(saved[0], saved[1]) and not torch.equal(next_mask[0], next_mask[1])  # can tell

        seed_rank_rngs(7, 1)  # the resumed rank 1 is seeded first, as the engine does, then restores
        assert restore_rng_states(tag, 1, cpu)
        assert torch.equal(torch.get_rng_state(), saved[1])
        assert not torch.equal(torch.get_rng_state(), saved[0])
        assert torch.equal(torch.nn.functional.dropout(ones, p=0.1) == 0, next_mask[1])

        torch.manual_seed(0)
        assert restore_rng_states(tag, 0, cpu)
        assert torch.equal(torch.get_rng_state(), saved[0])
        before = torch.get_rng_state()
        assert not restore_rng_states(tag, 2, cpu)  # no state for a rank the run did not have: left alone
        assert torch.equal(torch.get_rng_state(), before)


def _recorded_checkpoint(spec, root: Path) -> str:
    """A checkpoint folder whose record says it was written by ``spec`` (what Trainer.save records)."""
    folder = root / "checkpoints" / "step0000002"
    save_checkpoint_spec(folder, spec)
    return str(folder)


def test_resume_problem_names_the_differing_settings(fixture_paths, comfy_root, demo_cache, tmp_path):
    earlier = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "earlier", steps=2)
    checkpoint = _recorded_checkpoint(earlier, Path(earlier.run_dir))
    same = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "same", steps=9, save_every=3,
                 resume_from=checkpoint)
    assert resume_problem(same) is None  # steps, save_every and paths are not training settings

    # LR and batch may change (continued with a warning naming them); the rank may not.
    other = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "other", steps=4, resume_from=checkpoint,
                  optimizer=OptimizerSpec(lr=2e-3, weight_decay=0.0), batch_size=2)
    check = check_resume(other)
    assert check.refused is None
    assert "optimizer.lr: 0.001 -> 0.002" in check.warning_text and "train.batch_size: 1 -> 2" in check.warning_text
    assert not any("steps" in w for w in check.warnings)  # constant schedule: more steps change nothing
    wider = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "wider", steps=4, resume_from=checkpoint,
                  optimizer=OptimizerSpec(lr=2e-3, weight_decay=0.0), lora=LoraSpec(rank=16, alpha=8.0, dropout=0.1))
    problem = resume_problem(wider)
    assert earlier.training_hash() in problem and wider.training_hash() in problem
    assert "lora.rank: 8 -> 16" in problem and "optimizer.lr" not in problem

    fewer = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "fewer", resume_from=checkpoint)
    fewer = dataclasses.replace(fewer, items=fewer.items[:2])
    assert f"items (the cached dataset: {len(earlier.items)} -> 2 items" in check_resume(fewer).warning_text


def test_a_checkpoint_without_its_own_record_is_checked_against_its_run_spec(fixture_paths, comfy_root,
                                                                             demo_cache, tmp_path):
    earlier = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "earlier", steps=2)
    (Path(earlier.run_dir) / "spec.json").write_text(earlier.to_json())
    folder = Path(earlier.run_dir) / "checkpoints" / "step0000002"
    folder.mkdir(parents=True)
    changed = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "next", resume_from=str(folder),
                    lora=LoraSpec(rank=8, alpha=8.0, dropout=0.2))
    assert "lora.dropout: 0.1 -> 0.2" in check_resume(changed).warning_text
    (Path(earlier.run_dir) / "spec.json").unlink()
    assert "has no record of its training settings" in resume_problem(changed)


def test_a_hand_set_resume_of_other_settings_fails_before_training(fixture_paths, comfy_root, demo_cache,
                                                                    tmp_path):
    earlier = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "earlier", steps=2)
    checkpoint = _recorded_checkpoint(earlier, Path(earlier.run_dir))
    spec = _spec(fixture_paths, comfy_root, demo_cache, tmp_path / "run", steps=4, resume_from=checkpoint,
                 lora=LoraSpec(rank=4, alpha=8.0, dropout=0.1))
    code, events = run_training(spec)
    assert code == EXIT_FAILED
    error = next(e for e in events if e["type"] == "error")
    assert earlier.training_hash() in error["message"] and spec.training_hash() in error["message"]
    assert "lora.rank: 8 -> 4" in error["message"]
    assert not [e for e in events if e["type"] in ("setup", "step")]
    assert json.loads((Path(checkpoint) / SPEC_FILE).read_text())["training_hash"] == earlier.training_hash()
