"""Converting between ComfyUI's API-format prompt and its UI (LiteGraph) workflow format.

The example workflow ships in both formats: UI for people (template browser, drag and drop), API for
tests and scripts. The UI file is generated from the API file with the server's ``/object_info`` and a
test converts it back, so the two can never drift apart.
"""

from __future__ import annotations

from typing import Any

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_DEFAULT = "fixed"


def _ordered_inputs(info: dict) -> list[tuple[str, Any, dict]]:
    out = []
    for section in ("required", "optional"):
        for name, spec in info["input"].get(section, {}).items():
            kind = spec[0]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out.append((name, kind, options))
    return out


def _is_widget(kind: Any, options: dict) -> bool:
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


def _socket_type(kind: Any) -> str:
    return "COMBO" if isinstance(kind, list) else str(kind)


def api_to_ui(api: dict[str, dict], object_info: dict[str, dict]) -> dict:
    """A UI workflow with the same nodes, links and widget values as the API prompt."""
    ids = {key: int(key) for key in api}
    depth: dict[str, int] = {}

    def node_depth(key: str) -> int:
        if key not in depth:
            parents = [v[0] for v in api[key]["inputs"].values() if isinstance(v, list)]
            depth[key] = 1 + max((node_depth(p) for p in parents), default=-1)
        return depth[key]

    nodes, links, rows = [], [], {}
    outputs_links: dict[tuple[str, int], list[int]] = {}
    for key, node in api.items():
        info = object_info[node["class_type"]]
        inputs, widgets = [], []
        for name, kind, options in _ordered_inputs(info):
            value = node["inputs"].get(name)
            if _is_widget(kind, options) and not isinstance(value, list):
                if value is None:
                    continue
                widgets.append(value)
                if options.get("control_after_generate"):
                    widgets.append(CONTROL_DEFAULT)
                continue
            if isinstance(value, list):
                link_id = len(links) + 1
                src, slot = value
                src_type = object_info[api[src]["class_type"]]["output"][slot]
                links.append([link_id, ids[src], slot, ids[key], len(inputs), src_type])
                outputs_links.setdefault((src, slot), []).append(link_id)
                inputs.append({"name": name, "type": _socket_type(kind), "link": link_id})
        col = node_depth(key)
        row = rows.get(col, 0)
        rows[col] = row + 1
        nodes.append({
            "id": ids[key], "type": node["class_type"], "pos": [40 + 360 * col, 40 + 300 * row],
            "size": [320, 260], "flags": {}, "order": 0, "mode": 0, "inputs": inputs, "outputs": [],
            "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": widgets,
        })
    for n, key in zip(nodes, api, strict=True):
        info = object_info[api[key]["class_type"]]
        names = info.get("output_name", info["output"])
        n["outputs"] = [{"name": names[i], "type": t, "links": outputs_links.get((key, i), []), "slot_index": i}
                        for i, t in enumerate(info["output"])]
    order = sorted(api, key=node_depth)
    for n in nodes:
        n["order"] = order.index(str(n["id"]))
    return {"last_node_id": max(ids.values()), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def ui_to_api(ui: dict, object_info: dict[str, dict]) -> dict[str, dict]:
    """The API prompt a UI workflow queues (what the frontend's graphToPrompt produces for plain nodes)."""
    links = {link[0]: link for link in ui["links"]}
    api: dict[str, dict] = {}
    for node in ui["nodes"]:
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
