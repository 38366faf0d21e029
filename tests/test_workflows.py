"""The example workflows: the UI file people open and the API twin tests queue are the same graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipetrainer.devkit.workflow_ui import (
    NOTE_TYPES,
    api_problems,
    required_comfyui,
    ui_to_api,
    version_tuple,
)

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
PAIRS = [(p, WORKFLOWS / p.name) for p in sorted((WORKFLOWS / "api").glob("*.json"))]
API_FILES = [p for p, _ in PAIRS]


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info")


@pytest.fixture(scope="module")
def host_version(server) -> tuple[int, ...]:
    return version_tuple(server.get("/system_stats")["system"]["comfyui_version"])


def _needs_newer_host(api_file: Path, host_version: tuple[int, ...]) -> bool:
    """A workflow whose description says "Needs ComfyUI X.Y.Z or newer" is checked only on such hosts."""
    description = api_file.with_suffix(".md")
    needed = required_comfyui(description.read_text(encoding="utf-8")) if description.exists() else None
    return needed is not None and host_version < needed


@pytest.mark.parametrize("api_file,ui_file", PAIRS, ids=[p.stem for p, _ in PAIRS])
def test_ui_workflow_queues_exactly_its_api_twin(api_file, ui_file, object_info, host_version):
    if _needs_newer_host(api_file, host_version):
        pytest.skip(f"{api_file.stem} needs a newer ComfyUI (its description says which)")
    api = json.loads(api_file.read_text())
    ui = json.loads(ui_file.read_text())
    assert ui_to_api(ui, object_info) == api, "regenerate with: .venv/bin/python scripts/pt.py ui-workflow"


@pytest.mark.parametrize("api_file,ui_file", PAIRS, ids=[p.stem for p, _ in PAIRS])
def test_ui_workflow_is_a_consistent_graph(api_file, ui_file, object_info, host_version):
    if _needs_newer_host(api_file, host_version):
        pytest.skip(f"{api_file.stem} needs a newer ComfyUI (its description says which)")
    ui = json.loads(ui_file.read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for node in nodes.values():
        assert node["type"] in object_info or node["type"] in NOTE_TYPES, node["type"]
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        assert link_id in nodes[src]["outputs"][src_slot]["links"]
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id
        assert object_info[nodes[src]["type"]]["output"][src_slot] == kind
    assert ui["last_node_id"] == max(nodes) and ui["last_link_id"] == len(ui["links"])


def test_each_ui_note_is_its_description_and_out_of_vram_names_auto_swap():
    """The note that opens a UI workflow (and its ``extra.pipetrainer_description``) is its
    ``workflows/api/<name>.md``, which ``scripts/pt.py ui-workflow`` writes into it; a note's "Out of VRAM"
    line says that ``blocks_to_swap = -1`` picks the swap automatically before the run."""
    with_vram_line = 0
    for api_file, ui_file in PAIRS:
        description = api_file.with_suffix(".md")
        note = description.read_text(encoding="utf-8").strip() if description.exists() else ""
        ui = json.loads(ui_file.read_text(encoding="utf-8"))
        notes = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] in NOTE_TYPES]
        assert notes == ([note] if note else []), f"{ui_file.name}: regenerate with .venv/bin/python scripts/pt.py ui-workflow"
        assert ui.get("extra", {}).get("pipetrainer_description", "") == note, ui_file.name
        for line in note.splitlines():
            if "Out of VRAM" in line:
                with_vram_line += 1
                assert "`blocks_to_swap = -1`" in line and "automatically before the run" in line, (ui_file.name, line)
    assert with_vram_line >= 8  # the large models' notes (FLUX, Chroma, Qwen-Image, HunyuanVideo, Wan 14B)


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


# ---- every example's graph against this host's nodes ---------------------------------------------------
@pytest.mark.parametrize("api_file", API_FILES, ids=[p.stem for p in API_FILES])
def test_every_node_and_input_of_an_example_is_valid_on_this_host(api_file, object_info, host_version):
    """Node classes exist; every input is an input of its node, linked to an output of its type or set to a
    valid widget value (combo values among the choices, except the user's model and image file names); the
    widgets given leave no gap (the UI file stores them by position). A workflow that needs a newer
    ComfyUI says so in its description ("Needs ComfyUI X.Y.Z or newer."): on an older host something of
    it must really be missing, so the stated minimum never goes stale."""
    api = json.loads(api_file.read_text())
    problems = api_problems(api, object_info)
    if _needs_newer_host(api_file, host_version):
        assert problems, f"{api_file.stem} states a newer minimum ComfyUI but all its nodes and inputs exist here"
    else:
        assert problems == []


def test_the_graph_check_can_fail(object_info):
    """api_problems finds each kind of mistake (unknown node or input, missing input, wrong link type,
    bad widget values, widget gaps) and lets the user's file names through."""
    api = json.loads((WORKFLOWS / "api" / "pipetrainer_tiny_mmdit.json").read_text())
    assert api_problems(api, object_info) == []
    broken = json.loads(json.dumps(api))
    broken["1"]["inputs"]["unet_name"] = "someone_elses_model.safetensors"  # a user file name: fine
    broken["1"]["inputs"]["weight_dtype"] = "fp7"  # not a choice
    broken["12"]["inputs"]["steps"] = 0  # below min
    broken["12"]["inputs"]["cfg"] = "1.0"  # not a FLOAT
    broken["12"]["inputs"]["positive"] = ["11", 0]  # a LATENT into a CONDITIONING input
    broken["12"]["inputs"]["sharpness"] = 1.0  # no such input
    del broken["12"]["inputs"]["denoise"]  # required
    broken["8"]["inputs"]["guidance"] = 3.5  # leaves data_parallel .. blocks_to_swap out: a gap
    broken["99"] = {"class_type": "NoSuchNode", "inputs": {}}
    text = "\n".join(api_problems(broken, object_info))
    for expected in ("'fp7' is not one of", "node 12 (KSampler).steps: 0 is outside", "'1.0' is not a FLOAT",
                     "CONDITIONING input linked to a LATENT output", "sharpness: not an input",
                     "'denoise' is missing", "leave a gap", "NoSuchNode is not a node"):
        assert expected in text, (expected, text)
    assert "unet_name" not in text


def test_a_stated_minimum_comfyui_is_read_from_the_description():
    assert required_comfyui("# T\nNeeds ComfyUI 0.3.76 or newer.\n") == (0, 3, 76)
    assert required_comfyui("# T\nNeeds comfyui 1.2 or newer") == (1, 2)
    assert required_comfyui("# T\nno line") is None
    assert version_tuple("0.28.0") > version_tuple("0.3.75") > version_tuple("0.3.9")


# ---- what each example trains and how it samples ---------------------------------------------------------
# The family each example's model belongs to, the Train node's family options it must set (the others stay
# at their defaults), and what its data needs: reference images (control_folder), start-image latents
# (Cache start_image first_frame, or first_frame_alone for HunyuanVideo 1.5) and CLIP-vision features (Cache clip_vision) for image-to-video models.
EXAMPLES = {
    "pipetrainer_tiny_mmdit": ("SD3", {}, set()),
    "pipetrainer_flux_dev": ("Flux", {"guidance": 1.0}, set()),
    "pipetrainer_flux_kontext": ("Flux", {"guidance": 1.0}, {"control_folder"}),
    "pipetrainer_flux2_dev": ("Flux2", {"guidance": 1.0}, set()),
    "pipetrainer_chroma": ("Chroma", {}, set()),
    "pipetrainer_qwen_image": ("QwenImage", {}, set()),
    "pipetrainer_qwen_image_edit": ("QwenImage", {}, {"control_folder"}),
    "pipetrainer_z_image_turbo": ("Lumina2", {}, set()),
    "pipetrainer_lumina2": ("Lumina2", {}, set()),
    "pipetrainer_sdxl": ("SDXL", {}, set()),
    "pipetrainer_sd15": ("SD1/SD2", {}, set()),
    "pipetrainer_auraflow": ("AuraFlow", {}, set()),
    "pipetrainer_pixart_sigma": ("PixArt", {}, set()),
    "pipetrainer_wan_t2v": ("Wan", {}, set()),
    "pipetrainer_wan21_i2v": ("Wan", {}, {"start_image", "clip_vision"}),
    "pipetrainer_wan22_i2v_high_noise": ("Wan", {"expert": "high_noise"}, {"start_image"}),
    "pipetrainer_wan22_ti2v": ("Wan", {"first_frame_clean": True}, set()),
    "pipetrainer_wan_vace": ("WanVace", {}, {"control_folder", "vace_control"}),
    "pipetrainer_wan22_s2v": ("WanS2V", {}, {"audio_encoder"}),
    "pipetrainer_hunyuan_video": ("HunyuanVideo", {"guidance": 1.0}, set()),
    "pipetrainer_hunyuan_video15": ("HunyuanVideo15", {"guidance": 1.0}, set()),
    "pipetrainer_hunyuan_video15_i2v": ("HunyuanVideo15", {"guidance": 1.0}, {"start_image_alone", "clip_vision"}),
    "pipetrainer_hunyuan_video_i2v": ("HunyuanVideo", {"guidance": 1.0}, {"start_image_alone", "clip_vision"}),
    "pipetrainer_ltxv": ("LTXV", {}, set()),
    "pipetrainer_krea2": ("Krea2", {}, set()),
    "pipetrainer_mage_flow": ("MageFlow", {}, set()),
    "pipetrainer_longcat_image": ("LongCat", {}, set()),
    "pipetrainer_hunyuan_image21": ("HunyuanImage", {"guidance": 1.0}, set()),
    "pipetrainer_hidream_i1": ("HiDream", {}, set()),
    "pipetrainer_ernie_image": ("ErnieImage", {}, set()),
    "pipetrainer_ideogram4": ("Ideogram4", {}, set()),
    "pipetrainer_cosmos_predict2_t2i": ("CosmosPredict2", {}, set()),
    "pipetrainer_cosmos_predict2_i2v": ("CosmosPredict2", {"first_frame_clean": True}, set()),
    "pipetrainer_ltx2": ("LTX2", {}, {"audio_vae"}),
    "pipetrainer_minimax_h3": ("MiniMaxH3", {}, {"audio_vae"}),
    "pipetrainer_minimax_h3_fl2va": ("MiniMaxH3", {}, {"audio_vae", "first_last_frames"}),
    "pipetrainer_minimax_h3_ref2va": ("MiniMaxH3", {}, {"audio_vae", "control_folder"}),
    "pipetrainer_minimax_h3_talking": ("MiniMaxH3", {}, {"audio_vae", "first_keyframe", "audio_guide"}),
    "pipetrainer_anima": ("Anima", {}, set()),
    "pipetrainer_omnigen2": ("Omnigen2", {}, set()),
    "pipetrainer_kandinsky5_image": ("Kandinsky5Image", {}, set()),
    "pipetrainer_kandinsky5_t2v": ("Kandinsky5Video", {}, set()),
    "pipetrainer_kandinsky5_i2v": ("Kandinsky5Video", {"first_frame_clean": True}, set()),
}
LOADERS = {"PipeTrainerLoadDiffusionModel", "PipeTrainerLoadCheckpoint", "PipeTrainerLoadGGUF"}
SAMPLERS = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "BasicGuider", "CFGGuider", "DualCFGGuider",
            "DualModelGuider"}


