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
from pipetrainer.tests.quant_helpers import (
    bits,
    lora_layers,
    model_inputs,
    random_batch,
    train_steps,
    trainer_vs_comfyui,
    unmapped_keys,
    with_lora,
)
from pipetrainer.training.adapters.inject import freeze_all_but_lora
from pipetrainer.training.model.model_source import load_model
from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec
from safetensors.torch import load_file

GGUF_PATH = os.environ.get("COMFYUI_GGUF_PATH", "")
pytestmark = pytest.mark.skipif(not GGUF_PATH or not Path(GGUF_PATH, "ops.py").is_file(),
                                reason="set COMFYUI_GGUF_PATH to a checkout of github:city96/ComfyUI-GGUF")

# ComfyUI-applied LoRA (patches applied by ComfyUI-GGUF at dequantization, in its patch dtype) vs the
# trainer's forward (fp32 LoRA branch added to the dequantized layer's output), bf16 compute: bound on
# max|diff| / max|output|, ~2.5-4x the values measured on ComfyUI 0.3.75 (comments; effect of the LoRA 0.25-0.47).
LORA = LoraSpec(rank=4, alpha=4.0, targets="all_linear")
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
    adapter, layers, stage = with_lora(patcher, LORA)
    wrapped = lora_layers(stage)
    reader = gguf.GGUFReader(str(gguf_files[qtype]))
    file_bytes = {t.name: torch.from_numpy(t.data.copy()).reshape(-1).view(torch.uint8) for t in reader.tensors}
    kind = gguf.GGMLQuantizationType[qtype]
    dm = patcher.model.diffusion_model
    for name, module in dm.named_modules():
        if hasattr(module, "base_layer") and name:
            weight = module.base_layer.weight
            assert type(weight).__name__ == "GGMLTensor" and weight.tensor_type == kind, name
            assert torch.equal(bits(weight), file_bytes[f"{name}.weight"]), name
    assert len(wrapped) == 37
    params = freeze_all_but_lora(stage)
    before = {n: bits(p).clone() for n, p in stage.named_parameters() if ".lora_" not in n}
    values = train_steps(patcher, adapter, layers, params, 4)
    assert all(math.isfinite(v) for v in values) and values[-1] < 0.9 * values[0], values
    after = {n: p for n, p in stage.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(bits(after[n]), before[n]) for n in before)


def gguf_trainer_vs_comfyui(path: Path, lora: LoraSpec, tensors, batch) -> tuple[float, float, dict]:
    from pipetrainer.training.quant.gguf import gguf_module

    # ComfyUI-GGUF's loader node returns its own ModelPatcher subclass: LoRA patches are kept on the
    # quantized weights and applied when a layer dequantizes.
    patcher_class = gguf_module(GGUF_PATH, "nodes").GGUFModelPatcher
    diff, effect, tensors, _ = trainer_vs_comfyui(_load(path), lambda: patcher_class.clone(_load(path)), lora,
                                                  tensors, batch)
    return diff, effect, tensors


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_comfyui_applied_lora_on_the_gguf_base_reproduces_the_trainer(gguf_files, qtype):
    diff, effect, tensors = gguf_trainer_vs_comfyui(gguf_files[qtype], LORA, None, random_batch(1))
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


def _saved_bytes_and_input_grad(patcher, batch) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for the backward of one forward of the diffusion model, and d(loss)/d(input)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size()
        return t

    noisy, timestep, cond, pooled = model_inputs(patcher.model, *batch)
    noisy = noisy.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = patcher.model.diffusion_model(noisy, timestep, context=cond, y=pooled)
    out.float().square().mean().backward()
    return sum(saved.values()), noisy.grad


def test_gguf_linears_keep_no_dequantized_weight_for_the_backward(gguf_files):
    """ComfyUI-GGUF's own forward (the instance hook removed) is the oracle for the input gradient; it keeps
    the dequantized weights for the backward (measured: ~12 of the 18.6 MB of bf16 weights), ours none."""
    from pipetrainer.training.quant.gguf import gguf_module

    ours = _load(gguf_files["Q8_0"])
    theirs = _load(gguf_files["Q8_0"])
    ggml_linears = [m for m in theirs.model.diffusion_model.modules()
                    if isinstance(m, gguf_module(GGUF_PATH, "ops").GGMLLayer) and isinstance(m, torch.nn.Linear)]
    linears = [m for m in theirs.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(ggml_linears) == len(linears) > 37 and all("forward_ggml_cast_weights" in vars(m) for m in linears)
    for module in ggml_linears:
        del module.forward_ggml_cast_weights  # back to ComfyUI-GGUF's class method
    weight_bytes = sum(math.prod(m.weight.shape) * 2 for m in ggml_linears if m.is_ggml_quantized())  # as bf16
    batch = random_batch(2, tokens=8)
    ours_saved, ours_grad = _saved_bytes_and_input_grad(ours, batch)
    theirs_saved, theirs_grad = _saved_bytes_and_input_grad(theirs, batch)
    # Layers whose input needs no gradient (the timestep and pooled-text embedders) keep nothing either way.
    assert theirs_saved - ours_saved >= 0.6 * weight_bytes, (ours_saved, theirs_saved, weight_bytes)
    assert ours_saved <= 0.1 * weight_bytes, (ours_saved, weight_bytes)
    assert torch.equal(ours_grad, theirs_grad)


def test_the_lean_backward_patch_targets_this_comfyui_gguf():
    """Fails when ComfyUI-GGUF's layers stop calling the hook the patch replaces (patches/gguf_lean_backward.py)."""
    from pipetrainer.patches.gguf_lean_backward import why_not_applicable
    from pipetrainer.training.quant.gguf import gguf_module

    assert why_not_applicable(gguf_module(GGUF_PATH, "ops").GGMLLayer) is None
