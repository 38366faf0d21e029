"""The training loop's collectives: right on real gloo ranks in seconds, and right for NCCL by construction.

The semantic tests run training/loop/collectives.py and the clipping hook on two real gloo processes with a
20 s collective timeout, so a rank-0-only stop decision or a per-stage clipping norm fails in seconds
instead of hanging a pipeline run until its process-group timeout.

NCCL cannot be exercised here (no GPU, and NCCL only carries CUDA tensors, so a CPU-only box has no
second device to put a tensor on: any runtime check of "the tensor is on the rank's device" passes on
CPU whether or not the code honours the device). What can fail on CPU is a static scan of ``training/``:
every ``torch.distributed`` / ``deepspeed.comm`` communication call lives in training/loop/collectives.py
(or in the short allow-list below, with the reason it is safe on NCCL), and every *tensor* collective
there sends a tensor built on the device it was given. The scanner is itself shown to catch the
original NCCL bug (a CPU stop flag all-reduced in the engine).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks

PACK_DIR = Path(__file__).resolve().parent.parent
THIS = "pipetrainer.tests.test_collectives"
STOP_CASES = [(False, False), (False, True), (True, False), (True, True)]  # (rank 0 local, rank 1 local)


# ---- run on every rank (imported in the rank processes) -----------------------------------------
def stop_decisions(rank: int, world: int) -> list[bool]:
    from pipetrainer.training.loop.collectives import any_rank_requests_stop

    return [any_rank_requests_stop(case[rank], None, torch.device("cpu")) for case in STOP_CASES]


def _grads(rank: int) -> list[torch.Tensor]:
    """Stage 0 holds two LoRA-like gradients, stage 1 one; sizes differ, as pipeline stages do."""
    g = torch.Generator().manual_seed(100 + rank)
    shapes = [(4, 3), (5,)] if rank == 0 else [(2, 6)]
    return [torch.randn(s, generator=g, dtype=torch.float64).float() * (1 + 2 * rank) for s in shapes]


def clip_step(rank: int, world: int) -> dict:
    """One SGD step (lr 1) through the clipping hook the engine registers, over the stage group."""
    import torch.distributed as dist
    from pipetrainer.training.optim.clipping import GlobalNormClipping

    grads = _grads(rank)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer = torch.optim.SGD(params, lr=1.0)
    hook = GlobalNormClipping(0.5, dist.group.WORLD)
    optimizer.register_step_pre_hook(hook)
    optimizer.step()
    return {"norm": hook.last_norm, "update": [(-p.detach()).flatten().tolist() for p in params]}


def gathered_objects(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from pipetrainer.training.loop.collectives import all_gather_objects, gather_objects_to_rank0

    return {"to_rank0": gather_objects_to_rank0({"rank": rank}),
            "all": all_gather_objects(10 * rank, dist.group.WORLD)}


def every_case(rank: int, world: int) -> dict:
    """All cases in one pair of processes: rank start-up (importing torch) dominates the time."""
    return {"stop": stop_decisions(rank, world), "clip": clip_step(rank, world),
            "objects": gathered_objects(rank, world)}


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> list[dict]:
    return run_on_gloo_ranks(f"{THIS}:every_case", tmp_path_factory.mktemp("gloo"))


# ---- the tests -------------------------------------------------------------------------------------
def test_the_stop_decision_is_any_rank_on_every_rank(on_two_ranks):
    """A STOP seen by rank 1 alone must stop rank 0 too, at the same step, or the pipeline deadlocks."""
    decisions = [r["stop"] for r in on_two_ranks]
    assert decisions == [[False, True, True, True]] * 2, decisions


def test_clipping_uses_the_norm_of_every_stage_together(on_two_ranks):
    """Oracle: the L2 norm of all stages' gradients concatenated, computed here in float64."""
    results = [r["clip"] for r in on_two_ranks]
    grads = [_grads(0), _grads(1)]
    flat = torch.cat([g.double().flatten() for stage in grads for g in stage])
    total = float(flat.norm())
    own = [float(torch.cat([g.double().flatten() for g in stage]).norm()) for stage in grads]
    assert all(abs(o - total) > 0.1 for o in own)  # a stage's own norm would give another answer
    coef = 0.5 / (total + 1e-6)
    assert coef < 1  # clipping binds
    for rank, result in enumerate(results):
        assert math.isclose(result["norm"], total, rel_tol=1e-6), (rank, result["norm"], total, own)
        for update, grad in zip(result["update"], grads[rank], strict=True):
            assert torch.allclose(torch.tensor(update, dtype=torch.float64), grad.double().flatten() * coef,
                                  rtol=1e-5, atol=1e-7), rank
    clipped = torch.cat([torch.tensor(u, dtype=torch.float64) for r in results for u in r["update"]])
    assert math.isclose(float(clipped.norm()), 0.5, rel_tol=1e-5)


def test_object_gathers_return_every_rank_in_rank_order(on_two_ranks):
    results = [r["objects"] for r in on_two_ranks]
    assert results[0] == {"to_rank0": [{"rank": 0}, {"rank": 1}], "all": [0, 10]}
    assert results[1] == {"to_rank0": None, "all": [0, 10]}


