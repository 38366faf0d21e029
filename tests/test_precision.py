"""Precisions that mean what they say: bf16 and fp8 bases train, stay quantized, and match ComfyUI.

A "case" is a base precision as users pick it: ``weight_dtype`` on 'Load Diffusion Model (train)'
plus the Train node's ``training_dtype`` (the compute dtype). Fast tier, in this process on the tiny
MMDiT: the loaded model stores and computes in the dtypes asked for; the LoRA's initial weights are
fp32 and bit-identical to those on an fp32 base; a few optimizer steps through the stage layers
lower the loss and leave the quantized base untouched; ComfyUI's stock LoRA loader, on the same
quantized base, reproduces the trainer's forward within a bound stated per case. Slow tier: each
case trains in the real training process tree, and its saved file passes the same comparison.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.tests.quant_helpers import (
    bits,
    comfy_compute_dtype,
    random_batch,
    train_steps,
    trainer_vs_comfyui,
    with_lora,
)
from pipetrainer.training.adapters.inject import freeze_all_but_lora, named_lora_parameters
from pipetrainer.training.model.model_source import load_model, model_options
from pipetrainer.training.spec.choices import WEIGHT_DTYPES, SpecError
from pipetrainer.training.spec.options import CacheItem, LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec
from safetensors.torch import load_file


@dataclasses.dataclass(frozen=True)
class Case:
    weight_dtype: str  # the loader's choice
    compute: str  # the Train node's training_dtype
    stored: torch.dtype  # what the base weights must stay in
    # ComfyUI-applied LoRA vs the trainer's forward: bound on max|diff| / max|ComfyUI output|.
    tolerance: float


# Tolerances are ~3x the largest value measured on the tiny MMDiT, with random B ~ N(0, 0.5) / with the
# LoRA trained by the slow tests (in the comments). The trainer adds the fp32 LoRA branch to the base
# layer's output; ComfyUI merges W + s*B@A into the weight in fp32 and stores it back in the weight dtype
# (fp8: stochastically rounded), so the bound grows with the weight dtype's ulp.
CASES = {
    "fp32": Case("default", "fp32", torch.float32, 1e-6),  # measured 3.4e-7
    "bf16": Case("default", "bf16", torch.bfloat16, 1.5e-2),  # measured 3.4e-3 / 5.5e-3
    "fp8_e4m3fn": Case("fp8_e4m3fn", "bf16", torch.float8_e4m3fn, 5e-2),  # measured 1.8e-2 / 5.6e-3
    "fp8_e5m2": Case("fp8_e5m2", "bf16", torch.float8_e5m2, 1e-1),  # measured 3.5e-2 / 5.5e-3
    "fp8_e4m3fn+fp32": Case("fp8_e4m3fn", "fp32", torch.float8_e4m3fn, 5e-2),  # measured 1.8e-2
}
QUANTIZED = ["bf16", "fp8_e4m3fn", "fp8_e5m2"]
COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}
LORA = LoraSpec(rank=4, alpha=4.0, targets="all_linear")


# ---- helpers ---------------------------------------------------------------------------------


def _load(path: Path, case: Case):
    return load_model(ModelRecipe("diffusion_model", str(path), case.weight_dtype), case.compute)


def _base_weights(stage) -> dict[str, torch.Tensor]:
    return {n: p for n, p in stage.named_parameters() if ".lora_" not in n}


def _trainer_vs_comfyui(model_path: Path, case: Case, lora: LoraSpec, tensors: dict[str, torch.Tensor] | None, batch):
    """``(max|trainer - ComfyUI| / scale, max|ComfyUI with - without LoRA| / scale)`` on one batch.

    Trainer: the stage layers with PEFT LoRA holding ``tensors`` (a LoRA file's; None: random B).
    ComfyUI: a second load of the same quantized base with the file through its stock LoRA loader.
    """
    diff, effect, _, got = trainer_vs_comfyui(_load(model_path, case), lambda: _load(model_path, case), lora,
                                              tensors, batch)
    assert got.dtype == COMPUTE[case.compute]
    return diff, effect


# ---- fast tier: dtypes as asked -------------------------------------------------------------


def test_training_model_options_pin_the_storage_dtype():
    """With a compute dtype, "default" weights are stored in it: ComfyUI's device heuristics (bf16 or
    fp16 on CUDA) are never consulted. Without one, the stock loader's mapping (the graph's MODEL)."""
    assert model_options("default") == {}
    assert model_options("fp8_e4m3fn_fast") == {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    assert model_options("default", "fp32") == {"dtype": torch.float32}
    assert model_options("default", "bf16") == {"dtype": torch.bfloat16}
    for compute in ("fp32", "bf16"):
        assert model_options("fp8_e4m3fn", compute) == {"dtype": torch.float8_e4m3fn}
        assert model_options("fp8_e5m2", compute) == {"dtype": torch.float8_e5m2}


@pytest.mark.parametrize("name", list(CASES))
def test_loaded_model_stores_and_computes_in_the_dtypes_asked_for(fixture_paths, name):
    """On CPU ComfyUI would compute a bf16 or fp8 model in fp32 (its manual cast): the trainer overrides it."""
    case = CASES[name]
    patcher = _load(fixture_paths.mmdit, case)
    assert comfy_compute_dtype(patcher.model) == COMPUTE[case.compute]
    _, _, stage = with_lora(patcher, LORA)
    freeze_all_but_lora(stage)
    base = _base_weights(stage)
    assert sum(n.endswith("base_layer.weight") for n in base) == 37
    assert {p.dtype for p in base.values()} == {case.stored}
    assert {p.dtype for p in named_lora_parameters(stage).values()} == {torch.float32}


@pytest.mark.parametrize("name", QUANTIZED)
def test_initial_lora_is_fp32_and_bitwise_equal_to_the_fp32_base_init(fixture_paths, name):
    """PEFT moves a new adapter to its base weight's dtype; the init must not be rounded through it."""
    _, _, reference = with_lora(_load(fixture_paths.mmdit, CASES["fp32"]), LORA)
    _, _, stage = with_lora(_load(fixture_paths.mmdit, CASES[name]), LORA)
    expected, got = named_lora_parameters(reference), named_lora_parameters(stage)
    assert got.keys() == expected.keys() and len(got) == 2 * 37
    for key, value in got.items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[key]), key
    a = torch.cat([v.flatten() for k, v in got.items() if ".lora_A." in k])
    assert not torch.equal(a, a.to(CASES[name].stored).float())  # a rounded init would have shown
    assert all(torch.count_nonzero(v) == 0 for k, v in got.items() if ".lora_B." in k)


