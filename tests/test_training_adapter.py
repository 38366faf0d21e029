"""Distilled bases: a training adapter is merged while the LoRA trains and left out of what the run produces.

The oracle: training with the adapter on the distilled base must be training on a base file into which
ComfyUI's own LoRA loader merged the same adapter. Same seed, same data: the losses and the saved LoRA
agree. The saved LoRA therefore holds only what was trained (the merged-base run has no adapter to save),
it maps onto the distilled base with every key taken, and a plain run on the distilled base differs (the
adapter took part). The node side: the Training Adapter node leaves the MODEL's weights alone (every sampler
after it, Train LoRA's output included, sees the distilled model), and its checks name the fix.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from pipetrainer.nodes.checks.training_adapter import (
    TrainingAdapter,
    attach_training_adapter,
    training_adapter_of,
    training_adapter_problems,
    with_training_adapter,
)
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.tests.quant_helpers import unmapped_keys
from pipetrainer.training.adapters.init_lora import file_digest
from pipetrainer.training.model.fingerprint import file_fingerprint
from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec
from safetensors.torch import load_file, save_file

STRENGTH = 0.8
MODULES = {"joint_blocks.0.x_block.attn.qkv": (768, 256), "joint_blocks.1.context_block.mlp.fc1": (1024, 256)}
LORA = LoraSpec(rank=4, alpha=4.0, targets="attention_mlp")


def _adapter_file(path: Path, extra_key: str | None = None) -> Path:
    g = torch.Generator().manual_seed(17)
    tensors = {}
    for module, (out, inp) in MODULES.items():
        tensors[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(out, 8, generator=g) * 0.5
        tensors[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(8, inp, generator=g) * 0.5
        tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(8.0)
    if extra_key:
        tensors[extra_key] = torch.zeros(4, 4)
    save_file(tensors, str(path))
    return path


def _load(path: Path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path))


@pytest.fixture(scope="module")
def adapter_path(tmp_path_factory) -> Path:
    return _adapter_file(tmp_path_factory.mktemp("adapter") / "dedistill.safetensors")


@pytest.fixture(scope="module")
def merged_base(fixture_paths, adapter_path, tmp_path_factory) -> Path:
    """The distilled base with the adapter merged by ComfyUI's stock loader (patch_model), as a file."""
    import comfy.sd

    base = load_file(str(fixture_paths.mmdit))
    patcher, _ = comfy.sd.load_lora_for_models(_load(fixture_paths.mmdit), None, load_file(str(adapter_path)),
                                               STRENGTH, 0)
    patcher.patch_model()
    state = patcher.model.diffusion_model.state_dict()
    merged = {key: state[key].detach().to(value.dtype).clone() if key.rsplit(".", 1)[0] in MODULES else value
              for key, value in base.items()}
    patcher.unpatch_model()
    for module in MODULES:
        assert (merged[f"{module}.weight"] - base[f"{module}.weight"]).abs().max() > 1e-2
    path = tmp_path_factory.mktemp("merged") / "merged-base.safetensors"
    save_file(merged, str(path))
    return path


@pytest.fixture(scope="module")
def runs(fixture_paths, demo_cache, comfy_root, adapter_path, tmp_path_factory):
    """3-step runs of one seed and data (distilled base + adapter, merged base, distilled base), by name."""

    def run(name: str, path: Path, with_adapter: bool):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spec = make_spec(path, demo_cache.items[:2], run_dir, comfy_root, steps=3, lora=LORA,
                         optimizer=OptimizerSpec(lr=1e-2, weight_decay=0.0))
        if with_adapter:
            model = attach_training_adapter(_load(path), TrainingAdapter(str(adapter_path), STRENGTH,
                                                                         file_digest(adapter_path)))
            spec = dataclasses.replace(spec, model=with_training_adapter(model, spec.model, run_dir)).validated()
        code, events = run_training(spec)
        assert code == 0, [e for e in events if e["type"] == "error"]
        return spec, losses(events), load_file(spec.lora_output)

    return run


def test_training_with_the_adapter_is_training_on_the_merged_base(runs, merged_base, fixture_paths):
    spec, with_adapter, saved = runs("adapter", fixture_paths.mmdit, True)
    _, on_merged, saved_merged = runs("merged", merged_base, False)
    _, plain, _ = runs("plain", fixture_paths.mmdit, False)
    assert Path(spec.model.loras[0][0]).name.startswith("training_adapter_")
    assert len(with_adapter) == 3
    assert torch.allclose(torch.tensor(with_adapter), torch.tensor(on_merged), rtol=1e-5, atol=0), \
        (with_adapter, on_merged)
    assert max(abs(p - a) / abs(p) for p, a in zip(plain, with_adapter, strict=True)) > 1e-3, (plain, with_adapter)  # it took part
    assert saved.keys() == saved_merged.keys()
    for key, value in saved.items():  # nothing of the adapter in the file: the merged-base run had none to save
        assert torch.allclose(value.float(), saved_merged[key].float(), rtol=1e-3, atol=1e-6), key
    assert unmapped_keys(saved, _load(fixture_paths.mmdit)) == set()  # it loads on the distilled base itself


