"""The example workflows: the UI file people open and the API twin tests queue are the same graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipetrainer.devkit.workflow_ui import NOTE_TYPES, ui_to_api

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
PAIRS = [(p, WORKFLOWS / p.name) for p in sorted((WORKFLOWS / "api").glob("*.json"))]


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info")


@pytest.mark.parametrize("api_file,ui_file", PAIRS, ids=[p.stem for p, _ in PAIRS])
def test_ui_workflow_queues_exactly_its_api_twin(api_file, ui_file, object_info):
    api = json.loads(api_file.read_text())
    ui = json.loads(ui_file.read_text())
    assert ui_to_api(ui, object_info) == api, "regenerate with: .venv/bin/python scripts/pt.py ui-workflow"


@pytest.mark.parametrize("api_file,ui_file", PAIRS, ids=[p.stem for p, _ in PAIRS])
def test_ui_workflow_is_a_consistent_graph(api_file, ui_file, object_info):
    ui = json.loads(ui_file.read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for node in nodes.values():
        assert node["type"] in object_info or node["type"] in NOTE_TYPES, node["type"]
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        assert link_id in nodes[src]["outputs"][src_slot]["links"]
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id
        assert object_info[nodes[src]["type"]]["output"][src_slot] == kind
    assert ui["last_node_id"] == max(nodes) and ui["last_link_id"] == len(ui["links"])


def test_template_browser_offers_only_ui_workflows(server):
    """ComfyUI lists every workflows/*.json of the pack as a template: all of them must be UI format."""
    templates = server.get("/workflow_templates")
    ours = next(names for pack, names in templates.items() if "PipeTrainer" in pack)
    assert sorted(ours) == sorted(p.stem for _, p in PAIRS)
    for name in ours:
        assert "nodes" in json.loads((WORKFLOWS / f"{name}.json").read_text())


def test_every_pipetrainer_input_has_a_tooltip(object_info):
    ours = {name: info for name, info in object_info.items() if name.startswith("PipeTrainer")}
    assert {"PipeTrainerLoadDiffusionModel", "PipeTrainerDataset", "PipeTrainerCache", "PipeTrainerLoRA",
            "PipeTrainerOptimizer", "PipeTrainerTrain"} <= set(ours)
    missing = [f"{node}.{name}" for node, info in ours.items()
               for section in ("required", "optional") for name, spec in info["input"].get(section, {}).items()
               if not (len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("tooltip"))]
    assert missing == []


def test_every_family_option_is_an_input_of_the_train_node(object_info):
    """Family options reach a run only through Train node inputs of the same names (options_from_inputs):
    an option without an input would be unreachable from a graph."""
    import dataclasses

    from pipetrainer.training.pipelines.base import adapter_for, known_families

    train = object_info["PipeTrainerTrain"]["input"]
    inputs = {**train.get("required", {}), **train.get("optional", {})}
    for family in known_families():
        for field in dataclasses.fields(adapter_for(family).options_type):
            assert field.name in inputs, f"{family} option {field.name!r} has no Train node input"
            spec = inputs[field.name]
            default = spec[1].get("default") if len(spec) > 1 else None
            assert default == field.default, (family, field.name, default, field.default)
