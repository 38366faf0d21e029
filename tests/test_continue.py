"""Continuing from a chosen checkpoint through the Train node: a changed LR goes on from the checkpoint's
step with a warning (and really trains at the new LR); a changed rank is refused before anything starts,
naming the field. The choice is a list built from the runs folder (the node's ``resume_from`` combo)."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest
from pipetrainer.training.loop.resume import ResumeCheck, check_resume, save_checkpoint_spec
from pipetrainer.training.process.events import read_all
from pipetrainer.training.spec.choices import SpecError
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

SETTINGS = dict(batch_size=1, gradient_accumulation=1, seed=0, training_dtype="fp32", gradient_checkpointing=False,
                pipeline_stages=1, partition_method="parameters")
LORA = LoraSpec(rank=4, alpha=4.0)


@pytest.fixture(scope="module")
def node():
    """The Train node without its warm pool (no process tree is left running after the tests)."""
    from pipetrainer.nodes import train

    enabled = train.WARM_POOL.enabled
    train.WARM_POOL.enabled = False
    yield train.PipeTrainerTrain
    train.WARM_POOL.enabled = enabled


@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


@pytest.fixture(scope="module")
def first_run(node, tiny_model, demo_cache):
    """A 2-step run at LR 1e-3 with a checkpoint after each step; yields (name, run dir)."""
    from pipetrainer.nodes.run import paths

    name = f"continue_{secrets.token_hex(3)}"
    node.execute(tiny_model, demo_cache, LORA, OptimizerSpec(lr=1e-3, weight_decay=0.0), name, steps=2,
                 save_every=1, resume=False, **SETTINGS)
    [run_dir] = Path(paths.runs_root()).glob(f"{name}-*")
    yield name, run_dir
    for run in Path(paths.runs_root()).glob(f"{name}-*"):
        shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(paths.step_loras_dir(name), ignore_errors=True)
    Path(paths.lora_output_path(name)).unlink(missing_ok=True)


def _steps(run_dir: Path) -> list[dict]:
    return [e for e in read_all(run_dir) if e["type"] == "step"]


def test_the_node_lists_each_complete_checkpoint(node, first_run):
    name, run_dir = first_run
    options = node.INPUT_TYPES()["optional"]["resume_from"][1]["options"]
    assert options[0] == "newest"
    assert [o for o in options if o.startswith(run_dir.name)] == [f"{run_dir.name}/step0000002",
                                                                  f"{run_dir.name}/step0000001"]


def test_a_changed_lr_continues_from_the_chosen_step_with_a_warning(node, tiny_model, demo_cache, first_run):
    from pipetrainer.nodes.run import paths

    name, first_dir = first_run
    out = node.execute(tiny_model, demo_cache, LORA, OptimizerSpec(lr=5e-4, weight_decay=0.0), name, steps=3,
                       save_every=0, resume=True, resume_from=f"{first_dir.name}/step0000001", **SETTINGS)
    [run_dir] = [d for d in Path(paths.runs_root()).glob(f"{name}-*") if d != first_dir]
    events = read_all(run_dir)
    assert [e["resumed_step"] for e in events if e["type"] == "setup"] == [1]
    steps = _steps(run_dir)
    assert [e["step"] for e in steps] == [2, 3]
    # Step 2's loss is computed with the checkpoint's weights (the LR acts only after it): the first run's.
    assert steps[0]["loss"] == _steps(first_dir)[1]["loss"]
    # The new LR is the one applied, not the one the checkpoint's optimizer and schedule were saved with.
    assert [e["lr"] for e in steps] == [5e-4, 5e-4] and _steps(first_dir)[0]["lr"] == 1e-3

    # The loss map (and curve) is the whole run's: the first run's step 1, then this run's steps.
    assert out.result[3]["loss"] == [_steps(first_dir)[0]["loss"], *(e["loss"] for e in steps)]

    [warning] = [e for e in events if e["type"] == "warning"]
    assert "optimizer.lr: 0.001 -> 0.0005" in warning["text"] and "(step 1)" in warning["text"]
    assert "warning: " + warning["text"] in (run_dir / "logs" / "rank0.log").read_text()
    shown = out.ui.as_dict()["text"][0]  # the text the node shows at the end
    assert shown.startswith("done: step 3/3") and "optimizer.lr: 0.001 -> 0.0005" in shown


def test_a_changed_rank_is_refused_before_anything_starts(node, tiny_model, demo_cache, first_run):
    from pipetrainer.nodes.run import paths

    name, first_dir = first_run
    before = sorted(Path(paths.runs_root()).glob(f"{name}-*"))
    with pytest.raises(SpecError) as info:
        node.execute(tiny_model, demo_cache, LoraSpec(rank=8, alpha=4.0), OptimizerSpec(lr=1e-3, weight_decay=0.0),
                     name, steps=4, save_every=0, resume=True, resume_from=f"{first_dir.name}/step0000002", **SETTINGS)
    message = str(info.value)
    assert "lora.rank: 4 -> 8 (the LoRA matrices have another shape)" in message, message
    assert sorted(Path(paths.runs_root()).glob(f"{name}-*")) == before  # no run folder, no process

    with pytest.raises(SpecError, match="not a complete checkpoint"):
        node.execute(tiny_model, demo_cache, LORA, OptimizerSpec(lr=1e-3, weight_decay=0.0), name, steps=4,
                     save_every=0, resume=True, resume_from=f"../{first_dir.name}/step0000002", **SETTINGS)


def test_a_resume_that_starts_over_says_why_and_the_earlier_lora_is_kept(node, tiny_model, demo_cache, first_run):
    """``resume`` with a changed LR finds no checkpoint of these settings: the node says which setting differs
    and that it starts at step 0; the LoRA file it replaces stays listed under the earlier run's name."""
    from pipetrainer.nodes.run import paths

    name, _ = first_run
    final = Path(paths.lora_output_path(name))
    earlier_bytes = final.read_bytes()
    [kept] = [f"pipetrainer/{name}/{f.name}" for f in Path(paths.step_loras_dir(name)).iterdir() if f.samefile(final)]
    before = set(Path(paths.runs_root()).glob(f"{name}-*"))
    out = node.execute(tiny_model, demo_cache, LORA, OptimizerSpec(lr=2e-3, weight_decay=0.0), name, steps=1,
                       save_every=0, resume=True, **SETTINGS)
    [run_dir] = set(Path(paths.runs_root()).glob(f"{name}-*")) - before
    assert [e["resumed_step"] for e in read_all(run_dir) if e["type"] == "setup"] == [0]
    shown = out.ui.as_dict()["text"][0]
    assert f"resume: no checkpoint of {name} has these settings, so this run starts at step 0" in shown, shown
    assert "optimizer.lr: " in shown and " -> 0.002" in shown and "Choose it in resume_from" in shown, shown
    assert f"that LoRA stays in the LoRA list as {kept}." in shown, shown
    assert (Path(paths.loras_dir()) / kept).read_bytes() == earlier_bytes != final.read_bytes()