def test_the_node_leaves_the_models_weights_alone(fixture_paths, adapter_path):
    model = _load(fixture_paths.mmdit)
    adapter = TrainingAdapter(str(adapter_path), STRENGTH, file_digest(adapter_path))
    tagged = attach_training_adapter(model, adapter)
    assert training_adapter_of(tagged) == adapter and training_adapter_of(model) is None
    assert not tagged.patches  # samplers after the node (and Train LoRA's MODEL output) see the distilled model
    assert training_adapter_problems(tagged, "SD3", None) == []


def test_the_run_keeps_its_adapter_under_a_name_of_its_bytes(fixture_paths, adapter_path, tmp_path):
    path = str(fixture_paths.mmdit)
    recipe = ModelRecipe("diffusion_model", path, "default", file_fingerprint(path), loras=(("stacked.st", 1.0),))
    model = attach_training_adapter(_load(fixture_paths.mmdit),
                                    TrainingAdapter(str(adapter_path), STRENGTH, file_digest(adapter_path)))
    replay = with_training_adapter(model, recipe, tmp_path)
    (linked, strength), stacked = replay.loras
    assert strength == STRENGTH and stacked == ("stacked.st", 1.0)  # merged first, then the stacked LoRAs
    assert Path(linked).read_bytes() == adapter_path.read_bytes()
    other = _adapter_file(tmp_path / "other.safetensors", extra_key="diffusion_model.joint_blocks.0.x_block.attn.qkv.diff")
    changed = with_training_adapter(attach_training_adapter(_load(fixture_paths.mmdit), TrainingAdapter(
        str(other), STRENGTH, file_digest(other))), recipe, tmp_path)
    assert Path(changed.loras[0][0]).name != Path(linked).name  # other bytes: a resume cannot mix them
    assert with_training_adapter(_load(fixture_paths.mmdit), recipe, tmp_path) == recipe


def test_checks_name_the_fix(fixture_paths, adapter_path, tmp_path):
    model = _load(fixture_paths.mmdit)

    def problems(path: Path, family: str = "SD3", recipe: ModelRecipe | None = None) -> str:
        tagged = attach_training_adapter(model, TrainingAdapter(str(path), 1.0, "0" * 64))
        return "\n".join(training_adapter_problems(tagged, family, recipe))

    assert "knows none of Wan models" in problems(adapter_path, family="Wan")
    assert "gone from the loras folder" in problems(tmp_path / "missing.safetensors")
    foreign = _adapter_file(tmp_path / "foreign.safetensors", extra_key="diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight")
    text = problems(foreign)
    assert "1 key(s)" in text and "double_blocks.0.img_attn.qkv" in text and "SD3.5 Large Turbo" in text
    gguf = ModelRecipe("gguf", str(tmp_path / "model.gguf"))
    assert "cannot be merged into this quantized base" in problems(adapter_path, recipe=gguf)


WORKFLOW = Path(__file__).resolve().parent.parent / "workflows" / "api" / "pipetrainer_tiny_mmdit.json"


def test_the_graph_samples_the_distilled_model_with_only_the_trained_lora(server, comfy_root, tmp_path):
    """Through the server: Train LoRA after the Training Adapter node trains with the adapter (the run's recipe
    merges it), and its MODEL output samples exactly like the stock LoraLoader with the saved file on the
    distilled base: the adapter reaches neither the saved LoRA nor the MODEL the graph samples with."""
    import json
    import uuid

    import numpy as np
    from PIL import Image
    from pipetrainer.devkit.host import history_error, output_images
    from pipetrainer.training.spec.run_spec import RunSpec

    name = f"adapter_{uuid.uuid4().hex[:6]}"
    adapter = _adapter_file(comfy_root / "models" / "loras" / f"{name}_dedistill.safetensors")
    prompt = json.loads(WORKFLOW.read_text())
    prompt["30"] = {"class_type": "PipeTrainerTrainingAdapter",
                    "inputs": {"model": ["1", 0], "adapter": adapter.name, "strength": STRENGTH}}
    prompt["8"]["inputs"].update(model=["30", 0], lora_name=name, steps=4)
    prompt["14"]["inputs"]["filename_prefix"] = name
    entry = server.wait(server.queue(prompt), timeout=600)
    assert history_error(entry) is None, server.log_tail()
    [run_dir] = sorted((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{name}-*"))
    recipe = RunSpec.load(run_dir / "spec.json").model
    assert [Path(p).name.startswith("training_adapter_") for p, _ in recipe.loras] == [True]
    assert recipe.loras[0][1] == STRENGTH

    stock = {k: v for k, v in json.loads(WORKFLOW.read_text()).items() if k in {"1", "2", "3", "9", "10", "11",
                                                                                "12", "13", "14"}}
    stock["20"] = {"class_type": "LoraLoaderModelOnly",
                   "inputs": {"model": ["1", 0], "lora_name": f"{name}.safetensors", "strength_model": 1.0}}
    stock["12"]["inputs"]["model"] = ["20", 0]
    stock["14"]["inputs"]["filename_prefix"] = name + "_stock"
    sampled = server.wait(server.queue(stock), timeout=300)
    assert history_error(sampled) is None, server.log_tail()
    [trained_image] = output_images(entry, comfy_root)[:1]
    [stock_image] = output_images(sampled, comfy_root)

    def pixels(path):
        return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)

    assert np.array_equal(pixels(trained_image), pixels(stock_image))