@pytest.mark.parametrize("name", [pytest.param("bf16", marks=pytest.mark.slow), "fp8_e4m3fn",
                                  pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_lora_trains_on_the_quantized_base_and_leaves_it_untouched(fixture_paths, name):
    """Six AdamW steps through the stage layers on one fixed batch (short captions: CPU bf16 and fp8
    casts are slow): the loss falls, gradients reach the fp32 LoRA, the base's bytes do not change.
    Checkpointed steps, as the engine runs them, are the real-process tests' part (slow tier)."""
    case = CASES[name]
    patcher = _load(fixture_paths.mmdit, case)
    adapter, layers, stage = with_lora(patcher, LORA)
    params = freeze_all_but_lora(stage)
    before = {n: bits(p).clone() for n, p in _base_weights(stage).items()}
    values = train_steps(patcher, adapter, layers, params, 6, compute=COMPUTE[case.compute])
    assert all(math.isfinite(v) for v in values)
    assert values[-1] < 0.85 * values[0], values  # measured: 0.75x for each case
    after = _base_weights(stage)
    assert after.keys() == before.keys()
    assert all(p.dtype == case.stored and not p.requires_grad for p in after.values())
    assert all(torch.equal(bits(after[n]), before[n]) for n in before)


@pytest.mark.parametrize("name", list(CASES))
def test_comfyui_applied_lora_reproduces_the_trainer_forward(fixture_paths, name):
    case = CASES[name]
    diff, effect = _trainer_vs_comfyui(fixture_paths.mmdit, case, LORA, None, random_batch(1))
    assert diff <= case.tolerance, (diff, case.tolerance)
    # The LoRA moves the output by ~0.25 of its scale: the comparison cannot pass without it.
    assert effect > 2 * case.tolerance, (effect, case.tolerance)


# ---- fast tier: choices that cannot train ---------------------------------------------------


def _valid_spec(fixture_paths, comfy_root, tmp_path):
    item = CacheItem(latent_file=str(tmp_path / "l.safetensors"), text_file=str(tmp_path / "t.safetensors"),
                     source="a.png", caption="a")
    return make_spec(fixture_paths.mmdit, [item], tmp_path / "run", comfy_root)


def test_fast_fp8_weights_are_refused_with_the_reason(fixture_paths, comfy_root, tmp_path):
    spec = _valid_spec(fixture_paths, comfy_root, tmp_path)
    fast = dataclasses.replace(spec, model=dataclasses.replace(spec.model, weight_dtype="fp8_e4m3fn_fast"))
    with pytest.raises(SpecError, match=r"fp8_e4m3fn_fast.*_scaled_mm.*no backward.*Choose weight_dtype fp8_e4m3fn"):
        fast.validated()


def test_fp16_compute_is_refused_with_the_reason(fixture_paths, comfy_root, tmp_path):
    spec = _valid_spec(fixture_paths, comfy_root, tmp_path)
    fp16 = dataclasses.replace(spec, train=dataclasses.replace(spec.train, dtype="fp16"))
    with pytest.raises(SpecError, match=r"'fp16'.*loss scaling.*Choose bf16"):
        fp16.validated()


def test_train_node_default_dtype_is_train_spec_default(comfy_root):
    from pipetrainer.nodes.train import PipeTrainerTrain

    inputs = {i.id: i for i in PipeTrainerTrain.define_schema().inputs}
    assert inputs["training_dtype"].default == TrainSpec().dtype == "bf16"
    assert "fp16" not in inputs["training_dtype"].options


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_load_node_offers_every_weight_dtype_for_inference(fixture_paths, weight_dtype):
    """The loader keeps the stock choices (fp8_e4m3fn_fast included): they load and sample."""
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    schema = {i.id: i for i in PipeTrainerLoadDiffusionModel.define_schema().inputs}
    assert schema["weight_dtype"].options == list(WEIGHT_DTYPES)
    model = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, weight_dtype).result[0].model
    stored = {"default": torch.float32, "fp8_e5m2": torch.float8_e5m2}.get(weight_dtype, torch.float8_e4m3fn)
    assert model.get_dtype() == stored  # CPU: ComfyUI keeps "default" in the file's fp32
    x0, cond, pooled, noise, sigma = random_batch()
    with torch.no_grad():
        out = model.apply_model(noise, sigma, c_crossattn=cond, y=pooled)
    assert out.shape == x0.shape and torch.isfinite(out).all()


# ---- slow tier: the real training process ---------------------------------------------------


TRAINED_LORA = LoraSpec(rank=8, alpha=8.0)


@pytest.fixture(scope="module")
def trained(fixture_paths, demo_cache, comfy_root, tmp_path_factory):
    """Twelve seeded steps on one item in the real process tree, per case (and a control), run once."""
    runs: dict[str, tuple] = {}

    def run(name: str, lr: float = 1e-2):
        key = f"{name}@{lr}"
        if key not in runs:
            case = CASES[name]
            spec = make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path_factory.mktemp(name) / "run",
                             comfy_root, steps=12, dtype=case.compute, lora=TRAINED_LORA,
                             optimizer=OptimizerSpec(lr=lr, weight_decay=0.0))
            spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, weight_dtype=case.weight_dtype))
            code, events = run_training(spec)
            assert code == 0, [e for e in events if e["type"] == "error"]
            runs[key] = (spec, losses(events))
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_base_trains_in_the_real_process(trained, name):
    """The same 12 micro-batches (same seed: same noise and sigmas) untrained (lr 1e-7) and trained:
    per-step losses vary a lot with sigma, so the trained run is judged against that control.
    Measured: last-4 means ~1.54 trained vs ~2.43 untrained for every case."""
    _, control = trained("bf16", lr=1e-7)
    _, values = trained(name)
    assert len(values) == 12 and all(math.isfinite(v) for v in values), values
    assert values[0] == pytest.approx(control[0], rel=0.02)  # B = 0: the first step is the base model's loss
    assert sum(values[-4:]) < 0.8 * sum(control[-4:]), (values, control)


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED)
def test_trained_lora_applied_by_comfyui_reproduces_the_trainer_forward(trained, fixture_paths, demo_cache, name):
    from pipetrainer.training.data.micro_batches import load_examples

    case = CASES[name]
    spec, _ = trained(name)
    example = load_examples(demo_cache.items[:1])[0]
    x0 = _load(fixture_paths.mmdit, case).model.process_latent_in(example.latent.float()[None])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9))
    batch = (x0, example.cond.float()[None], example.pooled.float()[None], noise, torch.tensor([0.6]))
    diff, effect = _trainer_vs_comfyui(fixture_paths.mmdit, case, TRAINED_LORA, load_file(spec.lora_output), batch)
    assert diff <= case.tolerance, (diff, case.tolerance)
    assert effect > 10 * case.tolerance, (effect, case.tolerance)  # measured: the trained LoRA moves it by ~1.3
