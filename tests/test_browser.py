"""The example workflows in ComfyUI's real frontend, as a user meets them (headless Chromium).

Debian's Chromium driven by Playwright (PyPI, no browser download): the test installs Chromium with
apt-get when it is missing and the test runs as root (as CI does); elsewhere it is skipped with the
command to run. The frontend is the one the test host serves (ComfyUI's pinned frontend package).

What it checks, through the page itself:
- every PipeTrainer template opens from the template browser (EXTENSIONS > ComfyUI-PipeTrainer), with
  no missing node type and no red node;
- a bad ``lora_name`` typed into the Train node is refused when queued, and the error the user sees
  names that widget;
- a bad dataset (a file without a caption, a PNG cut short) queued with a bad ``lora_name`` gives one error
  report for the queue that names each problem once, and starts nothing;
- the tiny example, with a Preview Settings and a Validation Loss node added from the page and queued
  with the Run button, shows progress text and the loss-curve picture on the Train node while it runs,
  and ends with the LoRA file and the validation loss named on the node and the sample previews shown.
Screenshots of each stage are kept in ``.artifacts/browser/`` (or ``$PIPETRAINER_ARTIFACTS``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from pipetrainer.devkit.workflow_ui import FILE_SUFFIXES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted(p.stem for p in (REPO / "workflows").glob("*.json"))
PACK_TEMPLATES = "ComfyUI-PipeTrainer"
TINY = "pipetrainer_tiny_mmdit"
TEXT_WIDGET = "$$node-text-preview"  # the frontend's widget for a node's progress text


def _chromium() -> str:
    """Debian's Chromium, installed with apt-get when missing and allowed (root with apt, as on CI)."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Chromium is not installed: run `apt-get install chromium` (Debian) to run the browser test")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env, timeout=900,
                   capture_output=True)
    found = shutil.which("chromium")
    assert found, "apt-get installed chromium but it is not on PATH"
    return found


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("PIPETRAINER_ARTIFACTS", REPO / ".artifacts")) / "browser"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def page(server, artifacts):
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = _chromium()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": 1600, "height": 1000})
        tab.set_default_timeout(60_000)
        tab.goto(server.url)
        tab.wait_for_function("() => window.app && window.app.graph && window.LiteGraph", timeout=120_000)
        yield tab
        browser.close()


def _template_dialog(page):
    """The template browser, open on this pack's templates."""
    dialogs = page.locator("[role=dialog]")
    templates = dialogs.filter(has_text=PACK_TEMPLATES)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        time.sleep(1)  # let a dialog that is opening (a new user's first visit opens it) or closing settle
        if templates.count() and templates.first.is_visible():
            break
        if dialogs.count():  # another dialog (an error report) is in the way
            page.keyboard.press("Escape")
            continue
        page.get_by_text("Templates", exact=True).first.click()
    templates.first.wait_for(timeout=10_000)
    templates.get_by_role("button", name=PACK_TEMPLATES, exact=True).click()
    return templates


def _open_template(page, name: str) -> None:
    """Click template ``name`` in this pack's templates, found through the browser's search box where it has
    one: the grid draws its first page of cards only, in the server's file order."""
    dialog = _template_dialog(page)
    search = dialog.get_by_placeholder("Search")
    if search.count():
        search.first.fill(name)
    dialog.get_by_text(name, exact=True).first.click()


USER_FILE = FILE_SUFFIXES  # model files, the user's own images, clips and sound: what a template leaves to the user


def _graph_nodes(page) -> list[dict]:
    """Each node's type, whether the frontend knows it, whether it is drawn red, and the values of its
    combo widgets that are not among the host's choices (model files the user has yet to download, the
    user's own input images: newer frontends draw such loaders red, as for ComfyUI's own templates)."""
    return page.evaluate("""() => window.app.graph._nodes.map(n => ({
        id: n.id, type: n.type, registered: !!window.LiteGraph.registered_node_types[n.type],
        errors: !!n.has_errors,
        absent: (n.widgets || []).filter(w => w.options && Array.isArray(w.options.values) &&
                                             !w.options.values.includes(w.value)).map(w => String(w.value))}))""")


def _red_for_another_reason(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n["errors"] and not (n["absent"] and all(v.lower().endswith(USER_FILE) for v in n["absent"]))]