# ---- NCCL: the static scan -------------------------------------------------------------------------
COMMUNICATION = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "all_gather_object", "gather_object",
    "broadcast_object_list", "scatter_object_list", "send_object_list", "recv_object_list",
}
OBJECT_OR_NO_TENSOR = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                       "send_object_list", "recv_object_list", "barrier", "monitored_barrier"}
DISTRIBUTED_MODULES = {"torch.distributed", "deepspeed.comm"}
HOME = "training/loop/collectives.py"
# (file, function) outside collectives.py that may communicate, and why that is right on NCCL.
ALLOWED = {
    ("training/process/rank.py", "barrier"): "no tensor of ours; NCCL's barrier uses the CUDA device rank.py sets first",
}


def _distributed_calls(source: str) -> list[tuple[str, int, ast.Call, list[ast.AST]]]:
    """``(function name, line, call, enclosing defs)`` of every torch.distributed / deepspeed.comm call."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> dotted module
    functions: dict[str, str] = {}  # local name -> function of a distributed module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in DISTRIBUTED_MODULES:
                    modules[a.asname or a.name] = full
                elif node.module in DISTRIBUTED_MODULES:
                    functions[a.asname or a.name] = a.name

    def dotted(expr: ast.AST) -> str | None:
        if isinstance(expr, ast.Name):
            return modules.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return f"{base}.{expr.attr}" if base else None
        return None

    found = []

    def visit(node: ast.AST, scopes: list[ast.AST]) -> None:
        if isinstance(node, ast.Call):
            name = None
            if isinstance(node.func, ast.Attribute) and dotted(node.func.value) in DISTRIBUTED_MODULES:
                name = node.func.attr
            elif isinstance(node.func, ast.Name) and node.func.id in functions:
                name = functions[node.func.id]
            if name in COMMUNICATION:
                found.append((name, node.lineno, node, scopes))
        inner = [*scopes, node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else scopes
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, [])
    return found


def _is_cpu(expr: ast.AST) -> bool:
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, str) and expr.value.startswith("cpu")
    if isinstance(expr, ast.Call) and expr.args:  # torch.device("cpu")
        return _is_cpu(expr.args[0])
    return False


def _built_on_given_device(name: str, scope: ast.AST | None) -> bool:
    """``name`` is assigned in ``scope`` from a call with a non-CPU ``device=`` or from ``.to(<device>)``."""
    if scope is None:
        return False
    for node in ast.walk(scope):
        if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            continue
        value = node.value
        if not isinstance(value, ast.Call):
            return False
        devices = [k.value for k in value.keywords if k.arg == "device"]
        if isinstance(value.func, ast.Attribute) and value.func.attr == "to" and value.args:
            devices.append(value.args[0])
        return bool(devices) and not any(_is_cpu(d) for d in devices)
    return False


def nccl_problems(path: str, source: str) -> list[str]:
    """What in ``source`` (at ``path`` relative to the pack) could send a tensor NCCL cannot carry."""
    problems = []
    for name, line, call, scopes in _distributed_calls(source):
        where = f"{path}:{line} {name}"
        if path != HOME:
            if (path, name) not in ALLOWED:
                problems.append(f"{where}: communicate through {HOME} (device-aware), not directly")
            continue
        if name in OBJECT_OR_NO_TENSOR:
            continue
        tensor = call.args[1] if name == "all_gather" and len(call.args) > 1 else (call.args[0] if call.args else None)
        if not (isinstance(tensor, ast.Name) and _built_on_given_device(tensor.id, scopes[-1] if scopes else None)):
            problems.append(f"{where}: the tensor must be built on the rank's device (device=... / .to(device))")
    return problems


def test_no_collective_in_training_sends_a_tensor_nccl_cannot_carry():
    problems = []
    for file in sorted((PACK_DIR / "training").rglob("*.py")):
        rel = file.relative_to(PACK_DIR).as_posix()
        problems += nccl_problems(rel, file.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    # Object collectives serialise through torch.cuda.current_device() on NCCL: the rank must set it.
    rank_calls = {ast.unparse(n.func) for n in ast.walk(ast.parse((PACK_DIR / "training" / "process" / "rank.py").read_text()))
                  if isinstance(n, ast.Call)}
    assert "torch.cuda.set_device" in rank_calls


def test_the_scan_catches_a_cpu_flag_on_an_nccl_group():
    """The scanner can fail: the engine's original stop flag, and the same flag moved into collectives.py."""
    engine_bug = (
        "import torch\nimport torch.distributed as dist\n"
        "def stop(local):\n    flag = torch.tensor([1.0 if local else 0.0])\n"
        "    dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n    return bool(flag.item())\n"
    )
    assert nccl_problems("training/loop/engine.py", engine_bug)
    assert nccl_problems(HOME, engine_bug)
    assert nccl_problems(HOME, engine_bug.replace("0.0])", "0.0], device='cpu')"))
    assert nccl_problems("training/x.py", "from torch.distributed import all_reduce as ar\nar(t)\n")
    assert nccl_problems("training/x.py", "import deepspeed.comm as c\nc.broadcast(t, 0)\n")
    assert not nccl_problems(HOME, engine_bug.replace("0.0])", "0.0], device=device)"))


def test_squared_norms_stay_on_the_gradients_device_when_a_parameter_has_none():
    """On a GPU every LoRA gradient is a device tensor; a parameter without a gradient must count as a zero
    made on that device, or stacking them fails. The meta device stands in for the GPU here."""
    from pipetrainer.training.optim.clipping import squared_norms

    with_grad, without = (torch.nn.Parameter(torch.ones(3, device="meta")) for _ in range(2))
    with_grad.grad = torch.ones(3, device="meta")
    norms = squared_norms([with_grad, without])
    assert norms.shape == (2,) and norms.device.type == "meta"
