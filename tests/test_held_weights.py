"""ComfyUI's copy of the base model is released while training runs and comes back, exactly, when needed.

Oracles: the weights the loader node made (kept aside before anything is released) and the meta device
for "holds nothing". The Train-node test watches the graph's MODEL from another thread while the ranks
train, so a copy kept for the whole run fails it.
"""

from __future__ import annotations

import secrets
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from pipetrainer.training.model.fingerprint import file_fingerprint
from pipetrainer.training.model.stage_weights import resident_bytes
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec


def _loaded(name: str):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(name, "default").result[0]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.model.diffusion_model.state_dict().items()}


def test_released_weights_hold_nothing_and_come_back_bit_identical_in_every_clone(fixture_paths):
    from pipetrainer.nodes.run.held_weights import HeldWeights

    model = _loaded(fixture_paths.mmdit.name)
    before = _snapshot(model)
    clone = model.clone()  # what a stock node downstream holds
    held = HeldWeights(model, str(fixture_paths.mmdit), file_fingerprint(fixture_paths.mmdit))
    assert held.notes() == []  # released: nothing to say in the run log
    modules = dict(model.model.diffusion_model.named_modules())

    freed = held.release()
    dm = clone.model.diffusion_model
    assert freed == sum(t.numel() * t.element_size() for t in before.values())
    assert resident_bytes(dm) == 0 and held.released
    assert {k: (v.shape, v.dtype) for k, v in dm.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in before.items()}  # ComfyUI's accounting still reads the sizes

    with held.lent():  # a preview: the weights are there inside the block, released again after it
        assert all(torch.equal(dm.state_dict()[k], v) for k, v in before.items())
    assert resident_bytes(dm) == 0

    held.restore()
    after = dm.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert dict(dm.named_modules()) == modules  # the same module objects: clones see the weights
    assert not held.released


def test_a_model_changed_on_disk_is_not_reloaded_silently(fixture_paths, comfy_root):
    from pipetrainer.nodes.run.held_weights import HeldWeights

    folder = comfy_root / "models" / "diffusion_models"
    name = f"held-{secrets.token_hex(3)}.safetensors"
    shutil.copyfile(fixture_paths.mmdit, folder / name)
    try:
        model = _loaded(name)
        held = HeldWeights(model, str(folder / name), file_fingerprint(folder / name))
        held.release()
        (folder / name).write_bytes((folder / name).read_bytes()[:-4] + b"\0\0\0\0")
        with pytest.raises(RuntimeError, match="changed on disk while training ran.*queue the graph again"):
            held.restore()
        assert "could not load the model again" in held.restore_or_report()
    finally:
        (folder / name).unlink(missing_ok=True)


def test_a_model_without_a_reload_factory_keeps_its_weights_and_says_so(fixture_paths):
    import comfy.model_patcher
    from pipetrainer.nodes.run.held_weights import HeldWeights

    model = _loaded(fixture_paths.mmdit.name)
    plain = comfy.model_patcher.ModelPatcher(model.model, load_device=torch.device("cpu"),
                                             offload_device=torch.device("cpu"))
    plain.attachments.clear()
    plain.cached_patcher_init = None  # current ComfyUI records one for its core loaders
    held = HeldWeights(plain)
    assert held.release() == 0 and resident_bytes(plain.model.diffusion_model) > 0
    [note] = held.notes()
    assert "keeps its copy" in note


@pytest.mark.slow
def test_the_train_node_holds_no_model_weights_while_the_ranks_train(fixture_paths, demo_cache):
    from pipetrainer.nodes import train
    from pipetrainer.nodes.run import paths
    from pipetrainer.training.process.events import read_all

    model = _loaded(fixture_paths.mmdit.name)
    before = _snapshot(model)
    name = f"held-{secrets.token_hex(3)}"
    seen: dict = {}

    def watch() -> None:  # the graph's MODEL, looked at while a rank reports steps
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "resident" not in seen:
            for run_dir in Path(paths.runs_root()).glob(f"{name}-*"):
                if any(e["type"] == "step" for e in read_all(run_dir)):
                    seen["resident"] = resident_bytes(model.model.diffusion_model)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    enabled, train.WARM_POOL.enabled = train.WARM_POOL.enabled, False
    try:
        out = train.PipeTrainerTrain.execute(
            model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(lr=1e-3, weight_decay=0.0), name,
            steps=6, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
            gradient_checkpointing=False, pipeline_stages=1, partition_method="parameters", resume=False)
    finally:
        train.WARM_POOL.enabled = enabled
        watcher.join(10)
        for run in Path(paths.runs_root()).glob(f"{name}-*"):
            shutil.rmtree(run, ignore_errors=True)
        Path(paths.lora_output_path(name)).unlink(missing_ok=True)
    assert seen.get("resident") == 0, seen
    trained = out.result[0]
    after = trained.model.diffusion_model.state_dict()  # the LoRA is a patch: the base is the loader's again
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert trained.patches  # and the trained LoRA is on the returned MODEL
