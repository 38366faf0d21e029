"""One training rank: process hygiene, distributed init, model replay, then the engine.

Started by the supervisor with RANK / WORLD_SIZE / LOCAL_RANK and a file rendezvous in the run dir,
or by a launcher (torchrun, DeepSpeed's multi-node launcher) with MASTER_ADDR / MASTER_PORT (env://).
Each rank dies with its supervisor (PR_SET_PDEATHSIG) so a killed tree leaves no orphan on the GPU.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from datetime import timedelta

from ..spec.run_spec import RunSpec
from .events import EventWriter

EXIT_OK, EXIT_FAILED, EXIT_STOPPED = 0, 1, 3


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the supervisor) dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def cpu_rank_environment() -> dict[str, str]:
    """Environment a CPU rank needs before torch/DeepSpeed load (also for ranks a launcher started)."""
    return {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mb() -> float:
    """Resident memory of this process now (Linux: resident pages from /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_rank(spec_path: str) -> int:
    """One rank. RANK / WORLD_SIZE / LOCAL_RANK come from the supervisor or from a launcher
    (torchrun, DeepSpeed's multi-node launcher); PIPETRAINER_INIT_METHOD is the supervisor's file
    rendezvous and defaults to ``env://`` (MASTER_ADDR / MASTER_PORT) for launcher-started ranks."""
    die_with_parent()
    spec = RunSpec.load(spec_path).validated()
    if spec.device == "cpu":
        for key, value in cpu_rank_environment().items():
            os.environ.setdefault(key, value)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    events = EventWriter(spec.run_dir, source=f"rank{rank}")
    try:
        return _train(spec, rank, world, local_rank, events)
    except BaseException as exc:  # report, then let the supervisor tear the group down
        events.emit("error", rank=rank, message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        raise


def _train(spec: RunSpec, rank: int, world: int, local_rank: int, events: EventWriter) -> int:
    import torch

    if spec.device == "cpu":
        torch.set_num_threads(int(os.environ.get("PIPETRAINER_THREADS", "1")))
    # The device first: importing comfy.model_management probes the current GPU. The supervisor gives
    # every rank the run's GPUs as CUDA_VISIBLE_DEVICES, in rank order, so LOCAL_RANK is this rank's
    # GPU (DeepSpeed's engine and PipelineModule also go by LOCAL_RANK).
    if spec.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    from ..model.comfy_env import enable_comfy_training_mode
    from ..model.launch_apply import apply_launch_settings

    apply_launch_settings(spec, rank, device, events)  # ComfyUI's args as the ComfyUI process had them
    from ...patches.deepspeed_shm import disable_shm_comm_build

    disable_shm_comm_build()
    import deepspeed

    from ..loop.collectives import loading_group
    from ..loop.engine import RankContext, Trainer
    from ..model.model_source import load_model
    from ..model.stage_weights import DeferredWeights

    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, verbose=False,
        init_method=os.environ.get("PIPETRAINER_INIT_METHOD", "env://"), rank=rank, world_size=world,
        timeout=timedelta(seconds=float(os.environ.get("PIPETRAINER_PG_TIMEOUT", "300"))),
    )
    enable_comfy_training_mode()  # after set_device: RoPE models need it for backward on current ComfyUI
    load_group = loading_group(float(os.environ.get("PIPETRAINER_LOAD_TIMEOUT", "7200")))
    deferred = DeferredWeights()  # only this rank's stage gets its weights (training/model/stage_weights.py)
    events.emit("rank_memory", rank=rank, before_load_mb=rss_mb(), peak_before_load_mb=peak_rss_mb())
    if rank == 0:  # start-up phases, shown on the Train node until the first step reports
        events.emit("phase", phase="loading_model", text="loading the model")
    patcher = load_model(spec.model, spec.train.dtype, deferred)
    trainer = Trainer(spec, RankContext(rank, world, local_rank, device, events, load_group))
    if rank == 0:
        events.emit("phase", phase="setup", text=f"building the {spec.train.pipeline_stages}-stage pipeline")
    trainer.setup(patcher, deferred)
    outcome = trainer.train()
    events.emit("rank_done", rank=rank, stage=trainer.stage_id, step=trainer.step, peak_rss_mb=peak_rss_mb(),
                seconds_per_step=trainer.seconds_per_step)
    torch.distributed.barrier()
    if rank == 0:
        events.emit(outcome, step=trainer.step)
    torch.distributed.destroy_process_group()
    return EXIT_OK if outcome == "finished" else EXIT_STOPPED
