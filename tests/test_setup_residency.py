"""Block swap during set-up, through the real DeepSpeed stage engine: swapped blocks never reach the device.

The meta device stands in for the GPU (what lands there is what would use VRAM), and a torch dispatch
mode watches every op of the set-up: any op that reads a swapped block's frozen tensor and produces a
tensor on the device is a (partial) load of that block. The set-up is the engine's own sequence
(training/loop/engine.py: patches/deepspeed_stage_module.build_stage_module, place_stage, freeze,
move_trainable, BlockSwapper.attach, then patches/deepspeed_stage_engine.build_stage_engine), on one
real gloo rank with real DeepSpeed; the blocks are plain torch modules marked swappable, as a family
adapter marks its blocks.

Below, every family row goes through the trainer's own ``Trainer.setup`` with DeepSpeed's accelerator
device on the stand-in device too (tests/standin_device.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from pipetrainer.tests.family_rows import all_rows
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
    from pipetrainer.patches.deepspeed_stage_engine import build_stage_engine
    from pipetrainer.patches.deepspeed_stage_module import build_stage_module
    from pipetrainer.training.offload.block_swap import BlockSwapper
    from pipetrainer.training.offload.placement import last_swappable, move_trainable, place_stage

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    torch.manual_seed(0)
    module = build_stage_module([_Embed(), _Block(), _Block(), _Block()], num_stages=1,
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


# ---- every family through the trainer's own set-up, on a stand-in device ---------------------------
#
# The rank's device and DeepSpeed's accelerator device are the meta device (tests/standin_device.py), so
# a move DeepSpeed makes on its own (PipelineModule.__init__ ends with ``self.to(<accelerator device>)``)
# is as visible as one the trainer makes. Each family row (tests/family_rows/) goes through
# ``Trainer.setup`` on a 1-rank gloo group in this process, with block swap on: what lands on the device
# must be the stage minus the frozen weights of its last N blocks, plus LoRA and optimizer state (none yet:
# AdamW makes its state at the first step) and nothing dropped on the way; when loading has run, every
# tensor of the stage layers must be the one loading filled, still on the host; after set-up the swapped
# blocks' frozen weights must be on the host, holding the file's values.

ROWS = all_rows()
BY_NAME = {row.name: row for row in ROWS}
SCRATCH_BYTES = 64  # DeepSpeed's engine keeps a few scalars on its device (loss, a parameter count)


def _unique_bytes(tensors) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _stage_tensors(layers) -> list[tuple[str, object, torch.Tensor]]:
    """``(where, layer, tensor)`` of every parameter and buffer the layers hold, wherever it is attached."""
    out = []
    for index, layer in layers:
        for module_name, owner in layer.named_modules():
            for name, t in (*owner._parameters.items(), *owner._buffers.items()):
                if t is not None:
                    path = ".".join(p for p in (module_name, name) if p)
                    out.append((f"layer {index} ({type(layer).__name__}) {path}", layer, t))
    return out


def _load_deferred(row, comfy_root, fixture_paths):
    """``(patcher, deferred weights, the file's tensors)``: a file row through ComfyUI's own loader with its
    weights kept aside (training/model/stage_weights.py), an in-memory row with its weights taken out and
    its tensors overwritten with NaN, so only loading can give them their values."""
    from pipetrainer.training.model.fingerprint import file_fingerprint
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.model.stage_weights import DeferredWeights
    from pipetrainer.training.spec.options import ModelRecipe

    deferred = DeferredWeights()
    if row.model_path is not None:
        path = row.model_path(comfy_root, fixture_paths)
        patcher = load_model(ModelRecipe("diffusion_model", str(path), "default", file_fingerprint(path)), "fp32",
                             deferred)
        return patcher, deferred, dict(deferred.tensors)
    patcher = row.load(comfy_root, fixture_paths)
    state = patcher.model.diffusion_model.state_dict()
    deferred.tensors = {k: v.detach().clone() for k, v in state.items()}
    with torch.no_grad():
        for t in state.values():
            if t.is_floating_point():
                t.fill_(float("nan"))
    return patcher, deferred, dict(deferred.tensors)


def _set_up(row, comfy_root, fixture_paths, folder) -> dict:
    from pipetrainer.tests.family_rows.common import cache_items
    from pipetrainer.tests.helpers import make_spec
    from pipetrainer.tests.standin_device import DEVICE, DeviceLedger, storage_key
    from pipetrainer.training.loop.engine import RankContext, Trainer
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.process.events import EventWriter
    from pipetrainer.training.spec.options import LoraSpec

    patcher, deferred, file = _load_deferred(row, comfy_root, fixture_paths)
    dm = patcher.model.diffusion_model
    adapter = adapter_for(row.family)
    # The oracle, from ComfyUI's model before set-up: the stage's bytes and its last N blocks' bytes.
    layers = adapter.stage_layers(dm)
    swappable = [layer for layer in layers if layer.swappable]
    n = max(1, len(swappable) // 2)
    stage_bytes = _unique_bytes(t for _, _, t in _stage_tensors(enumerate(layers)))
    swapped_bytes = _unique_bytes(t for _, _, t in _stage_tensors(enumerate(swappable[-n:])))
    del layers, swappable

    model_path = row.model_path(comfy_root, fixture_paths) if row.model_path else fixture_paths.mmdit  # not read
    spec = make_spec(model_path, cache_items(row, patcher.model, folder / "cache"), folder / "run", comfy_root,
                     steps=1, blocks_to_swap=n, partition_method="uniform",
                     lora=LoraSpec(rank=4, alpha=4.0, targets="attention_mlp"))
    trainer = Trainer(spec, RankContext(0, 1, 0, DEVICE, EventWriter(spec.run_dir, source="rank0")))
    at_load: list[str] = []
    loads = []

    def loaded(module, incompatible) -> None:  # the end of finish_loading's load_state_dict
        loads.append(module)
        names = {id(t): n for n, t in (*dm.named_parameters(remove_duplicate=False),
                                       *dm.named_buffers(remove_duplicate=False))}
        local = [(int(i), layer) for i, layer in trainer.module.named_children() if i.isdigit()]
        for where, _, t in _stage_tensors(local):
            if id(t) not in names:
                at_load.append(f"{where}: not a tensor of ComfyUI's model, which loading fills")
            elif t.device.type != "cpu":
                at_load.append(f"{where}: on {t.device.type} while loading fills it")
            elif names[id(t)] in file and not torch.equal(t, file[names[id(t)]].to(t.dtype)):
                at_load.append(f"{where}: not the file's {names[id(t)]} after loading")

    handle = dm.register_load_state_dict_post_hook(loaded)
    try:
        with DeviceLedger() as ledger:
            trainer.setup(patcher, deferred)
    finally:
        handle.remove()

    local = [(int(i), layer) for i, layer in trainer.module.named_children() if i.isdigit()]
    lora = [p for p in trainer.module.parameters() if p.requires_grad]
    state = [t for s in trainer.optim.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = {storage_key(t) for t in (*trainer.module.parameters(), *trainer.module.buffers(), *state)
            if t.device == DEVICE}
    swapped = {id(layer) for layer in [layer for _, layer in local if layer.swappable][-n:]}
    host_problems = []
    for where, layer, t in _stage_tensors(local):
        if id(layer) in swapped and not t.requires_grad:
            if t.device.type != "cpu":
                host_problems.append(f"{where}: a swapped block's frozen tensor on {t.device.type}")
        elif t.device != DEVICE:
            host_problems.append(f"{where}: on {t.device.type}, not on the device")
    for index, layer in local:  # the swapped blocks' host copies hold what loading gave them
        if id(layer) not in swapped:
            continue
        for module_name, owner in layer.named_modules():
            path = layer.comfy_path(module_name)
            for name, t in (*owner._parameters.items(), *owner._buffers.items()):
                key = f"{path}.{name}"
                if t is not None and not t.requires_grad and key in file and not torch.equal(t, file[key].to(t.dtype)):
                    host_problems.append(f"layer {index} {key}: the swapped block's host copy is not the file's")
    return {
        "n": n, "stage_bytes": stage_bytes, "swapped_bytes": swapped_bytes,
        "lora_bytes": _unique_bytes(lora), "optimizer_bytes": _unique_bytes(state),
        "landed_bytes": ledger.nbytes,
        "landed_not_kept": sorted(((e.nbytes, e.op) for k, e in ledger.landed.items() if k not in held), reverse=True),
        "swapped_blocks": len(trainer.block_swapper.block_names()) if trainer.block_swapper else 0,
        "read_back": sorted(set(ledger.read_back)),
        "loads": len(loads), "at_load": at_load, "placement": host_problems,
    }


@pytest.fixture(scope="module")
def standin_setups(comfy_root, fixture_paths, tmp_path_factory):
    """Each row's set-up on the stand-in device, run once (in this process) and shared by the checks."""
    from pipetrainer.tests.standin_device import standin_rank

    folder = tmp_path_factory.mktemp("standin")
    done: dict[str, dict] = {}
    with standin_rank(folder):
        def set_up(name: str) -> dict:
            if name not in done:
                done[name] = _set_up(BY_NAME[name], comfy_root, fixture_paths, folder / name)
            return done[name]

        yield set_up


@pytest.mark.parametrize("name", [row.name for row in ROWS])
def test_set_up_puts_on_the_device_the_stage_minus_its_swapped_blocks_frozen_weights(name, standin_setups):
    r = standin_setups(name)
    assert r["swapped_blocks"] == r["n"] and 0 < r["swapped_bytes"] < r["stage_bytes"]
    scratch = [(size, op) for size, op in r["landed_not_kept"] if size <= SCRATCH_BYTES]
    big = [(size, op) for size, op in r["landed_not_kept"] if size > SCRATCH_BYTES]
    assert big == [], f"{sum(s for s, _ in big)} bytes reached the device and were dropped again: {big[:5]}"
    assert len(scratch) <= 8, scratch
    expected = r["stage_bytes"] - r["swapped_bytes"] + r["lora_bytes"] + r["optimizer_bytes"]
    assert r["landed_bytes"] - sum(s for s, _ in scratch) == expected, r
    assert r["placement"] == []
    assert set(r["read_back"]) <= {"aten._to_copy.default", "aten._local_scalar_dense.default"}, r["read_back"]


@pytest.mark.parametrize("name", [row.name for row in ROWS])
def test_every_stage_tensor_is_the_one_loading_fills(name, standin_setups):
    r = standin_setups(name)
    assert r["loads"] == 1  # finish_loading filled the model once, and the check ran then
    assert r["at_load"] == []


@pytest.mark.parametrize("name", [row.name for row in ROWS])
def test_a_move_of_the_stage_layers_leaves_them_on_the_models_own_tensors(name, comfy_root, fixture_paths):
    """A tensor a layer adopts from ComfyUI's model outside its adopted modules (SD3's pos_embed buffer,
    LTX-Video's scale_shift_table, Z-Image's pad tokens) stays the model's own through a move of the layer
    (torch gives moved buffers, and on some devices moved parameters, new tensors): a load after the move
    fills what the layer holds."""
    from pipetrainer.training.model.stage_weights import unshared_tensors
    from pipetrainer.training.pipelines.base import adapter_for

    row = BY_NAME[name]
    dm = row.load(comfy_root, fixture_paths).model.diffusion_model
    layers = adapter_for(row.family).stage_layers(dm)
    assert unshared_tensors(enumerate(layers), dm) == []
    for layer in layers:
        layer.to("meta")
    assert unshared_tensors(enumerate(layers), dm) == []
    assert all(t.is_meta for layer in layers for t in (*layer.parameters(), *layer.buffers()))