def test_a_lora_file_without_a_run_s_name_gets_one_before_it_is_replaced(tmp_path):
    from pipetrainer.nodes.run.paths import keep_earlier_lora

    final, step_dir = tmp_path / "mine.safetensors", tmp_path / "pipetrainer" / "mine"
    assert keep_earlier_lora(str(final), str(step_dir)) == ""  # nothing to keep
    final.write_bytes(b"a LoRA put here by hand")
    note = keep_earlier_lora(str(final), str(step_dir))
    [kept] = step_dir.glob("mine-earlier-*.safetensors")
    assert kept.read_bytes() == final.read_bytes() and note.endswith(f"as pipetrainer/mine/{kept.name}.")
    assert keep_earlier_lora(str(final), str(step_dir)) == note and len(list(step_dir.iterdir())) == 1


def test_a_resumed_run_s_history_follows_every_run_it_continues(fixture_paths, comfy_root, demo_cache, tmp_path):
    """C continues B at step 3, B continued A at step 2: the curve is A's steps 1-2, B's step 3, then C's. A's
    steps after 2 and B's after 3 (trained on, then abandoned) are not part of it."""
    from pipetrainer.nodes.run.checkpoints import earlier_history
    from pipetrainer.tests.helpers import make_spec
    from pipetrainer.training.process.events import EventWriter

    def run(name: str, resume_from: str, losses: dict[int, float]) -> Path:
        run_dir = tmp_path / name
        spec = make_spec(fixture_paths.mmdit, demo_cache.items, run_dir, comfy_root, steps=5, resume_from=resume_from)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "spec.json").write_text(spec.to_json(), encoding="utf-8")
        writer = EventWriter(run_dir, "rank0")
        for step, loss in losses.items():
            writer.emit("step", step=step, total=5, loss=loss)
            if step == 2:
                writer.emit("validation", step=2, loss=9.0)
        return run_dir

    a = run("a", "", {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7})
    b = run("b", str(a / "checkpoints" / "step0000002"), {3: 0.6, 4: 0.5})
    history = earlier_history(str(b / "checkpoints" / "step0000003"))
    assert [(e["type"], e["step"], e["loss"]) for e in history] == [
        ("step", 1, 1.0), ("step", 2, 0.9), ("validation", 2, 9.0), ("step", 3, 0.6)]
    assert earlier_history("") == [] and earlier_history(str(tmp_path / "gone" / "checkpoints" / "step0000001")) == []