def _only(api: dict, class_type: str) -> tuple[str, dict]:
    found = [(k, n) for k, n in api.items() if n["class_type"] == class_type]
    assert len(found) == 1, (class_type, found)
    return found[0]


def _model_chain(api: dict, key: str) -> list[str]:
    """The node keys a MODEL passes through up to ``key``'s model input, nearest first."""
    chain = []
    while "model" in api[key]["inputs"] and isinstance(api[key]["inputs"]["model"], list):
        key = api[key]["inputs"]["model"][0]
        chain.append(key)
    return chain


def test_every_example_has_a_row():
    missing = {p.stem for p in API_FILES} - set(EXAMPLES)
    assert not missing, f"add {sorted(missing)} to EXAMPLES"


@pytest.mark.parametrize("api_file", API_FILES, ids=[p.stem for p in API_FILES])
def test_each_example_sets_its_family_options_and_data(api_file, object_info):
    import dataclasses

    from pipetrainer.training.pipelines.base import adapter_for, known_families

    family, options, needs = EXAMPLES[api_file.stem]
    api = json.loads(api_file.read_text())
    _, train = _only(api, "PipeTrainerTrain")
    spec = object_info["PipeTrainerTrain"]["input"]
    spec = {**spec.get("required", {}), **spec.get("optional", {})}
    ours = {f.name: f.default for f in dataclasses.fields(adapter_for(family).options_type)}
    assert set(options) <= set(ours), (family, options, ours)
    for name, default in ours.items():
        assert train["inputs"].get(name, default) == options.get(name, default), (family, name)
    others = {f.name for fam in known_families() for f in dataclasses.fields(adapter_for(fam).options_type)}
    for name in sorted(others - set(ours)):  # another family's option: left at its default, never misleading
        if name in train["inputs"]:
            assert train["inputs"][name] == spec[name][1].get("default"), (family, name, train["inputs"][name])
    _, dataset = _only(api, "PipeTrainerDataset")
    _, cache = _only(api, "PipeTrainerCache")
    assert bool(dataset["inputs"].get("control_folder")) == ("control_folder" in needs)
    start = cache["inputs"].get("start_image", "none")
    assert (start == "first_frame") == ("start_image" in needs)
    assert (start == "first_frame_alone") == ("start_image_alone" in needs)
    assert (start == "first_last_frames") == ("first_last_frames" in needs)
    assert (start == "first_keyframe") == ("first_keyframe" in needs)
    assert (cache["inputs"].get("audio_guide", "none") != "none") == ("audio_guide" in needs)
    assert isinstance(cache["inputs"].get("clip_vision"), list) == ("clip_vision" in needs)
    assert isinstance(cache["inputs"].get("audio_vae"), list) == ("audio_vae" in needs)
    assert isinstance(cache["inputs"].get("audio_encoder"), list) == ("audio_encoder" in needs)
    assert (cache["inputs"].get("vace_control", "off") == "on") == ("vace_control" in needs)


