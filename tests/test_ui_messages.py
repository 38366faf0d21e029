"""Messages where the user looks, names and defaults, through the real ComfyUI server.

What the frontend shows comes from three places, each checked here as the server sends it: the
validation answer to a queue (``node_errors``: the frontend rings the input named in each error's
``extra_info.input_name``), the progress text of each node (a websocket message the frontend draws on
the node, recorded by tests/ui_client.py), and the UI outputs in the history.
"""

from __future__ import annotations

import json
import urllib.error
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pipetrainer.devkit.host import history_error
from pipetrainer.devkit.workflow_ui import NOTE_TYPES, node_size, overlapping_nodes
from pipetrainer.nodes.run.loss_plot import loss_curve
from pipetrainer.nodes.run.run_messages import CHECKING, RunView, stopped_text
from pipetrainer.tests.ui_client import NodeTexts
from pipetrainer.training.spec.options import TrainSpec

PACK_DIR = Path(__file__).resolve().parent.parent
WORKFLOWS = PACK_DIR / "workflows"
WORKFLOW = WORKFLOWS / "api" / "pipetrainer_tiny_mmdit.json"
TRAIN, CACHE, DATASET, LORA, OPTIMIZER = "8", "5", "4", "6", "7"
OURS = ("PipeTrainerLoadDiffusionModel", "PipeTrainerDataset", "PipeTrainerCache", "PipeTrainerLoRA",
        "PipeTrainerOptimizer", "PipeTrainerTimesteps", "PipeTrainerTrain")


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info")


def _workflow(**train) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    prompt[TRAIN]["inputs"].update(train)
    return prompt


def _refused(server, prompt: dict) -> dict:
    """The server's answer to a queue it refuses (HTTP 400): what the frontend shows."""
    with pytest.raises(urllib.error.HTTPError) as info:
        server.queue(prompt)
    assert info.value.code == 400
    return json.loads(info.value.read())


# ---- validation: the error on the widget, and no job at all --------------------------------------
def test_a_bad_lora_name_is_refused_on_that_widget_and_nothing_runs(server, comfy_root):
    name = f"../evil_{uuid.uuid4().hex[:6]}"
    queue_before = server.get("/queue")
    answer = _refused(server, _workflow(lora_name=name))
    assert answer["error"]["type"] == "prompt_outputs_failed_validation"  # the frontend's error dialog
    assert set(answer["node_errors"]) == {TRAIN}, answer["node_errors"]  # the Cache node did not run on
    errors = answer["node_errors"][TRAIN]["errors"]
    assert errors and {e["extra_info"]["input_name"] for e in errors} == {"lora_name"}, errors
    assert "lora_name" in errors[0]["details"] and "folder" in errors[0]["details"].lower(), errors[0]
    assert server.get("/queue") == queue_before  # no job: nothing can show as a success
    assert not list((comfy_root / "output" / "pipetrainer" / "runs").glob("*evil*"))