def _for_this_host(server) -> list[str]:
    """The examples this host's ComfyUI can open: an example whose description says "Needs ComfyUI X or
    newer" uses nodes an older host lacks (its frontend would rightly show them missing)."""
    from pipetrainer.devkit.workflow_ui import required_comfyui, version_tuple

    host = version_tuple(server.get("/system_stats")["system"]["comfyui_version"])
    out = []
    for name in WORKFLOWS:
        description = REPO / "workflows" / "api" / f"{name}.md"
        needed = required_comfyui(description.read_text(encoding="utf-8")) if description.exists() else None
        if needed is None or host >= needed:
            out.append(name)
    return out


@pytest.mark.frontend
def test_every_example_opens_from_the_template_browser_without_missing_or_red_nodes(page, artifacts, server):
    """In each host's own frontend (CI runs this test on the current ComfyUI and on 0.3.75)."""
    # The graph's signature: ids, types and widget values (two examples may share their nodes, e.g. SD 1.5
    # and SDXL, but never their files), so each load changes it.
    signature = "JSON.stringify(window.app.graph._nodes.map(n => [n.id, n.type, n.widgets_values]))"
    names = _for_this_host(server)
    assert TINY in names and len(names) >= len(WORKFLOWS) // 2, names
    for name in names:  # each opened once, so each load changes the graph
        before = page.evaluate(f"() => {signature}")
        _open_template(page, name)
        try:
            page.wait_for_function(f"(before) => !document.querySelector('[role=dialog]') && {signature} !== before",
                                   arg=before)
        except Exception as exc:  # name the template and keep what the page showed
            page.screenshot(path=str(artifacts / f"template_{name}_failed.png"))
            raise AssertionError(f"{name} did not open: {exc}") from exc
        time.sleep(0.5)  # the graph is configured in one go; let a missing-nodes dialog open
        nodes = _graph_nodes(page)
        if name == TINY:
            page.screenshot(path=str(artifacts / f"template_{name}.png"))
        expected = json.loads((REPO / "workflows" / f"{name}.json").read_text())["nodes"]
        assert len(nodes) == len(expected), name
        assert [n for n in nodes if not n["registered"]] == [], f"{name}: missing node types"
        assert _red_for_another_reason(nodes) == [], f"{name}: red nodes"
        assert page.locator("[role=dialog]").filter(has_text="Missing").count() == 0, f"{name}: missing-nodes dialog"


def _open_tiny(page):
    # Cleared first: the graph the previous test left (another example's) has a Train node too, and the template
    # loads after the click returns, so the Train node waited for must be the template's own.
    page.evaluate("() => window.app.graph.clear()")
    _open_template(page, TINY)
    page.wait_for_function("() => !document.querySelector('[role=dialog]') && "
                           "window.app.graph._nodes.some(n => n.type === 'PipeTrainerTrain')")
    return page.evaluate("() => window.app.graph._nodes.find(n => n.type === 'PipeTrainerTrain').id")


def _set_widget(page, node_id: int, name: str, value) -> None:
    page.evaluate("""([id, name, value]) => {
        const node = window.app.graph.getNodeById(id);
        const widget = node.widgets.find(w => w.name === name);
        widget.value = value;
        if (widget.callback) widget.callback(value);
        node.setDirtyCanvas(true, true);
    }""", [node_id, name, value])


def _add_node(page, node_type: str, widgets: dict, sources: dict, target: tuple[int, str]) -> int:
    """Add a node as a user would from the node library: widgets set, ``sources`` {input: (node id, output
    slot)} wired in, its first output wired to ``target`` (node id, input name); returns its id."""
    return page.evaluate("""([type, widgets, sources, target]) => {
        const graph = window.app.graph;
        const node = window.LiteGraph.createNode(type);
        graph.add(node);
        for (const [name, value] of Object.entries(widgets)) node.widgets.find(w => w.name === name).value = value;
        for (const [name, [id, slot]] of Object.entries(sources))
            graph.getNodeById(id).connect(slot, node, node.findInputSlot(name));
        const to = graph.getNodeById(target[0]);
        node.connect(0, to, to.findInputSlot(target[1]));
        return node.id;
    }""", [node_type, widgets, sources, list(target)])


def _run(page) -> None:
    page.get_by_role("button", name="Run").first.click()