@pytest.mark.parametrize("api_file", API_FILES, ids=[p.stem for p in API_FILES])
def test_each_example_samples_with_the_trained_model(api_file):
    """A sampler downstream of Train LoRA's MODEL (the LoRA applied), and between the loader and Train
    only nodes training replays (checked below with the stock nodes)."""
    api = json.loads(api_file.read_text())
    train_key, _ = _only(api, "PipeTrainerTrain")
    samplers = [k for k, n in api.items() if n["class_type"] in SAMPLERS]
    assert any(train_key in _model_chain(api, k) for k in samplers), "no sampler uses the trained MODEL"
    before = _model_chain(api, train_key)
    assert api[before[-1]]["class_type"] in LOADERS
    assert {api[k]["class_type"] for k in before[:-1]} <= {"ModelSamplingSD3", "ModelSamplingAuraFlow",
                                                         "ModelSamplingFlux"}


def test_the_model_sampling_nodes_before_train_are_replayed(fixture_paths):
    """Each ModelSampling* node (with its settings) that an example puts before Train LoRA, applied by
    ComfyUI's own node to a real model, is recorded as a replayable sampling with no other patch."""
    import comfy_extras.nodes_model_advanced as advanced
    from pipetrainer.nodes.checks.graph_patches import patch_problems, sampling_override
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    model = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]
    used = set()
    for api_file in API_FILES:
        api = json.loads(api_file.read_text())
        train_key, _ = _only(api, "PipeTrainerTrain")
        for key in _model_chain(api, train_key)[:-1]:
            node = api[key]
            used.add((node["class_type"], json.dumps({k: v for k, v in node["inputs"].items() if k != "model"},
                                                     sort_keys=True)))
    assert used, "no example puts a ModelSampling* node before Train LoRA"
    for class_type, widgets in sorted(used):
        node_class = getattr(advanced, class_type)
        patched = getattr(node_class(), node_class.FUNCTION)(model=model, **json.loads(widgets))[0]
        override, problems = sampling_override(patched)
        assert override is not None and problems == [] and patch_problems(patched) == [], (class_type, widgets)