def _record(tmp_path: Path, spec) -> str:
    folder = tmp_path / "run" / "checkpoints" / "step0000005"
    save_checkpoint_spec(folder, spec)
    return str(folder)


COSINE = OptimizerSpec(lr=1e-3, weight_decay=0.0, schedule="cosine")


@pytest.mark.parametrize("change,refused,named", [
    (dict(optimizer=COSINE), False, "optimizer.schedule"),
    (dict(seed=3), False, "train.seed: 0 -> 3"),
    (dict(steps=20, optimizer=COSINE), False, "train.steps: 10 -> 20"),  # the cosine is stretched
    (dict(lora=LoraSpec(rank=8, alpha=16.0)), True, "lora.alpha: 8.0 -> 16.0"),
    (dict(lora=LoraSpec(rank=8, alpha=8.0, targets="attention")), True, "lora.targets"),
    (dict(optimizer=OptimizerSpec(name="AdamW8bit", lr=1e-3, weight_decay=0.0)), True, "optimizer.name"),
    (dict(optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.0, lora_plus_ratio=4.0)), True, "LoRA+ on or off"),
    (dict(pipeline_stages=2), True, "train.pipeline_stages: 1 -> 2"),
])
def test_what_may_change_and_what_is_refused(change, refused, named, fixture_paths, comfy_root, demo_cache, tmp_path):
    from pipetrainer.tests.helpers import make_spec

    schedule_only = {"optimizer": change["optimizer"]} if "steps" in change else {}  # only the steps differ
    earlier = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "a", comfy_root, steps=10, **schedule_only)
    checkpoint = _record(tmp_path, earlier)
    later = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "b", comfy_root,
                      **{"steps": 10, **change, "resume_from": checkpoint})
    check = check_resume(later)
    assert (check.refused is not None) == refused, check
    assert named in (check.refused or check.warning_text)
    assert check.checkpoint_step == 5
    if refused:
        assert check.warnings == ()
    if "steps" in change:
        assert check.warnings == ("train.steps: 10 -> 20 (the cosine LR schedule is recomputed for the new total)",)


def test_more_steps_on_a_constant_schedule_need_no_warning(fixture_paths, comfy_root, demo_cache, tmp_path):
    from pipetrainer.tests.helpers import make_spec

    checkpoint = _record(tmp_path, make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "a", comfy_root, steps=10))
    later = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "b", comfy_root, steps=50,
                      resume_from=checkpoint)
    assert check_resume(later) == ResumeCheck(refused=None, warnings=(), checkpoint_step=5)
