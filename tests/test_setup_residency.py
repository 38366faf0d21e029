"""Block swap during set-up, through the real DeepSpeed stage engine: swapped blocks never reach the device.

The meta device stands in for the GPU (what lands there is what would use VRAM), and a torch dispatch
mode watches every op of the set-up: any op that reads a swapped block's frozen tensor and produces a
tensor on the device is a (partial) load of that block. The set-up is the engine's own sequence
(training/loop/engine.py: place_stage, freeze, move_trainable, BlockSwapper.attach, then
patches/deepspeed_stage_engine.build_stage_engine), on one real gloo rank with real DeepSpeed; the
blocks are plain torch modules marked swappable, as a family adapter marks its blocks.
"""

from __future__ import annotations

import os

import torch
from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE = "meta"
THIS = "pipetrainer.tests.test_setup_residency"


class _Block(nn.Module):
    swappable = True  # what StageLayer.swappable says for a family's transformer blocks

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.ones(16))
        self.lora = nn.Linear(16, 16, bias=False)  # the trainable part

    def forward(self, x):
        return self.norm(self.base(x) * self.scale) + self.lora(x)


class _Embed(nn.Module):
    swappable = False

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.lora = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.proj(x) + self.lora(x)


class _DeviceWrites(TorchDispatchMode):
    """Records which watched storages (frozen tensors of swapped blocks) an op read while producing a
    tensor on the device."""

    def __init__(self, watched: dict[int, int]):
        super().__init__()
        self.watched = watched  # storage data_ptr -> swapped block position
        self.loaded: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == DEVICE for t in outs):
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    block = self.watched.get(t.untyped_storage().data_ptr())
                    if block is not None:
                        self.loaded.append((str(func), block))
        return out


_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory}


class _MoveCalls(TorchFunctionMode):
    """Records every ``.to`` / ``.cuda`` / ``.cpu`` / ``.pin_memory`` on a watched tensor, whatever its
    target: on this CPU machine the engine's device is the host, so a ``module.to(engine.device)`` is a
    no-op in effect but still a call (on a GPU it would load every swapped block at once)."""

    def __init__(self, watched: dict[int, int]):
        super().__init__()
        self.watched = watched
        self.calls: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MOVES and args and isinstance(args[0], torch.Tensor):
            block = self.watched.get(args[0].untyped_storage().data_ptr())
            if block is not None:
                self.calls.append((func.__name__, block))
        return func(*args, **(kwargs or {}))


def _frozen_storages(blocks) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): position for position, block in enumerate(blocks)
            for t in (*[p for n, p in block.named_parameters() if not n.startswith("lora.")], *block.buffers())}


def engine_setup(rank: int, world: int) -> dict:
    """One rank's set-up of a 1-stage pipeline with 2 of its 3 blocks swapped (runs on a gloo rank)."""
    os.environ.setdefault("LOCAL_RANK", "0")
    from pipetrainer.patches.deepspeed_shm import disable_shm_comm_build

    disable_shm_comm_build()
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from pipetrainer.patches.deepspeed_stage_engine import build_stage_engine
    from pipetrainer.training.offload.block_swap import BlockSwapper
    from pipetrainer.training.offload.placement import last_swappable, move_trainable, place_stage

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    torch.manual_seed(0)
    module = PipelineModule(layers=[_Embed(), _Block(), _Block(), _Block()], num_stages=1,
                            loss_fn=nn.functional.mse_loss, partition_method="uniform")
    layers = [layer for name, layer in module.named_children() if name.isdigit()]
    swapped = last_swappable(layers, 2)
    watched = _frozen_storages(swapped)
    resident_seen = []
    with _DeviceWrites(watched) as writes, _MoveCalls(watched) as moves:
        place_stage(layers, swapped, DEVICE)
        for layer in layers:  # freeze all but the "LoRA" (by name: moving to the device made new Parameters)
            for n, p in layer.named_parameters():
                p.requires_grad_(n.startswith("lora."))
        moved = move_trainable(swapped, DEVICE)
        params = [p for p in module.parameters() if p.requires_grad]
        swapper = BlockSwapper(swapped, DEVICE, transfer=lambda t, d: torch.empty_like(t, device=d)).attach()
        watched.update(_frozen_storages(swapped))  # the host copies now live in the swapper's flat buffers
        resident_seen.append(len(swapper.resident()))
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        engine = build_stage_engine(module, optimizer, None, params, {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
            "steps_per_print": 10**9, "gradient_clipping": 0.0})
        resident_seen.append(len(swapper.resident()))

    def where(layer, trainable: bool) -> list[str]:
        return sorted({p.device.type for p in layer.parameters() if p.requires_grad == trainable}
                      | ({b.device.type for b in layer.buffers()} if not trainable else set()))

    return {
        "swapped": [layers.index(b) for b in swapped], "moved_lora": moved, "device_loads": writes.loaded, "move_calls": moves.calls,
        "resident_seen": resident_seen, "peak_resident": swapper.peak_resident, "loads": swapper.loads,
        "frozen": [where(layer, False) for layer in layers], "trainable": [where(layer, True) for layer in layers],
        "engine_module_is_ours": engine.module is module,
    }


def test_swapped_blocks_never_reach_the_device_while_the_real_engine_is_set_up(tmp_path):
    (result,) = run_on_gloo_ranks(f"{THIS}:engine_setup", tmp_path, world=1)
    assert result["swapped"] == [2, 3] and result["moved_lora"] == 2
    assert result["device_loads"] == []  # no op ever copied a swapped frozen tensor to the device
    assert result["move_calls"] == []  # nor asked to move one anywhere (the engine leaves the stage in place)
    assert result["resident_seen"] == [0, 0] and result["peak_resident"] == 0 and result["loads"] == 0
    # The rest of the stage is on the device, the swapped blocks' frozen tensors on the host, every LoRA on the device.
    assert result["frozen"] == [["meta"], ["meta"], ["cpu"], ["cpu"]]
    assert result["trainable"] == [["meta"]] * 4
    assert result["engine_module_is_ours"]
