"""The multi-machine recipe of a run: its spec and the exact launcher commands, written into the run dir.

On one machine the supervisor starts the ranks itself. Across machines the *same* rank entry
(``entry.py rank <spec>``) runs under DeepSpeed's multi-node launcher (hostfile, pdsh/ssh) or under
``torchrun`` started once per machine; the ranks then take RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT from the launcher (``env://``). Ranks are laid out stage-major, as
DeepSpeed's pipeline topology expects: global rank = stage * data_parallel + replica, so with one
stage per machine each machine holds one stage and its replicas.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from ..spec.run_spec import RunSpec

CLUSTER_DIR = "cluster"
DEFAULT_MASTER_PORT = 29500
LAUNCHER_ARGS = "${DEEPSPEED_ARGS:-}"  # extra launcher options, word-split by the shell (e.g. --no_ssh_check)


def cluster_spec(spec: RunSpec) -> RunSpec:
    """The spec as launcher-started ranks use it: no ComfyUI parent to watch."""
    return dataclasses.replace(spec, parent_pid=0)


def ranks_per_node(spec: RunSpec, nodes: int) -> int:
    if nodes < 1 or spec.world_size % nodes:
        raise ValueError(f"{spec.world_size} ranks (pipeline_stages x data_parallel) cannot be spread evenly "
                         f"over {nodes} machines: choose a number of machines that divides {spec.world_size}.")
    return spec.world_size // nodes


def torchrun_command(entry: str | Path, spec_path: str | Path, *, nodes: int, node_rank: int | str,
                     nproc_per_node: int, master_addr: str, master_port: int | str,
                     python: str = "python") -> list[str]:
    """The command to run on machine ``node_rank`` (0 is the one at ``master_addr``)."""
    return [python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc_per_node), "--master-addr", master_addr, "--master-port", str(master_port),
            str(entry), "rank", str(spec_path)]


def deepspeed_command(entry: str | Path, spec_path: str | Path, *, hostfile: str | Path, master_addr: str,
                      master_port: int | str) -> list[str]:
    """DeepSpeed's multi-node launcher, run once on the first machine of ``hostfile``."""
    return ["deepspeed", LAUNCHER_ARGS, "--hostfile", str(hostfile), "--master_addr", master_addr, "--master_port",
            str(master_port), "--no_local_rank", str(entry), "rank", str(spec_path)]


def hostfile_text(nodes: int, slots: int) -> str:
    return "".join(f"node{i} slots={slots}\n" for i in range(nodes))


def write_cluster_bundle(spec: RunSpec, entry: str | Path, nodes: int | None = None) -> Path:
    """Write ``<run_dir>/cluster/{spec.json,hostfile,launch_deepspeed.sh,launch_torchrun.sh}``.

    ``nodes`` defaults to one machine per pipeline stage. Returns the folder.
    """
    nodes = nodes or spec.train.pipeline_stages
    slots = ranks_per_node(spec, nodes)
    folder = Path(spec.run_dir) / CLUSTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(cluster_spec(spec).to_json(), encoding="utf-8")
    hostfile = folder / "hostfile"
    hostfile.write_text(hostfile_text(nodes, slots), encoding="utf-8")
    header = (
        "#!/usr/bin/env bash\n"
        f"# PipeTrainer run {Path(spec.run_dir).name}: {spec.train.pipeline_stages} pipeline stage(s) x "
        f"{spec.train.data_parallel} data-parallel replica(s) = {spec.world_size} ranks on {nodes} machine(s).\n"
        "# Every machine needs this pack, the model, the cache files and the run dir at the same paths\n"
        "# (a shared filesystem is simplest); see docs/cluster.md.\n"
        + launch_comment(spec) +
        "set -euo pipefail\n"
        f"ENTRY=${{PIPETRAINER_ENTRY:-{shlex.quote(str(entry))}}}\n"
        f"SPEC=${{PIPETRAINER_SPEC:-{shlex.quote(str(spec_path))}}}\n"
        f"MASTER_ADDR=${{MASTER_ADDR:?set MASTER_ADDR to the address of the first machine}}\n"
        f"MASTER_PORT=${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}\n"
    )
    ds = deepspeed_command("$ENTRY", "$SPEC", hostfile=f"${{HOSTFILE:-{hostfile}}}",
                           master_addr="$MASTER_ADDR", master_port="$MASTER_PORT")
    tr = torchrun_command("$ENTRY", "$SPEC", nodes=nodes, node_rank=f"${{NODE_RANK:?set NODE_RANK (0..{nodes - 1})}}",
                          nproc_per_node=slots, master_addr="$MASTER_ADDR", master_port="$MASTER_PORT",
                          python="${PYTHON:-python}")
    _write_script(folder / "launch_deepspeed.sh",
                  header + "# Run once, on the first machine listed in the hostfile (needs pdsh or ssh to the others).\n"
                  "# DEEPSPEED_ARGS adds launcher options, e.g. --no_ssh_check for a single-machine hostfile.\n"
                  + _shell(ds))
    _write_script(folder / "launch_torchrun.sh",
                  header + "# Run on every machine with NODE_RANK=0..N-1 (0 on the MASTER_ADDR machine).\n"
                  + _shell(tr))
    return folder


def launch_comment(spec: RunSpec) -> str:
    """Script comment lines: the ComfyUI launch settings the ranks apply (from the spec) and the GPUs.

    The settings travel in the bundle's spec.json, so every rank of every machine computes as the
    ComfyUI process that queued the run did; the comment shows them to whoever edits the bundle.
    """
    flags = " ".join(shlex.quote(f) for f in spec.launch.as_flags()) or "(none)"
    text = f"# ComfyUI launch settings, applied by every rank from spec.json: {flags}\n"
    if spec.device == "cuda":
        used = (f"; on its own machine this run used CUDA devices {spec.launch.cuda_visible_devices}"
                if spec.launch.cuda_visible_devices else "")
        text += ("# GPUs: each rank uses its LOCAL_RANK's GPU among CUDA_VISIBLE_DEVICES (DeepSpeed's launcher: "
                 f"--include){used}.\n")
    return text


def _shell(argv: list[str]) -> str:
    """Quote words, but leave ``$VAR`` / ``${...}`` words to the shell (double quotes)."""
    return "exec " + " ".join(a if a == LAUNCHER_ARGS else f'"{a}"' if "$" in a else shlex.quote(a)
                              for a in argv) + "\n"


def _write_script(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
