"""Converting between ComfyUI's API-format prompt and its UI (LiteGraph) workflow format, and laying it out.

The example workflow ships in both formats: UI for people (template browser, drag and drop), API for
tests and scripts. The UI file is generated from the API file with the server's ``/object_info`` and a
test converts it back, so the two can never drift apart.

Layout: nodes go in columns by their place in the graph (a node sits one column before its first
consumer, so loaders sit next to what they feed) and are stacked in each column with their drawn height
estimated from what the frontend draws (title, one row per socket, one per widget), plus room under
output nodes for the images and text they show at run time: no node covers another, before or after a
run. A description note (a frontend-only ``MarkdownNote``, never queued) opens the workflow, and
:func:`thumbnail` draws the graph for the template browser, which looks for ``<name>.jpg`` next to
``<name>.json`` and shows the file name as the template's title and description.
"""

from __future__ import annotations

import re
from typing import Any

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_DEFAULT = "fixed"
NOTE_TYPES = {"Note", "MarkdownNote"}  # frontend-only nodes: not in /object_info, never in a prompt

# What the frontends draw (LiteGraph: title 30 px, slot rows 20 px, widgets 20 px + 4 gap; the newer
# Vue node renderer draws larger rows, hence the margins).
TITLE_H = 30
SLOT_H = 24
WIDGET_H = 32
PAD_H = 24
OUTPUT_PREVIEW_H = 340  # images / progress text an output node shows under its widgets at run time
MIN_W = 320
CHAR_W = 8
COL_GAP = 60
ROW_GAP = 50
MARGIN = 40


AUTOGROW = "COMFY_AUTOGROW_V3"  # a V3 node's growing group of sockets (``io.Autogrow``): ``<group>.<slot>`` each


def _ordered_inputs(info: dict, used: dict | None = None) -> list[tuple[str, Any, dict]]:
    """``(name, kind, options)`` of each input in the frontend's order, an Autogrow group expanded into its
    sockets: every one it may have (``used`` None), or as the frontend shows them for a prompt's ``used``
    inputs (up to the last one given, and one free socket after it)."""
    out = []
    for section in ("required", "optional"):
        for name, spec in info["input"].get(section, {}).items():
            kind = spec[0]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if kind == AUTOGROW:
                out.extend(_autogrow_sockets(name, options["template"], used))
            else:
                out.append((name, kind, options))
    return out


def _autogrow_sockets(group: str, template: dict, used: dict | None) -> list[tuple[str, Any, dict]]:
    """An Autogrow group's sockets ``<group>.<slot>``; ``options["label"]`` is the slot name the node shows."""
    inner = next(spec for section in template["input"].values() for spec in section.values())
    kind, inner_options = inner[0], (inner[1] if len(inner) > 1 and isinstance(inner[1], dict) else {})
    slots = (list(template["names"]) if "names" in template
             else [f"{template['prefix']}{i}" for i in range(template["max"])])
    if used is not None:
        given = [i for i, slot in enumerate(slots) if f"{group}.{slot}" in used]
        slots = slots[:min(len(slots), (given[-1] + 2) if given else 1)]
    return [(f"{group}.{slot}", kind, {**inner_options, "label": slot, "forceInput": True}) for slot in slots]


def _is_widget(kind: Any, options: dict) -> bool:
    """A widget, not a socket: a widget type, or a multi-type input drawn as one (``"FLOAT,INT"`` with its
    ``widgetType``, e.g. LTXV Empty Latent Audio's frame_rate)."""
    kind = options.get("widgetType", kind) if isinstance(kind, str) and "," in kind else kind
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


def _socket_type(kind: Any) -> str:
    return "COMBO" if isinstance(kind, list) else str(kind)


