"""What a newcomer sees first: Train LoRA and Dataset open with the inputs every run sets.

Read from the server's ``/object_info``, which is what the frontend draws. On a ComfyUI whose inputs can be
folded (0.33: the ``advanced`` flag), the multi-GPU, Wan / LTX-Video and bucket / video / tag / mask options
sit in the closed advanced section, each with a default so that a hidden input never lacks a value; on older
hosts nothing is folded and the widgets are as before (saved workflows keep their positions on both).
"""

from __future__ import annotations

import inspect

FIRST_RUN = {  # widgets the node shows before its advanced section is opened (they had 21 and 19; family options moved to their own node, the preset is shown)
    "PipeTrainerTrain": 11,
    "PipeTrainerDataset": 4,
}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _host_folds() -> bool:
    from comfy_api.latest import io

    return "advanced" in inspect.signature(io.Input.__init__).parameters


def _widgets(info: dict) -> dict[str, dict]:
    """Each widget input (sockets are left out) with its options."""
    out = {}
    for group in ("required", "optional"):
        for name, spec in info["input"].get(group, {}).items():
            if isinstance(spec[0], list) or spec[0] in WIDGET_TYPES:
                out[name] = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return out


def test_the_first_view_holds_what_every_run_sets(server):
    info = server.get("/object_info")
    for node, most in FIRST_RUN.items():
        inputs = _widgets(info[node])
        folded = [name for name, options in inputs.items() if options.get("advanced")]
        if not _host_folds():
            assert folded == [], node  # an older host draws every widget, as saved workflows expect
            continue
        shown = [name for name in inputs if name not in folded]
        assert len(shown) <= most, (node, shown)
        for name in folded:  # a folded input is never one a run must set
            assert name in info[node]["input"].get("optional", {}) or "default" in inputs[name], (node, name)
        assert {"lora_name", "steps", "seed", "resume", "preset"} <= set(shown) or node != "PipeTrainerTrain", shown
        assert "folder" in shown or node != "PipeTrainerDataset", shown


def test_every_tooltip_is_short_enough_to_read(server):
    """A tooltip is read while hovering: at most about 200 characters (the README's node table has the rest)."""
    info = server.get("/object_info")
    long = {}
    for node, spec in info.items():
        if spec.get("python_module", "").endswith("ComfyUI-PipeTrainer") or node.startswith("PipeTrainer"):
            for group in ("required", "optional"):
                for name, entry in spec["input"].get(group, {}).items():
                    tip = entry[1].get("tooltip", "") if len(entry) > 1 and isinstance(entry[1], dict) else ""
                    if len(tip) > 200:
                        long[f"{node}.{name}"] = len(tip)
    assert long == {}, long
