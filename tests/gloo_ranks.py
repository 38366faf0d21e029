"""Run a function on N real gloo ranks (separate processes, a file rendezvous) and collect its results.

Collective bugs should fail a test in seconds, not hang it: the process group gets a short timeout,
so a rank left alone in a collective raises, and the parent bounds the whole run as well.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

ENTRY = Path(__file__).resolve().parent.parent / "training" / "process" / "entry.py"
RESULT_PREFIX = "RESULT "

# The child imports the pack by path (its folder name is not a module name), then calls rank_main.
_CHILD = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('_pipetrainer_entry', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.import_pack(); "
    "from pipetrainer.tests.gloo_ranks import rank_main; import os; rc = rank_main(sys.argv[2:]); "
    "sys.stdout.flush(); os._exit(rc)"
)
# os._exit: the result is printed and the group destroyed; gloo's C++ threads have been seen to abort the
# interpreter's teardown ("terminate called without an active exception", exit -6) after a correct result.


def run_on_gloo_ranks(target: str, tmp: Path, world: int = 2, collective_timeout_s: float = 20.0,
                      run_timeout_s: float | None = None) -> list[Any]:
    """Call ``target`` (``"module:function"``, taking ``(rank, world)``) on ``world`` gloo ranks.

    Returns each rank's JSON result in rank order. Raises AssertionError with the ranks' output if a
    rank fails or the ranks do not finish within ``run_timeout_s`` (default: the collective timeout, which
    bounds each collective, plus start-up time).
    """
    run_timeout_s = collective_timeout_s + 60 if run_timeout_s is None else run_timeout_s
    rendezvous = tmp / f"rendezvous-{target.rsplit(':', 1)[-1]}"
    rendezvous.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(ENTRY), target, str(rank), str(world),
                               f"file://{rendezvous}", str(collective_timeout_s)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=run_timeout_s)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outputs.append(p.communicate()[0] + "\n<killed: no result in time>")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        rendezvous.unlink(missing_ok=True)
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{out[-3000:]}"
                       for r, (p, out) in enumerate(zip(procs, outputs, strict=True)))
    assert all(p.returncode == 0 for p in procs), report
    results = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
        assert len(lines) == 1, report
        results.append(json.loads(lines[0][len(RESULT_PREFIX):]))
    return results


def rank_main(argv: list[str]) -> int:
    """Child side: join the gloo group, run the target, print its result as one JSON line."""
    import torch
    import torch.distributed as dist

    target, rank, world, init_method, timeout_s = argv[0], int(argv[1]), int(argv[2]), argv[3], float(argv[4])
    torch.set_num_threads(1)
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = function(rank, world)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0