def node_size(info: dict, used: dict | None = None) -> list[int]:
    """[width, height] of a node as the frontend draws it (height below the title bar), with room for
    run-time previews under output nodes; ``used``: the prompt's inputs of the node (its Autogrow sockets
    shown, at least one a group)."""
    inputs = _ordered_inputs(info, used if used is not None else {})
    widgets = [name for name, kind, options in inputs if _is_widget(kind, options)]
    controls = sum(1 for name, kind, options in inputs if _is_widget(kind, options)
                   and options.get("control_after_generate"))
    sockets = len(inputs) - len(widgets)
    rows = max(sockets, len(info.get("output", [])))
    height = SLOT_H * rows + WIDGET_H * (len(widgets) + controls) + PAD_H
    if info.get("output_node"):
        height += OUTPUT_PREVIEW_H
    labels = [*widgets, *(n for n, _, _ in inputs), *info.get("output_name", [])]
    width = max(MIN_W, CHAR_W * (max(map(len, labels), default=0) + 18),
                CHAR_W * (len(info.get("display_name") or "") + 6))
    return [width, height]


def _columns(api: dict[str, dict]) -> dict[str, int]:
    """Each node's column: its depth from the sources, then pulled right to just before its first consumer."""
    depth: dict[str, int] = {}

    def node_depth(key: str) -> int:
        if key not in depth:
            parents = [v[0] for v in api[key]["inputs"].values() if isinstance(v, list)]
            depth[key] = 1 + max((node_depth(p) for p in parents), default=-1)
        return depth[key]

    consumers: dict[str, list[str]] = {key: [] for key in api}
    for key, node in api.items():
        for value in node["inputs"].values():
            if isinstance(value, list):
                consumers[value[0]].append(key)
    column: dict[str, int] = {}
    for key in sorted(api, key=node_depth, reverse=True):  # consumers first
        after = [column[c] for c in consumers[key]]
        column[key] = min(after) - 1 if after else node_depth(key)
    return column


def _layout(api: dict[str, dict], object_info: dict[str, dict], top: int) -> dict[str, tuple[list[int], list[int]]]:
    """key -> (pos, size): columns left to right, nodes stacked top-down in prompt order."""
    column = _columns(api)
    sizes = {key: node_size(object_info[node["class_type"]], node["inputs"]) for key, node in api.items()}
    widths: dict[int, int] = {}
    for key, col in column.items():
        widths[col] = max(widths.get(col, 0), sizes[key][0])
    x_of, x = {}, MARGIN
    for col in sorted(widths):
        x_of[col] = x
        x += widths[col] + COL_GAP
    y_next: dict[int, int] = {}
    placed = {}
    for key in api:
        col = column[key]
        y = y_next.get(col, top + TITLE_H)
        placed[key] = ([x_of[col], y], sizes[key])
        y_next[col] = y + sizes[key][1] + ROW_GAP + TITLE_H
    return placed