def test_a_bad_dataset_and_a_bad_adapter_come_in_one_answer_each_problem_once(server, comfy_root, fixture_paths):
    """One queue: a missing caption, a truncated PNG and a bad extra resolution on the Dataset node, and a LoKr
    with dropout on the LoRA node. Every problem comes in the queue's one answer, once, on its node (the folder
    is checked at queue time, nodes/dataset.py ``validate_inputs``), and nothing runs."""
    import shutil

    folder = f"bad_dataset_{uuid.uuid4().hex[:6]}"
    data = comfy_root / "input" / folder
    shutil.copytree(fixture_paths.dataset, data)
    try:
        first = sorted(data.glob("*.png"))[0]
        first.with_suffix(".txt").unlink()  # a missing caption
        second = sorted(data.glob("*.png"))[1]
        second.write_bytes(second.read_bytes()[:-40])  # the PNG ends before its IEND chunk
        prompt = _workflow()
        prompt[DATASET]["inputs"].update(folder=folder, extra_resolutions="256, big")
        prompt[LORA]["inputs"].update(adapter="lokr", dropout=0.1)
        queue_before = server.get("/queue")
        answer = _refused(server, prompt)
        shown = [e["details"] for errors in answer["node_errors"].values() for e in errors["errors"]]
        [dataset] = answer["node_errors"][DATASET]["errors"]
        [adapter] = answer["node_errors"][LORA]["errors"]
        for fragment in ("have no caption", first.name, f"{second.name}: the PNG ends before", "whole numbers"):
            assert fragment in dataset["details"], (fragment, dataset["details"])
            assert sum(fragment in details for details in shown) == 1, (fragment, shown)
        assert "dropout" in adapter["details"]
        assert server.get("/queue") == queue_before
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_problems_of_combined_inputs_come_once_per_node_in_one_answer(server):
    """A LoKr with dropout and a Prodigy with a small learning rate and LoRA+ (problems of several inputs
    each) in one queue: one answer lists both nodes, each problem once, one per line (nodes/node_problems.py)."""
    prompt = _workflow()
    prompt[LORA]["inputs"].update(adapter="lokr", dropout=0.1)
    prompt[OPTIMIZER]["inputs"].update(optimizer="Prodigy", learning_rate=1e-4, lora_plus_ratio=16.0)
    answer = _refused(server, prompt)
    assert {LORA, OPTIMIZER} <= set(answer["node_errors"]), answer["node_errors"]
    shown = [e["details"] for errors in answer["node_errors"].values() for e in errors["errors"]]  # the dialog
    for node, fragments in ((LORA, ["dropout"]), (OPTIMIZER, ["wants learning_rate 1.0", "LoRA+ cannot raise"])):
        [error] = answer["node_errors"][node]["errors"]  # once on the node, not once per input
        lines = error["details"].splitlines()
        for fragment in fragments:
            assert sum(fragment in line for line in lines) == 1, (fragment, lines)
            assert sum(fragment in details for details in shown) == 1, (fragment, shown)  # nowhere else


# ---- names and defaults ------------------------------------------------------------------------
def test_display_names_cannot_be_confused_with_other_nodes(object_info):
    ours = {node: object_info[node]["display_name"] for node in OURS}
    others = {(info.get("display_name") or name).casefold() for name, info in object_info.items()
              if name not in OURS}
    print("\n" + "\n".join(f"{k}: {v}" for k, v in ours.items()))
    assert all(name.endswith("(PipeTrainer)") for name in ours.values()), ours
    assert not {name.casefold() for name in ours.values()} & others
    assert len(set(ours.values())) == len(ours)


def test_the_seed_stays_as_set_and_the_dtype_default_is_one(object_info):
    options = object_info["PipeTrainerTrain"]["input"]["required"]["seed"][1]
    # Explicitly off: without the key, the frontend adds a 'randomize' control to any input named seed.
    assert options.get("control_after_generate") is False, options
    dtype = object_info["PipeTrainerTrain"]["input"]["required"]["training_dtype"][1]["default"]
    assert dtype == TrainSpec().dtype == "bf16"


# ---- the example workflow: layout, thumbnail, description ----------------------------------------
UI_FILES = sorted(p for p in WORKFLOWS.glob("*.json"))


def _skip_nodes_newer_than_this_host(ui: dict, ui_file: Path, object_info: dict) -> None:
    """An example whose description states a newer minimum ComfyUI (checked real in tests/test_workflows.py)
    is checked here only on a host that has all its nodes."""
    from pipetrainer.devkit.workflow_ui import required_comfyui

    description = WORKFLOWS / "api" / ui_file.with_suffix(".md").name
    missing = sorted({n["type"] for n in ui["nodes"] if n["type"] not in object_info and n["type"] not in NOTE_TYPES})
    if missing and description.exists() and required_comfyui(description.read_text(encoding="utf-8")):
        pytest.skip(f"{ui_file.stem} needs a newer ComfyUI ({', '.join(missing)} missing here)")


