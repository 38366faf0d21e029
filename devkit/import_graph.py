"""The pack's import graph, read from the source with ``ast`` (nothing is imported or run).

The architecture test (tests/test_architecture.py) holds the tree to its rules with it: no import cycle,
the node layer never loads DeepSpeed or PEFT, the training process never imports ComfyUI's server. Every
import counts, also one inside a function: a deferred import hides a cycle from Python, not from a reader.

Module names are relative to the pack root (``training.spec.run_spec``); the pack itself is imported as
``pipetrainer``, so ``pipetrainer.x`` and relative imports are the pack's, any other absolute name is a
third-party module, except a script folder's own siblings (``bench/`` imports ``_pack`` by plain name).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "pipetrainer"
SKIPPED_FOLDERS = ("custom_nodes",)  # test fixtures that ComfyUI loads as their own packs


@dataclass(frozen=True)
class Import:
    """One imported name: a pack module (``internal``) or a third-party top-level package."""

    target: str
    internal: bool
    deferred: bool  # inside a function body: runs when the function is called, not on import
    line: int


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def pack_files(root: Path) -> Iterator[Path]:
    """Every Python file of the pack: not hidden folders (.venv, .host), not test fixture packs."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p.startswith(".") for p in rel) or any(p in SKIPPED_FOLDERS for p in rel):
            continue
        yield path


def read_graph(root: Path) -> dict[str, Module]:
    root = root.resolve()
    modules = {module_name(root, p): Module(module_name(root, p), p, p.name == "__init__.py")
               for p in pack_files(root)}
    for module in modules.values():
        module.imports = list(_imports(module, modules))
    return modules


def _imports(module: Module, modules: dict[str, Module]) -> Iterator[Import]:
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    siblings = module.path.parent

    def absolute(name: str) -> tuple[str, bool]:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            return name[len(PACKAGE) + 1:], True
        top = name.split(".")[0]
        if (siblings / f"{top}.py").exists() and not (siblings / "__init__.py").exists():
            return f"{package}.{top}" if package else top, True  # a script folder's sibling
        return top, False

    def visit(node: ast.AST, deferred: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target, internal = absolute(alias.name)
                    yield Import(_existing(target, modules) if internal else target, internal, inner, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".") if package else []
                    parts = parts[:len(parts) - (child.level - 1)]
                    base, internal = ".".join([*parts, *([child.module] if child.module else [])]), True
                else:
                    base, internal = absolute(child.module or "")
                for alias in child.names:
                    if not internal:
                        yield Import(base, False, inner, child.lineno)
                        break
                    candidate = f"{base}.{alias.name}" if base else alias.name
                    target = candidate if candidate in modules else _existing(base, modules)
                    yield Import(target, True, inner, child.lineno)
            yield from visit(child, inner)

    yield from visit(ast.parse(module.path.read_text(encoding="utf-8")), False)


def _existing(name: str, modules: dict[str, Module]) -> str:
    """The longest prefix of ``name`` that is a pack module (``a.b.c`` for an attribute ``c`` of ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Every set of pack modules that import each other round in a circle (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def edges(name: str) -> list[str]:
        return sorted({i.target for i in modules[name].imports if i.internal and i.target in modules})

    def connect(start: str) -> None:  # iterative, so a deep tree cannot hit the recursion limit
        work = [(start, iter(edges(start)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges(child))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges(node):
                    found.append(sorted(component))

    for name in sorted(modules):
        if name not in index:
            connect(name)
    return found


def reached(modules: dict[str, Module], starts: Iterable[str], follow_deferred_in: str) -> dict[str, str]:
    """Pack modules loaded when the modules ``starts`` are imported and their own functions run: every
    import of a module under ``follow_deferred_in``, the module-level imports of every other reached one.
    Returns ``{module: the module that imported it}`` (the start modules map to "")."""
    via = {s: "" for s in starts}
    todo = list(via)
    while todo:
        name = todo.pop()
        own = name == follow_deferred_in or name.startswith(follow_deferred_in + ".")
        for imp in modules[name].imports:
            if imp.internal and imp.target in modules and imp.target not in via and (own or not imp.deferred):
                via[imp.target] = name
                todo.append(imp.target)
    return via


def chain(via: dict[str, str], name: str) -> str:
    """``a <- b <- c``: how ``name`` came to be reached."""
    out = [name]
    while via.get(out[-1]):
        out.append(via[out[-1]])
    return " <- ".join(out)
