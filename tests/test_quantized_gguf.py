"""GGUF bases through ComfyUI-GGUF's own reader and layers (Q8_0, Q6_K, Q5_K, Q4_K).

ComfyUI-GGUF is on no package registry: these tests run when ``COMFYUI_GGUF_PATH`` points at a checkout
of github:city96/ComfyUI-GGUF kept outside the repo, and are skipped otherwise. Each file is written in
the test from the tiny MMDiT with the ``gguf`` package (Linear weights quantized, the rest F32; K-quant
blocks are random codes at the weights' scale, as the package cannot encode K-quants, with a fp32 twin of
exactly the values they hold: devkit/quant_fixtures.py). Fast
tier: the trainer's replay keeps every Linear weight a ``GGMLTensor`` of the file's type with the
file's bytes, a few optimizer steps lower the loss without touching them, the LoRA keys map on the
GGUF base and on the fp32 original, and ComfyUI (with ComfyUI-GGUF's own model patcher, as its loader
node returns it) applies the LoRA as the trainer computed. Slow tier: Q8_0 trains in the real process.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
from pipetrainer.devkit import quant_fixtures
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.tests.test_quantized import (
    LORA,
    _bits,
    _lora_layers,
    _model_inputs,
    _random_batch,
    _run,
    _with_lora,
    unmapped_keys,
)
from pipetrainer.training.engine import _inputs_need_grad
from pipetrainer.training.lora_file import comfy_key_for, lora_state_dict
from pipetrainer.training.lora_inject import freeze_all_but_lora, named_lora_parameters
from pipetrainer.training.loss import mse_loss
from pipetrainer.training.model_source import load_model
from pipetrainer.training.pipelines.base import Batch
from pipetrainer.training.spec import LoraSpec, ModelRecipe, OptimizerSpec
from safetensors.torch import load_file

GGUF_PATH = os.environ.get("COMFYUI_GGUF_PATH", "")
pytestmark = pytest.mark.skipif(not GGUF_PATH or not Path(GGUF_PATH, "ops.py").is_file(),
                                reason="set COMFYUI_GGUF_PATH to a checkout of github:city96/ComfyUI-GGUF")

# ComfyUI-applied LoRA (patches applied by ComfyUI-GGUF at dequantization, in its patch dtype) vs the
# trainer's forward (fp32 LoRA branch added to the dequantized layer's output), bf16 compute: bound on
# max|diff| / max|output|, ~2.5-4x the values measured on ComfyUI 0.3.75 (comments; effect of the LoRA 0.25-0.47).
QTYPES = {"Q8_0": 1.5e-2, "Q6_K": 1.5e-2, "Q5_K": 1.5e-2, "Q4_K": 1.5e-2}  # 3.4e-3, 6.3e-3, 5.4e-3, 6.5e-3


class _Files(dict):
    """``qtype -> GGUF file``, each written on first use with its full-precision twin (``.original``)."""

    def __init__(self, source: Path, folder: Path):
        super().__init__()
        self.source, self.folder = source, folder

    def __missing__(self, qtype: str) -> Path:
        path = quant_fixtures.write_gguf(self.source, self.folder / f"mmdit-{qtype}.gguf", qtype,
                                         original=self.original(qtype))
        self[qtype] = path
        return path

    def original(self, qtype: str) -> Path:
        return self.folder / f"mmdit-{qtype}-original.safetensors"


@pytest.fixture(scope="module")
def gguf_files(fixture_paths, tmp_path_factory):
    return _Files(fixture_paths.mmdit, tmp_path_factory.mktemp("gguf"))


def _load(path: Path, compute: str = "bf16"):
    return load_model(ModelRecipe("gguf", str(path), extension_path=GGUF_PATH), compute)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_gguf_base_stays_quantized_and_the_lora_trains(gguf_files, qtype):
    import gguf

    patcher = _load(gguf_files[qtype])
    adapter, layers, stage = _with_lora(patcher)
    wrapped = _lora_layers(stage)
    reader = gguf.GGUFReader(str(gguf_files[qtype]))
    file_bytes = {t.name: torch.from_numpy(t.data.copy()).reshape(-1).view(torch.uint8) for t in reader.tensors}
    kind = gguf.GGMLQuantizationType[qtype]
    dm = patcher.model.diffusion_model
    for name, module in dm.named_modules():
        if hasattr(module, "base_layer") and name:
            weight = module.base_layer.weight
            assert type(weight).__name__ == "GGMLTensor" and weight.tensor_type == kind, name
            assert torch.equal(_bits(weight), file_bytes[f"{name}.weight"]), name
    assert len(wrapped) == 37
    params = freeze_all_but_lora(stage)
    before = {n: _bits(p).clone() for n, p in stage.named_parameters() if ".lora_" not in n}
    optimizer = torch.optim.AdamW(params, lr=3e-2, weight_decay=0.0)
    x0, cond, pooled, noise, sigma = _random_batch(tokens=8)
    noisy, timestep, cond, pooled = _model_inputs(patcher.model, x0, cond, pooled, noise, sigma)
    inputs = adapter.first_stage_inputs(Batch(noisy, timestep, cond, pooled, options=adapter.options_type()))
    values = []
    for _ in range(4):
        loss = mse_loss(_run(layers, _inputs_need_grad(inputs)), noise - x0)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        values.append(loss.item())
    assert all(math.isfinite(v) for v in values) and values[-1] < 0.9 * values[0], values
    after = {n: p for n, p in stage.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(_bits(after[n]), before[n]) for n in before)


def gguf_trainer_vs_comfyui(path: Path, lora: LoraSpec, tensors, batch) -> tuple[float, float, dict]:
    import comfy.sd
    from pipetrainer.training.quant.gguf import gguf_module

    ours = _load(path)
    adapter, layers, stage = _with_lora(ours, lora)
    params = named_lora_parameters(stage)
    paths = {i: layer.comfy_paths for i, layer in layers}
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in params.items():
            if tensors is None:
                if ".lora_B." in name:
                    p.normal_(0.0, 0.5, generator=g)
            else:
                key, kind = comfy_key_for(name, paths)
                p.copy_(tensors[f"{key}.{kind}"])
    if tensors is None:
        tensors = lora_state_dict(params, paths, lora.alpha)
    noisy, timestep, cond, pooled = _model_inputs(ours.model, *batch)
    with torch.no_grad():
        got = _run(layers, adapter.first_stage_inputs(Batch(noisy, timestep, cond, pooled,
                                                            options=adapter.options_type())))
    # ComfyUI-GGUF's loader node returns its own ModelPatcher subclass: LoRA patches are kept on the
    # quantized weights and applied when a layer dequantizes.
    patcher_class = gguf_module(GGUF_PATH, "nodes").GGUFModelPatcher
    theirs = patcher_class.clone(_load(path))
    dm = theirs.model.diffusion_model
    with torch.no_grad():
        plain = dm(noisy, timestep, context=cond, y=pooled).float()
        patched, _ = comfy.sd.load_lora_for_models(theirs, None, tensors, 1.0, 0)
        patched.patch_model()
        try:
            reference = dm(noisy, timestep, context=cond, y=pooled).float()
        finally:
            patched.unpatch_model()
    scale = reference.abs().max().item()
    return (got.float() - reference).abs().max().item() / scale, (reference - plain).abs().max().item() / scale, tensors


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_comfyui_applied_lora_on_the_gguf_base_reproduces_the_trainer(gguf_files, qtype):
    diff, effect, tensors = gguf_trainer_vs_comfyui(gguf_files[qtype], LORA, None, _random_batch(1))
    assert diff <= QTYPES[qtype], (diff, QTYPES[qtype])
    assert effect > 2 * QTYPES[qtype], effect
    assert unmapped_keys(tensors, _load(gguf_files[qtype])) == set()
    original = load_model(ModelRecipe("diffusion_model", str(gguf_files.original(qtype))), "fp32")
    assert unmapped_keys(tensors, original) == set()


@pytest.mark.slow
def test_gguf_q8_trains_in_the_real_process(gguf_files, demo_cache, comfy_root, tmp_path):
    """12 seeded steps vs an untrained control (lr 1e-7) on the same Q8_0 file; the saved LoRA maps."""
    path = gguf_files["Q8_0"]
    results = {}
    for lr in (1e-7, 1e-2):
        spec = make_spec(path, demo_cache.items[:1], tmp_path / f"run{lr}", comfy_root, steps=12, dtype="bf16",
                         lora=LoraSpec(rank=8, alpha=8.0), optimizer=OptimizerSpec(lr=lr, weight_decay=0.0))
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, loader="gguf", extension_path=GGUF_PATH))
        code, events = run_training(spec)
        assert code == 0, [e for e in events if e["type"] == "error"]
        results[lr] = (spec, losses(events))
    (_, control), (spec, values) = results[1e-7], results[1e-2]
    assert len(values) == 12 and sum(values[-4:]) < 0.8 * sum(control[-4:]), (values, control)
    tensors = load_file(spec.lora_output)
    assert unmapped_keys(tensors, _load(path)) == set()