@pytest.mark.parametrize("ui_file", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_no_two_nodes_of_an_example_overlap(ui_file, object_info):
    ui = json.loads(ui_file.read_text())
    _skip_nodes_newer_than_this_host(ui, ui_file, object_info)
    assert overlapping_nodes(ui) == []
    for node in ui["nodes"]:  # and each node is as large as what the frontend draws in it
        if node["type"] not in NOTE_TYPES:
            need = node_size(object_info[node["type"]])
            assert node["size"][0] >= need[0] and node["size"][1] >= need[1], (
                node["id"], node["size"], need, "regenerate with: .venv/bin/python scripts/pt.py ui-workflow")


@pytest.mark.parametrize("ui_file", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_each_widget_value_of_an_example_is_its_api_twins_value_at_that_widgets_position(ui_file, object_info):
    """The frontend reads ``widgets_values`` by position (a seed's control value follows it): every value
    the API twin sets must sit at its widget's position, whatever inputs the twin leaves out."""
    from pipetrainer.devkit.workflow_ui import widget_names

    api = json.loads((WORKFLOWS / "api" / ui_file.name).read_text())
    _skip_nodes_newer_than_this_host(json.loads(ui_file.read_text()), ui_file, object_info)
    for node in json.loads(ui_file.read_text())["nodes"]:
        if node["type"] in NOTE_TYPES:
            continue
        info = object_info[node["type"]]
        options = {name: spec[1] if len(spec) > 1 else {} for group in ("required", "optional")
                   for name, spec in info["input"].get(group, {}).items()}
        values, by_name = list(node["widgets_values"]), {}
        for name in widget_names(info):
            if not values:
                break
            by_name[name] = values.pop(0)
            if options[name].get("control_after_generate"):
                values.pop(0)
        assert values == [], (node["id"], values)  # no value without a widget
        set_in_twin = {k: v for k, v in api[str(node["id"])]["inputs"].items() if not isinstance(v, list)}
        assert set_in_twin == {k: by_name.get(k, "(past the widgets_values)") for k in set_in_twin}, node["id"]


def test_a_widget_left_out_before_a_set_one_keeps_the_set_ones_position():
    """The generator behind the check above: an API node that leaves out a widget in the middle gets that
    widget's default at its position (a seed keeps its control value), and none past the last set one."""
    from pipetrainer.devkit.workflow_ui import CONTROL_DEFAULT, api_to_ui, ui_to_api

    info = {"N": {"input": {"required": {"seed": ["INT", {"default": 0, "control_after_generate": True}]},
                            "optional": {"skipped": ["FLOAT", {"default": 0.25}], "mode": [["a", "b"], {}],
                                         "text": ["STRING", {"default": ""}], "tail": ["INT", {"default": 3}]}},
                  "output": [], "output_name": [], "display_name": "N", "category": "test"}}
    api = {"1": {"class_type": "N", "inputs": {"seed": 7, "text": "set"}}}
    (node,) = api_to_ui(api, info)["nodes"]
    assert node["widgets_values"] == [7, CONTROL_DEFAULT, 0.25, "a", "set"]
    assert ui_to_api(api_to_ui(api, info), info)["1"]["inputs"] == {"seed": 7, "skipped": 0.25, "mode": "a", "text": "set"}


def test_overlaps_are_detected():
    """The check above can fail: two nodes whose boxes (title bar included) intersect."""
    ui = {"nodes": [{"id": 1, "pos": [0, 30], "size": [300, 200]}, {"id": 2, "pos": [100, 250], "size": [300, 100]},
                    {"id": 3, "pos": [400, 30], "size": [100, 100]}]}
    assert overlapping_nodes(ui) == [(1, 2)]


@pytest.mark.parametrize("ui_file", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_each_template_has_a_thumbnail_and_a_description(ui_file, server):
    """ComfyUI's template browser (frontend 1.32 and 1.45) loads a custom node template's thumbnail
    from ``/api/workflow_templates/<pack>/<name>.jpg``; the workflow opens with its description note."""
    packs = server.get("/workflow_templates")
    pack = next(p for p, names in packs.items() if ui_file.stem in names)
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/api/workflow_templates/{pack}/{ui_file.stem}.jpg", timeout=30) as r:
        assert r.headers["Content-Type"] == "image/jpeg"
        body = r.read()
    assert body == ui_file.with_suffix(".jpg").read_bytes()
    with Image.open(ui_file.with_suffix(".jpg")) as img:
        assert img.width >= 320 and img.height >= 200
    ui = json.loads(ui_file.read_text())
    notes = [n for n in ui["nodes"] if n["type"] in NOTE_TYPES]
    assert len(notes) == 1 and notes[0]["widgets_values"][0].startswith("# "), notes
    assert notes[0]["widgets_values"][0] == (WORKFLOWS / "api" / f"{ui_file.stem}.md").read_text().strip()


# ---- the texts a run shows -----------------------------------------------------------------------
def test_a_resumed_run_counts_and_plots_on_the_checkpoint_s_step_axis():
    view = RunView(total=13)
    assert view.on_event({"type": "phase", "phase": "first_step", "resumed_from": 10,
                          "text": "resumed from step 10; step 10/13: first step (warming up)"}).startswith("resumed")
    texts = [view.on_event({"type": "step", "step": s, "total": 13, "loss": 0.5 - s / 100, "it_s": 1.0,
                            "eta_s": 13 - s}) for s in (11, 12, 13)]
    assert view.steps == [11, 12, 13] and texts[0].startswith("step 11/13") and "(resumed from step 10)" in texts[0]
    # Same losses on steps 11-13 or 1-3: the same curve, labelled with other step numbers (below the axis).
    resumed = np.asarray(loss_curve(view.losses, view.steps))
    fresh = np.asarray(loss_curve(view.losses))
    rows = np.nonzero((resumed != fresh).any(axis=(1, 2)))[0]
    assert rows.size and rows.min() >= 320 - 40
    # A gap in the steps moves the points: the x axis is the step number, not the index.
    assert not np.array_equal(np.asarray(loss_curve([1.0, 0.5, 0.2], [1, 2, 9]))[:280],
                              np.asarray(loss_curve([1.0, 0.5, 0.2], [1, 2, 3]))[:280])


def test_the_stop_text_names_the_checkpoint_step():
    events = [{"type": "step", "step": 7}, {"type": "saved", "step": 7, "final": False, "checkpoint": "/r/ck/step7"},
              {"type": "stopped", "step": 7}]
    assert stopped_text(events, resume=True) == "stopped at step 7; checkpoint kept; queue again to resume"
    assert "turn resume on" in stopped_text(events, resume=False)
    assert stopped_text([{"type": "step", "step": 1}], resume=True).startswith("stopped before the first checkpoint")


def test_a_run_shows_its_phases_steps_and_where_the_lora_went(server, comfy_root):
    name = f"ui_{uuid.uuid4().hex[:6]}"
    prompt = _workflow(lora_name=name, steps=3, resume=False)
    prompt["14"]["inputs"]["filename_prefix"] = name
    # Another repeats count: ComfyUI runs the Cache node again instead of answering from its node cache.
    prompt[DATASET]["inputs"]["repeats"] = 2 + int(name[-6:], 16) % 900
    with NodeTexts(server) as texts:
        entry = server.wait(server.queue(prompt), timeout=600)
    assert history_error(entry) is None, server.log_tail()
    train = texts.of(TRAIN)
    print("\n" + "\n".join(train))
    [run_dir] = (comfy_root / "output" / "pipetrainer" / "runs").glob(f"{name}-*")
    assert train[0] == CHECKING  # the previous run's text is replaced at once
    order = [next(i for i, t in enumerate(train) if t.startswith(prefix)) for prefix in
             ("starting 1 rank", "loading the model", "step 0/3: first step", "step 1/3  loss", "step 3/3  loss",
              "done: step 3/3")]
    assert order == sorted(order), train
    done = train[-1]
    assert f"LoRA: {name}.safetensors (in {comfy_root / 'models' / 'loras'})" in done
    assert f"run folder: {run_dir}" in done
    assert entry["outputs"][TRAIN]["text"] == [done]  # also a UI output, kept in the history
    cache_report = texts.of(CACHE)
    assert cache_report and cache_report[-1] == "\n".join(entry["outputs"][CACHE]["text"])
    assert cache_report[-1].startswith("cached ") and "reused" in cache_report[-1]