def test_a_bad_lora_name_is_refused_on_its_widget_where_the_user_sees_it(page, artifacts):
    train = _open_tiny(page)
    _set_widget(page, train, "lora_name", "../evil")
    _run(page)
    try:  # 0.3.75's frontend opens a dialog with the message; newer ones show "1 ERROR" and "See Errors"
        page.wait_for_function("() => ['lora_name', 'See Errors'].some(t => document.body.innerText.includes(t))",
                               timeout=60_000)
        if "lora_name" not in page.evaluate("() => document.body.innerText"):
            page.get_by_text("See Errors", exact=True).first.click()
        page.wait_for_function("() => document.body.innerText.includes('lora_name')", timeout=30_000)
        # frontend 1.49 shows a toast ("rejected the value for lora_name", "View details") that opens an
        # errors panel listing "Train LoRA (PipeTrainer) - lora_name"; its info button shows the message
        if "must be a plain file name" not in page.evaluate("() => document.body.innerText"):
            page.get_by_text("View details", exact=True).first.click()
            page.locator("button[aria-label^='Info for'][aria-label$='lora_name']").first.click()
            page.wait_for_function("() => document.body.innerText.includes('must be a plain file name')",
                                   timeout=30_000)
    finally:
        page.screenshot(path=str(artifacts / "bad_lora_name.png"))
    shown = page.evaluate("() => document.body.innerText")
    # (newer frontends HTML-escape the quoted value in their error panel: check the words around it)
    assert "lora_name" in shown and "must be a plain file name" in shown, shown[-2000:]
    errors = page.evaluate("(id) => window.app.lastNodeErrors && window.app.lastNodeErrors[String(id)]", train)
    assert errors, "the Train node has no validation error"
    assert {e["extra_info"]["input_name"] for e in errors["errors"]} == {"lora_name"}  # on that widget only


def test_the_tiny_example_shows_progress_previews_the_loss_curve_and_where_the_lora_went(page, artifacts):
    train = _open_tiny(page)
    name = f"browser_{secrets.token_hex(3)}"
    _set_widget(page, train, "lora_name", name)
    _set_widget(page, train, "steps", 6)
    loaders = {n["type"]: n["id"] for n in _graph_nodes(page)}
    _add_node(page, "PipeTrainerPreviewSettings",
              {"prompts": "a red circle", "width": 64, "height": 64, "steps": 2, "every_n_steps": 3},
              {"clip": (loaders["CLIPLoader"], 0), "vae": (loaders["VAELoader"], 0)}, (train, "previews"))
    _add_node(page, "PipeTrainerValidation", {"every_n_steps": 3, "fraction": 0.25, "noise_levels": 2}, {},
              (train, "validation"))
    _run(page)
    text = f"() => {{ const w = (window.app.graph.getNodeById({train}).widgets || []).find(w => w.name === '{TEXT_WIDGET}'); return w ? String(w.value) : ''; }}"
    page.wait_for_function(f"() => ({text})().includes('step ')", timeout=300_000)
    page.screenshot(path=str(artifacts / "running.png"))
    page.wait_for_function(f"() => ({text})().startsWith('done')", timeout=300_000)
    page.screenshot(path=str(artifacts / "done.png"))
    shown = page.evaluate(text)
    assert f"{name}.safetensors" in shown and "run folder" in shown, shown
    assert "validation loss" in shown, shown
    previews = page.evaluate(f"() => (window.app.nodePreviewImages || {{}})['{train}'] || []")
    assert previews, "no loss-curve picture reached the Train node while it ran"
    images = page.evaluate(f"() => ((window.app.nodeOutputs || {{}})['{train}'] || {{}}).images || []")
    assert images, "the Train node shows no sample preview at the end"



