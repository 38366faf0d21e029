"""The main job, headless: run the example workflow on a real ComfyUI with the bundled tiny model."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ..training.process.events import read_all
from .fixtures import ensure_fixtures
from .host import ComfyServer, ensure_host, history_error, output_images

PACK_DIR = Path(__file__).resolve().parent.parent
WORKFLOW = PACK_DIR / "workflows" / "api" / "pipetrainer_tiny_mmdit.json"


def newest_run_dir(root: Path) -> Path | None:
    runs = sorted((root / "output" / "pipetrainer" / "runs").glob("pipetrainer_demo-*"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def run_demo(timeout_s: float = 900.0) -> int:
    from ..training.model.comfy_env import use_comfyui

    root = ensure_host()
    use_comfyui(root)
    ensure_fixtures(root)
    prompt = json.loads(WORKFLOW.read_text())
    log = PACK_DIR / ".host" / "demo-server.log"
    start = time.time()
    with ComfyServer(root, log) as server:
        ready = time.time()
        queued = time.time()
        entry = server.wait(server.queue(prompt), timeout_s)
    done = time.time()
    error = history_error(entry)
    if error:
        print(f"FAILED: {error}\nserver log: {log}")
        return 1
    run_dir = newest_run_dir(root)
    events = read_all(run_dir) if run_dir else []
    steps = [e for e in events if e["type"] == "step"]
    saved = [e["path"] for e in events if e["type"] == "saved" and e.get("final")]
    images = output_images(entry, root)
    print(f"LoRA:   {saved[0] if saved else '?'}")
    print(f"image:  {images[0] if images else '?'}")
    print(f"run dir: {run_dir}")
    print(f"server start {ready - start:.1f} s; workflow {done - queued:.1f} s; demo wall time {done - start:.1f} s")
    if steps:
        print(f"queue -> first step {steps[0]['time'] - queued:.1f} s; "
              f"median s/step {statistics.median(e['step_time'] for e in steps):.3f}; "
              f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f} over {len(steps)} steps")
    return 0


def write_ui_workflows() -> int:
    """Regenerate each ``workflows/<name>.json`` (UI format) from ``workflows/api/<name>.json``.

    The API twins live in a subfolder because ComfyUI offers every ``workflows/*.json`` of a custom
    node pack in its template browser, and only the UI format belongs there.
    Each ``workflows/api/<name>.md`` (first line: a title) becomes the note that opens the workflow, and
    ``workflows/<name>.jpg`` the thumbnail ComfyUI's template browser shows for it.
    """
    from .workflow_ui import api_to_ui, thumbnail

    root = ensure_host()
    with ComfyServer(root, PACK_DIR / ".host" / "ui-workflow-server.log") as server:
        object_info = server.get("/object_info")
    for api_file in sorted((PACK_DIR / "workflows" / "api").glob("*.json")):
        description = api_file.with_suffix(".md")
        note = description.read_text(encoding="utf-8").strip() if description.exists() else ""
        ui = api_to_ui(json.loads(api_file.read_text()), object_info, note=note)
        target = PACK_DIR / "workflows" / api_file.name
        target.write_text(json.dumps(ui, indent=1) + "\n")
        title = note.splitlines()[0].lstrip("# ").strip() if note else api_file.stem
        thumbnail(ui, object_info, title).save(target.with_suffix(".jpg"), quality=88)
        print(target, target.with_suffix(".jpg"))
    return 0
