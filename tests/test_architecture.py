"""The tree keeps its shape: no import cycle, no module over 500 lines, and the two process boundaries.

Read from the source (devkit/import_graph.py), so a deferred import inside a function counts as well:
it hides a cycle from Python at import time, not from a reader. Each rule is also tried on a small tree
made here, so the check itself is shown to fail when the rule is broken.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pipetrainer.devkit.import_graph import Module, chain, cycles, pack_files, reached, read_graph

PACK_DIR = Path(__file__).resolve().parent.parent
MAX_LINES = 500
TRAINER_LIBRARIES = ("deepspeed", "peft")
# ComfyUI's server side: the training process runs ComfyUI's model code (comfy.*) without a server.
COMFYUI_SERVER = ("server", "nodes", "execution", "comfy_api", "comfy_execution", "folder_paths", "main")
# The adapter-type registry names each type's PEFT config and layer class through small builders that
# import PEFT when a rank calls them; the node layer reads the registry's names and rules only (the
# subprocess test below holds that importing the node layer loads no PEFT).
REGISTRY_WITH_DEFERRED_PEFT = "training.adapters.kinds"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def _oversized(root: Path) -> list[str]:
    out = []
    for path in pack_files(root):
        rel = path.relative_to(root)
        if rel.parts[0] == "tests":
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            out.append(f"{rel} ({lines} lines)")
    return out


def _node_layer_problems(graph: dict[str, Module]) -> list[str]:
    """Modules the node layer loads (its own imports, also inside its functions, then every module-level
    import from there) that import DeepSpeed or PEFT anywhere."""
    via = reached(graph, [m for m in graph if m == "nodes" or m.startswith("nodes.")], follow_deferred_in="nodes")
    out = []
    for name in sorted(via):
        for imp in graph[name].imports:
            if imp.internal or imp.target not in TRAINER_LIBRARIES:
                continue
            if name == REGISTRY_WITH_DEFERRED_PEFT and imp.target == "peft" and imp.deferred:
                continue
            out.append(f"{chain(via, name)} imports {imp.target} (line {imp.line})")
    return out


def _server_imports_in_training(graph: dict[str, Module]) -> list[str]:
    out = []
    for name, module in sorted(graph.items()):
        if not (name == "training" or name.startswith("training.")):
            continue
        for imp in module.imports:
            bad = (not imp.internal and imp.target in COMFYUI_SERVER) or (
                imp.internal and (imp.target == "nodes" or imp.target.startswith("nodes.")))
            if bad:
                out.append(f"{name} imports {'the node layer ' if imp.internal else ''}{imp.target} (line {imp.line})")
    return out


# ---- the pack ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    return read_graph(PACK_DIR)


def test_no_import_cycle_anywhere_in_the_pack(graph):
    assert cycles(graph) == []


def test_no_module_outside_tests_is_over_500_lines():
    assert _oversized(PACK_DIR) == []


def test_the_node_layer_never_reaches_deepspeed_or_peft(graph):
    assert _node_layer_problems(graph) == []


def test_importing_every_node_module_loads_no_trainer_library():
    nodes = sorted("pipetrainer." + ".".join(p.relative_to(PACK_DIR).with_suffix("").parts).removesuffix(".__init__")
                   for p in (PACK_DIR / "nodes").rglob("*.py"))
    here = str(Path(__file__).parent)
    code = (f"import sys, importlib; sys.path.insert(0, {here!r}); import conftest\n"
            "from pipetrainer.devkit.host import ensure_host\n"
            "from pipetrainer.training.model.comfy_env import use_comfyui\n"
            "use_comfyui(ensure_host(), 'cpu')\n"
            f"for name in {nodes!r}: importlib.import_module(name)\n"
            f"bad = [m for m in {TRAINER_LIBRARIES!r} if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_training_process_never_imports_the_comfyui_server_or_the_node_layer(graph):
    assert _server_imports_in_training(graph) == []


def test_every_package_says_what_it_holds(graph):
    silent = [name for name, m in graph.items() if m.is_package and name.split(".")[0] in ("training", "nodes")
              and not ast.get_docstring(ast.parse(m.path.read_text(encoding="utf-8")))]
    missing = [str(p.relative_to(PACK_DIR)) for p in (PACK_DIR / "training").rglob("*") if p.is_dir()
               and p.name != "__pycache__" and any(p.glob("*.py")) and not (p / "__init__.py").exists()]
    assert silent == [] and missing == []


# ---- the checks fail when a rule is broken -----------------------------------------------------------


def test_a_cycle_through_a_deferred_import_is_found(tmp_path):
    root = _write(tmp_path, {
        "training/__init__.py": "",
        "training/a.py": "from .b import x\n",
        "training/b.py": "x = 1\ndef f():\n    from .c import y\n",
        "training/c.py": "from pipetrainer.training import a\ny = 2\n",
        "training/d.py": "from .a import x\n",
    })
    assert cycles(read_graph(root)) == [["training.a", "training.b", "training.c"]]


def test_a_long_module_outside_tests_is_named(tmp_path):
    root = _write(tmp_path, {"training/big.py": "x = 1\n" * (MAX_LINES + 1), "training/ok.py": "x = 1\n" * MAX_LINES,
                             "tests/test_big.py": "x = 1\n" * (MAX_LINES + 1)})
    assert _oversized(root) == [f"training/big.py ({MAX_LINES + 1} lines)"]


def test_a_node_reaching_the_engine_through_a_pure_module_is_named(tmp_path):
    root = _write(tmp_path, {
        "nodes/__init__.py": "",
        "nodes/train.py": "def run():\n    from ..training import helper\n",
        "training/__init__.py": "",
        "training/helper.py": "from .loop import engine\n",
        "training/loop/__init__.py": "",
        "training/loop/engine.py": "def build():\n    import deepspeed\n",
        "training/only_called_by_ranks.py": "from .loop import engine\n",
    })
    assert _node_layer_problems(read_graph(root)) == [
        "training.loop.engine <- training.helper <- nodes.train imports deepspeed (line 2)"]


def test_a_training_module_importing_the_server_is_named(tmp_path):
    root = _write(tmp_path, {
        "training/__init__.py": "",
        "training/model.py": "import comfy.sd\ndef f():\n    import folder_paths\n",
        "training/run.py": "from ..nodes import paths\n",
        "nodes/__init__.py": "", "nodes/paths.py": "",
    })
    assert _server_imports_in_training(read_graph(root)) == ["training.model imports folder_paths (line 3)",
                                                 "training.run imports the node layer nodes.paths (line 1)"]