def _bad_dataset(folder: Path) -> dict[str, str]:
    """A folder with two problems at once, beside a good captioned image: an image without a caption and a
    captioned PNG cut short; returns the file names."""
    from PIL import Image

    folder.mkdir(parents=True)
    names = {"good": "good.png", "uncaptioned": "no_caption_here.png", "cut": "cut_short.png"}
    for key, name in names.items():
        Image.new("RGB", (64, 64), (40 * len(key), 90, 160)).save(folder / name)
        if key != "uncaptioned":
            (folder / name).with_suffix(".txt").write_text(f"a {key} square")
    data = (folder / names["cut"]).read_bytes()
    (folder / names["cut"]).write_bytes(data[: len(data) // 2])
    return names


def test_a_bad_dataset_gives_one_dialog_listing_every_problem_once(page, artifacts, tmp_path, server):
    """Issue #26: a folder with a file without a caption and a PNG cut short, and a bad ``lora_name`` on the
    Train node, queued with the Run button: one error report for the queue, naming each problem once."""
    train = _open_tiny(page)
    names = _bad_dataset(tmp_path / "bad_dataset")
    lora_name = f"../evil_{secrets.token_hex(3)}"
    dataset = page.evaluate("() => window.app.graph._nodes.find(n => n.type === 'PipeTrainerDataset').id")
    _set_widget(page, dataset, "folder", str(tmp_path / "bad_dataset"))
    _set_widget(page, dataset, "missing_caption", "error")
    _set_widget(page, train, "lora_name", lora_name)
    queue = "() => fetch('/queue').then(r => r.json()).then(q => q.queue_running.length + q.queue_pending.length)"
    deadline = time.monotonic() + 300
    while page.evaluate(queue) and time.monotonic() < deadline:  # an earlier test's run (its sampling) ends first
        time.sleep(1)
    progress = f"""() => ((window.app.graph.getNodeById({train}).widgets || [])
                         .find(w => w.name === '{TEXT_WIDGET}') || {{}}).value || ''"""
    progress_before = page.evaluate(progress)
    queued = []

    def on_request(request):
        if request.method == "POST" and request.url.endswith("/prompt"):
            queued.append(request)

    page.on("request", on_request)
    problems = {"the file without a caption": names["uncaptioned"], "the PNG cut short": names["cut"],
                "the bad lora_name": "must be a plain file name", "its value": lora_name.lstrip("./")}
    body = "() => document.body.innerText"
    try:
        _run(page)
        # 0.3.75's frontend opens a dialog with every message; 1.49 shows one notice ("2 errors found",
        # "View details") that opens the errors panel, where each entry's info button shows its message
        page.wait_for_function("() => /errors? found|Prompt outputs failed validation/i.test(document.body.innerText)",
                               timeout=60_000)
        time.sleep(3)  # a second report of the same queue would be open by now
        dialogs = page.locator("[role=dialog]").filter(has_text=names["uncaptioned"])
        notices = page.get_by_text(re.compile(r"^\d+ errors? found$"))
        assert dialogs.count() + notices.count() == 1, page.evaluate(body)[-3000:]
        if notices.count():
            assert notices.first.inner_text().strip() == "2 errors found"  # one per node: Dataset, Train LoRA
            page.get_by_text("View details", exact=True).first.click()
            page.get_by_text("Errors detected", exact=True).wait_for(timeout=30_000)
            infos = page.locator("button[aria-label^='Info for']")
            labels = sorted(infos.nth(i).get_attribute("aria-label") for i in range(infos.count()))
            assert labels == ["Info for Dataset (PipeTrainer) - dataset",
                              "Info for Train LoRA (PipeTrainer) - lora_name"], labels
            for i in range(infos.count()):
                infos.nth(i).click()
            page.wait_for_function(f"() => {json.dumps(list(problems.values()))}.every(t => ({body})().includes(t))",
                                   timeout=30_000)
            time.sleep(1)  # the messages unfold: let the screenshot show them whole
            assert page.get_by_text("Errors detected", exact=True).count() == 1
    finally:
        page.screenshot(path=str(artifacts / "bad_dataset.png"))
        page.remove_listener("request", on_request)
    shown = page.evaluate(body)
    for what, text in problems.items():
        assert shown.count(text) == 1, f"{what} ({text!r}) is shown {shown.count(text)} times:\n{shown[-3000:]}"
    assert len(queued) == 1, f"the Run button sent {len(queued)} prompts"
    # nothing started: the server refused the prompt, the queue is empty, the Train node shows no progress (the
    # runs folder is not looked at: it is the host's, shared with the other pytest worker's runs)
    assert queued[0].response().status == 400, queued[0].response().status
    time.sleep(2)
    assert page.evaluate(queue) == 0, "a prompt was queued"
    assert page.evaluate(progress) == progress_before, page.evaluate(progress)