def api_to_ui(api: dict[str, dict], object_info: dict[str, dict], note: str = "") -> dict:
    """A UI workflow with the same nodes, links and widget values as the API prompt (plus ``note``, a
    Markdown description shown above the graph, when given)."""
    ids = {key: int(key) for key in api}
    note_size = [2 * MIN_W + COL_GAP, 220]
    top = MARGIN + (note_size[1] + TITLE_H + ROW_GAP if note else 0)
    placed = _layout(api, object_info, top)
    nodes, links = [], []
    outputs_links: dict[tuple[str, int], list[int]] = {}
    for key, node in api.items():
        info = object_info[node["class_type"]]
        inputs, widgets = [], []
        for name, kind, options in _ordered_inputs(info, used=node["inputs"]):
            value = node["inputs"].get(name)
            if _is_widget(kind, options) and not isinstance(value, list):
                widgets.append((value, kind, options))
                continue
            link_id = None
            if isinstance(value, list):
                link_id = len(links) + 1
                src, slot = value
                src_type = object_info[api[src]["class_type"]]["output"][slot]
                links.append([link_id, ids[src], slot, ids[key], len(inputs), src_type])
                outputs_links.setdefault((src, slot), []).append(link_id)
            if "label" in options:  # an Autogrow socket: stored linked or not, as the frontend saves them
                inputs.append({"label": options["label"], "name": name, "shape": 7, "type": _socket_type(kind),
                               "link": link_id})
            elif link_id is not None:
                inputs.append({"name": name, "type": _socket_type(kind), "link": link_id})
        pos, size = placed[key]
        widgets = _widget_values(widgets)
        nodes.append({
            "id": ids[key], "type": node["class_type"], "pos": pos, "size": size, "flags": {}, "order": 0,
            "mode": 0, "inputs": inputs, "outputs": [],
            "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": widgets,
        })
    for n, key in zip(nodes, api, strict=True):
        info = object_info[api[key]["class_type"]]
        names = info.get("output_name", info["output"])
        n["outputs"] = [{"name": names[i], "type": t, "links": outputs_links.get((key, i), []), "slot_index": i}
                        for i, t in enumerate(info["output"])]
    order = sorted(api, key=lambda k: (placed[k][0][0], placed[k][0][1]))
    for n in nodes:
        n["order"] = order.index(str(n["id"]))
    last_id = max(ids.values())
    if note:
        last_id += 1
        nodes.append({"id": last_id, "type": "MarkdownNote", "pos": [MARGIN, MARGIN + TITLE_H], "size": note_size,
                      "flags": {}, "order": len(nodes), "mode": 0, "inputs": [], "outputs": [],
                      "properties": {}, "widgets_values": [note]})
    return {"last_node_id": last_id, "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"pipetrainer_description": note} if note else {}, "version": 0.4}


def ui_to_api(ui: dict, object_info: dict[str, dict]) -> dict[str, dict]:
    """The API prompt a UI workflow queues (what the frontend's graphToPrompt produces for plain nodes)."""
    links = {link[0]: link for link in ui["links"]}
    api: dict[str, dict] = {}
    for node in ui["nodes"]:
        if node["type"] in NOTE_TYPES:
            continue
        info = object_info[node["type"]]
        values = list(node.get("widgets_values", []))
        by_name = {i["name"]: i for i in node.get("inputs", [])}
        inputs: dict[str, Any] = {}
        for name, kind, options in _ordered_inputs(info):
            socket = by_name.get(name)
            if socket is not None and socket.get("link") is not None:
                link = links[socket["link"]]
                inputs[name] = [str(link[1]), link[2]]
            elif _is_widget(kind, options) and values:
                inputs[name] = values.pop(0)
                if options.get("control_after_generate") and values:
                    values.pop(0)
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return api


def node_boxes(ui: dict) -> dict[int, tuple[float, float, float, float]]:
    """node id -> (left, top, right, bottom) on the canvas, title bar included (LiteGraph draws the title
    above ``pos``)."""
    return {n["id"]: (n["pos"][0], n["pos"][1] - TITLE_H, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
            for n in ui["nodes"]}


def overlapping_nodes(ui: dict) -> list[tuple[int, int]]:
    """Pairs of node ids whose boxes overlap."""
    boxes = sorted(node_boxes(ui).items())
    out = []
    for i, (a, (al, at, ar, ab)) in enumerate(boxes):
        for b, (bl, bt, br, bb) in boxes[i + 1:]:
            if al < br and bl < ar and at < bb and bt < ab:
                out.append((a, b))
    return out


def thumbnail(ui: dict, object_info: dict[str, dict], title: str, width: int = 640, height: int = 400):
    """A picture of the workflow's graph (a PIL image) for the template browser's card."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (width, height), (32, 33, 38))
    draw = ImageDraw.Draw(img)
    header = 48
    size = 20  # the title fits the picture: smaller type for a long one, never cut off
    while size > 12 and ImageFont.load_default(size=size).getlength(title) > width - 32:
        size -= 1
    draw.text((16, 12), title, fill=(235, 235, 240), font=ImageFont.load_default(size=size))
    boxes = {i: b for i, b in node_boxes(ui).items()
             if next(n for n in ui["nodes"] if n["id"] == i)["type"] not in NOTE_TYPES}
    left = min(b[0] for b in boxes.values())
    top = min(b[1] for b in boxes.values())
    right = max(b[2] for b in boxes.values())
    bottom = max(b[3] for b in boxes.values())
    scale = min((width - 24) / (right - left), (height - header - 12) / (bottom - top))

    def at(x: float, y: float) -> tuple[float, float]:
        return 12 + (x - left) * scale, header + (y - top) * scale

    for _, src, _, dst, _, _ in ui["links"]:
        s, d = boxes[src], boxes[dst]
        draw.line([at(s[2], s[1] + 40), at(d[0], d[1] + 40)], fill=(120, 160, 220), width=2)
    font = ImageFont.load_default(size=max(10, int(40 * scale)))
    for node in ui["nodes"]:
        if node["type"] in NOTE_TYPES:
            continue
        x0, y0, x1, y1 = boxes[node["id"]]
        ours = node["type"].startswith("PipeTrainer")
        fill = (78, 62, 120) if ours else (58, 62, 70)
        draw.rounded_rectangle([at(x0, y0), at(x1, y1)], radius=6, fill=fill, outline=(150, 150, 160))
        name = (object_info.get(node["type"], {}).get("display_name") or node["type"]).replace(" (PipeTrainer)", "")
        x, y = at(x0, y0)
        room = (x1 - x0) * scale - 8
        while name and font.getlength(name) > room:
            name = name[:-2] + "…" if len(name) > 2 else ""
        draw.text((x + 5, y + 4), name, fill=(240, 240, 245), font=font)
    return img


# ---- checking an API prompt against a server's /object_info -------------------------------------------
# Combo inputs that name the user's own files: their values are the file names of the model's usual release
# (what ComfyUI's own templates use), never in a test host's lists.
FILE_INPUTS = {"unet_name", "ckpt_name", "clip_name", "clip_name1", "clip_name2", "clip_name3",
               "clip_name4", "vae_name",
               "lora_name", "image", "video", "audio", "model_name", "control_net_name", "style_model_name",
               "file", "text_encoder", "audio_encoder_name"}  # "file": LoadVideo's (the VACE example's control
# video); "text_encoder": LTXAVTextEncoderLoader's; "audio_encoder_name": AudioEncoderLoader's (Wan S2V)
FILE_SUFFIXES = (".safetensors", ".sft", ".gguf", ".pt", ".pth", ".ckpt", ".bin", ".png", ".jpg", ".jpeg",
                 ".webp", ".mp4", ".webm", ".mp3", ".wav", ".flac")
_REQUIRES = re.compile(r"Needs ComfyUI (\d+(?:\.\d+)*) or newer", re.IGNORECASE)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.3.75"`` -> ``(0, 3, 75)`` (a suffix such as ``-rc1`` is ignored)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("-")[0])[:3])


def required_comfyui(description: str) -> tuple[int, ...] | None:
    """The oldest ComfyUI a workflow's nodes exist in, from its description's "Needs ComfyUI X.Y.Z or newer."
    line (None: what this pack supports anyway). The line is for users and tests alike."""
    match = _REQUIRES.search(description)
    return version_tuple(match.group(1)) if match else None


def widget_names(info: dict) -> list[str]:
    """The node's widget inputs in the order the frontend stores their values in ``widgets_values``."""
    return [name for name, kind, options in _ordered_inputs(info) if _is_widget(kind, options)]


def _widget_values(widgets: list[tuple[Any, Any, dict]]) -> list:
    """``widgets_values`` for (value or None, kind, options) in widget order. The frontend reads them by
    position and keeps its defaults past the end: trailing unset widgets are left out, a gap before a set
    one takes the widget's default; a seed's control value follows it."""
    while widgets and widgets[-1][0] is None:
        widgets = widgets[:-1]
    out = []
    for value, kind, options in widgets:
        out.append(_default_value(kind, options) if value is None else value)
        if options.get("control_after_generate"):
            out.append(CONTROL_DEFAULT)
    return out


def _default_value(kind: Any, options: dict) -> Any:
    """What the frontend shows in a widget the workflow gives no value: its default, else a combo's first
    choice (an empty list of choices, as for a folder without files: "")."""
    if "default" in options:
        return options["default"]
    choices = _combo_options(kind, options)
    return choices[0] if choices else ""


def _combo_options(kind: Any, options: dict) -> list | None:
    if isinstance(kind, list):
        return kind
    if kind == "COMBO":
        return list(options.get("options", []))
    return None


def _value_problem(name: str, kind: Any, options: dict, value: Any) -> str | None:
    choices = _combo_options(kind, options)
    if choices is not None:
        if name in FILE_INPUTS:
            ok = isinstance(value, str) and value.lower().endswith(FILE_SUFFIXES)
            return None if ok else f"{value!r} is not a file name"
        return None if value in choices else f"{value!r} is not one of {choices}"
    kind = options.get("widgetType", kind) if isinstance(kind, str) and "," in kind else kind  # "FLOAT,INT"
    checks = {"INT": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "FLOAT": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "BOOLEAN": lambda v: isinstance(v, bool), "STRING": lambda v: isinstance(v, str)}
    if kind not in checks:
        return f"{value!r} given for a {kind} socket (needs a link)"
    if not checks[kind](value):
        return f"{value!r} is not a {kind}"
    if kind in ("INT", "FLOAT"):
        low, high = options.get("min"), options.get("max")
        if (low is not None and value < low) or (high is not None and value > high):
            return f"{value!r} is outside [{low}, {high}]"
    return None


def _accepts(socket: Any, produced: str) -> bool:
    kinds = {"COMBO"} if isinstance(socket, list) else set(str(socket).split(","))
    return "*" in kinds or produced == "*" or produced in kinds


def api_problems(api: dict[str, dict], object_info: dict[str, dict]) -> list[str]:
    """Everything a server would refuse in an API prompt, checked against its ``/object_info`` without
    running it: unknown nodes and inputs, missing required inputs, links to missing nodes or slots or of
    another type, widget values of the wrong type, out of range or not among a combo's choices (file-name
    combos excepted: they hold the user's file names), and widgets given out of order (a UI file stores
    widget values by position, so the ones given must come first)."""
    problems = []
    for key, node in api.items():
        cls = node.get("class_type")
        info = object_info.get(cls)
        if info is None:
            problems.append(f"node {key}: {cls} is not a node of this ComfyUI")
            continue
        spec = {name: (kind, options) for name, kind, options in _ordered_inputs(info)}
        required = info["input"].get("required", {})
        for name in required:
            if name not in node["inputs"]:
                problems.append(f"node {key} ({cls}): required input {name!r} is missing")
        for name, value in node["inputs"].items():
            where = f"node {key} ({cls}).{name}"
            if name not in spec:
                problems.append(f"{where}: not an input of {cls}")
                continue
            kind, options = spec[name]
            if isinstance(value, list):
                src, slot = value
                source = api.get(str(src))
                outputs = object_info.get(source["class_type"], {}).get("output", []) if source else []
                if not isinstance(slot, int) or not 0 <= slot < len(outputs):
                    problems.append(f"{where}: links to a missing node or output {value}")
                elif not _accepts(kind, outputs[slot]):
                    problems.append(f"{where}: a {_socket_type(kind)} input linked to a {outputs[slot]} output")
                continue
            problem = _value_problem(name, kind, options, value)
            if problem:
                problems.append(f"{where}: {problem}")
        order = [name for name in widget_names(info) if not isinstance(node["inputs"].get(name), list)]
        given = [name for name in order if name in node["inputs"]]
        if given != order[:len(given)]:
            problems.append(f"node {key} ({cls}): widgets {given} leave a gap in {order}: the UI file would "
                            "shift the later values into the wrong widgets")
    return problems
