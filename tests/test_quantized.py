"""Training on the quantized files users keep: fp8, legacy scaled fp8 and ComfyUI's per-layer format
(fp8, and on current ComfyUI its 2026 formats int8_tensorwise, nvfp4 and mxfp8; convrot_w4a4 is refused).

Each format is written in the test from the tiny MMDiT (devkit/quant_fixtures.py quantizes its Linear
weights only, like the real converters). Fast tier, in this process: ComfyUI's loader, replayed by the
trainer, keeps the weights quantized (dtype / tensor type and the file's bytes); the LoRA lands on every
Linear (PEFT's, or ours on ComfyUI's per-layer-quantized Linear, which is not an ``nn.Linear``); a few
optimizer steps lower the loss and leave the base's bytes untouched; the LoRA's keys map with ComfyUI's
``model_lora_keys_unet`` on the quantized base and on the full-precision original; and ComfyUI's stock
LoRA loader, on the same quantized base, reproduces the trainer's forward within a bound per format.
Slow tier: each format but plain fp8 (which loads like a full-precision file) trains in the real training process
tree and its saved file passes the same checks.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from pipetrainer.devkit import quant_fixtures
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.tests.quant_helpers import (
    LINEARS,
    bits,
    lora_layers,
    random_batch,
    storage,
    train_steps,
    unmapped_keys,
    with_lora,
)
from pipetrainer.tests.quant_helpers import trainer_vs_comfyui as shared_trainer_vs_comfyui
from pipetrainer.training.adapters.inject import freeze_all_but_lora
from pipetrainer.training.model.model_source import load_model
from pipetrainer.training.quant.formats import WeightFormat, file_weight_format
from pipetrainer.training.quant.guards import set_float_weights_trainable
from pipetrainer.training.quant.layers import QuantLinearLora, is_comfy_quant_linear
from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, OptimizerSpec
from safetensors import safe_open
from safetensors.torch import load_file

LORA = LoraSpec(rank=4, alpha=4.0, targets="all_linear")


@dataclasses.dataclass(frozen=True)
class Format:
    fmt: WeightFormat
    write: object  # (source, target) -> path
    stored: torch.dtype  # the Linear weights' storage dtype after loading
    # ComfyUI-applied LoRA vs the trainer's forward: bound on max|diff| / max|ComfyUI output|, bf16 compute.
    # ComfyUI merges W + s*B@A in fp32 and stores it back in fp8 (stochastic rounding; per-layer: requantized
    # with a recalculated scale), the trainer adds the fp32 LoRA branch to the fp8 layer's output: the bound
    # is set by fp8's ulp, like test_precision.py's fp8 cases (~3x the measured values in the comments).
    tolerance: float
    requires: str | None = None  # the comfy.quant_ops.QUANT_ALGOS format this row needs (None: any host)


def _comfy_quant(fmt: str):
    return lambda s, t: quant_fixtures.write_comfy_quant(s, t, fmt)


def missing_on_host(name: str) -> str | None:
    """Why this ComfyUI cannot load the format of row ``name`` (None: it can)."""
    import comfy.quant_ops

    fmt = FORMATS[name].requires
    if fmt is None or fmt in comfy.quant_ops.QUANT_ALGOS:
        return None
    return f"this ComfyUI's comfy.quant_ops.QUANT_ALGOS has no {fmt!r} (ComfyUI's 2026 per-layer formats)"


# Measured with random B ~ N(0, 0.5), ComfyUI 0.3.75 / current: e4m3fn 1.9e-2 / 1.9e-2, e5m2 3.5e-2 / 3.1e-2,
# scaled fp8 3.1e-2 / 1.7e-2 (0.3.75: scaled_fp8_ops; current: converted to the per-layer format),
# per-layer 1.5e-2 / 1.7e-2; the LoRA moves the output by ~0.25 of its scale in every case.
# ComfyUI's 2026 per-layer formats (current ComfyUI only; written by its own layout classes, embedders kept in
# full precision). On the CPU ComfyUI runs int8_tensorwise with comfy_kitchen's eager int8 kernel and emulates
# nvfp4 / mxfp8 (dequantize, full-precision matmul; native only on devices with those kernels). Measured:
# int8_tensorwise 1.4e-2, nvfp4 5.6e-2 (4-bit: ComfyUI requantizes W + s*B@A to nvfp4; bound ~1.8x, since the
# LoRA's effect 0.23 must stay above twice it), mxfp8 1.9e-2. convrot_w4a4 is refused
# (training/quant/formats.py quant_format_problem; test_convrot_w4a4_and_unknown_formats_are_refused).
FORMATS = {
    "fp8_e4m3fn": Format(WeightFormat.FP8, quant_fixtures.write_fp8, torch.float8_e4m3fn, 5e-2),
    "fp8_e5m2": Format(WeightFormat.FP8, lambda s, t: quant_fixtures.write_fp8(s, t, torch.float8_e5m2),
                       torch.float8_e5m2, 1e-1),
    "scaled_fp8": Format(WeightFormat.SCALED_FP8, quant_fixtures.write_scaled_fp8, torch.float8_e4m3fn, 8e-2),
    "per_layer": Format(WeightFormat.PER_LAYER, quant_fixtures.write_per_layer, torch.float8_e4m3fn, 5e-2),
    "int8_tensorwise": Format(WeightFormat.PER_LAYER, _comfy_quant("int8_tensorwise"), torch.int8, 4e-2,
                              "int8_tensorwise"),
    "nvfp4": Format(WeightFormat.PER_LAYER, _comfy_quant("nvfp4"), torch.uint8, 1e-1, "nvfp4"),
    "mxfp8": Format(WeightFormat.PER_LAYER, _comfy_quant("mxfp8"), torch.float8_e4m3fn, 5e-2, "mxfp8"),
}


@pytest.fixture(scope="module")
def quantized(fixture_paths, tmp_path_factory):
    """``name -> path`` of the tiny MMDiT written in each format (built once per module)."""
    folder = tmp_path_factory.mktemp("quantized")
    return {name: f.write(fixture_paths.mmdit, folder / f"mmdit-{name}.safetensors") for name, f in FORMATS.items()
            if missing_on_host(name) is None}


@pytest.fixture
def on_host(request, comfy_root):
    """Skips a row whose format this ComfyUI lacks, naming the missing piece."""
    name = request.node.callspec.params["name"]
    reason = missing_on_host(name)
    if reason:
        pytest.skip(f"{name}: {reason}")


# ---- helpers ---------------------------------------------------------------------------------


def _load(path: Path, compute: str = "bf16"):
    return load_model(ModelRecipe("diffusion_model", str(path), "default"), compute)


def _linear_weight(module: torch.nn.Module) -> torch.Tensor:
    return module.base_layer.weight if hasattr(module, "base_layer") else module.weight


def _reference_compute(path: Path, compute: str) -> str:
    """ComfyUI 0.3.75's per-layer-quantized layers compute only in the dtype chosen at load (fp32 on CPU):
    there, ComfyUI's reference runs in fp32 (the trainer's layers cast to it and back: QuantLinearLora)."""
    import comfy.ops

    per_layer = file_weight_format(str(path))[0] in (WeightFormat.PER_LAYER,)
    return "fp32" if per_layer and not hasattr(comfy.ops, "QuantLinearFunc") else compute


def trainer_vs_comfyui(path: Path, lora: LoraSpec, tensors: dict[str, torch.Tensor] | None, batch,
                       compute: str = "bf16") -> tuple[float, float, dict[str, torch.Tensor]]:
    """``(max|trainer - ComfyUI| / scale, max|ComfyUI with - without LoRA| / scale, LoRA tensors)``.

    Trainer: the stage layers over the replayed quantized base with the LoRA holding ``tensors``
    (None: random B). ComfyUI: a second load of the same file with its stock LoRA loader.
    """
    diff, effect, tensors, _ = shared_trainer_vs_comfyui(
        _load(path, compute), lambda: _load(path, _reference_compute(path, compute)), lora, tensors, batch)
    return diff, effect, tensors


# ---- fast tier -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_file_format_is_read_from_the_header(on_host, quantized, fixture_paths, name):
    fmt, fp8 = file_weight_format(str(quantized[name]))
    stored = FORMATS[name].stored
    assert fmt is FORMATS[name].fmt and fp8 == (stored if stored.is_floating_point else None)
    assert file_weight_format(str(fixture_paths.mmdit)) == (WeightFormat.PLAIN, None)


@pytest.mark.parametrize("name", list(FORMATS))
def test_replayed_base_keeps_the_files_quantized_bytes(on_host, quantized, name):
    """Every Linear weight stays in the file's fp8 bytes (never dequantized to bf16 as a whole)."""
    patcher = _load(quantized[name])
    _, _, stage = with_lora(patcher, LORA)
    wrapped = lora_layers(stage)
    assert len(wrapped) == LINEARS
    per_layer = FORMATS[name].fmt is WeightFormat.PER_LAYER or (
        FORMATS[name].fmt is WeightFormat.SCALED_FP8 and any(is_comfy_quant_linear(m.base_layer) for m in wrapped.values()))
    with safe_open(str(quantized[name]), framework="pt") as f:
        for layer in wrapped.values():
            weight = _linear_weight(layer)
            assert storage(weight).dtype == FORMATS[name].stored
            if per_layer:
                assert type(weight).__name__ == "QuantizedTensor" or type(weight.data).__name__ == "QuantizedTensor"
                assert isinstance(layer, QuantLinearLora)
    # the bytes: the loaded fp8 data of one layer of each kind equals the file's tensor
    dm = patcher.model.diffusion_model
    with safe_open(str(quantized[name]), framework="pt") as f:
        for key in ("joint_blocks.0.x_block.attn.qkv.weight", "joint_blocks.3.context_block.attn.qkv.weight",
                    "final_layer.linear.weight"):
            module = dm.get_submodule(key.rsplit(".", 1)[0])
            module = getattr(module, "base_layer", module)
            assert torch.equal(bits(module.weight), bits(f.get_tensor(key))), key


@pytest.mark.parametrize("name", [n if n != "fp8_e5m2" else pytest.param(n, marks=pytest.mark.slow) for n in FORMATS])
def test_lora_trains_on_the_quantized_base_and_leaves_it_untouched(on_host, quantized, name):
    patcher = _load(quantized[name])
    adapter, layers, stage = with_lora(patcher, LORA)
    params = freeze_all_but_lora(stage)
    assert len(params) == 2 * LINEARS and {p.dtype for p in params} == {torch.float32}
    base = {n: p for n, p in stage.named_parameters() if ".lora_" not in n}
    before = {n: bits(p).clone() for n, p in base.items()}
    values = train_steps(patcher, adapter, layers, params, 6)
    assert all(math.isfinite(v) for v in values)
    assert values[-1] < 0.85 * values[0], values
    after = {n: p for n, p in stage.named_parameters() if ".lora_" not in n}
    assert after.keys() == before.keys()
    assert all(not p.requires_grad for p in after.values())
    assert all(torch.equal(bits(after[n]), before[n]) for n in before)


@pytest.mark.parametrize("name", list(FORMATS))
def test_comfyui_applied_lora_reproduces_the_trainer_forward(on_host, quantized, fixture_paths, name):
    diff, effect, tensors = trainer_vs_comfyui(quantized[name], LORA, None, random_batch(1))
    tolerance = FORMATS[name].tolerance
    assert diff <= tolerance, (diff, tolerance)
    assert effect > 2 * tolerance, (effect, tolerance)  # the LoRA moves the output: the check can fail
    assert unmapped_keys(tensors, _load(quantized[name])) == set()
    assert unmapped_keys(tensors, _load(fixture_paths.mmdit, "fp32")) == set()
    assert len(tensors) == 3 * LINEARS


def test_requires_grad_skips_weights_that_cannot_have_grads():
    """Integer weights (ComfyUI-GGUF's uint8 GGMLTensor) raise on ``requires_grad_(True)``."""
    module = torch.nn.Module()
    module.q = torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
    module.f = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    with pytest.raises(RuntimeError):
        module.requires_grad_(True)
    assert set_float_weights_trainable(module, True) == 1
    assert module.f.requires_grad and not module.q.requires_grad
    set_float_weights_trainable(module, False)
    assert not module.f.requires_grad


def test_host_fp8_compute_switch_forces_full_precision_matmul(comfy_root):
    """0.3.75's per-layer layers on an fp8-compute device would cut the graph: training switches them to
    the full-precision matmul; current ComfyUI has its own backward and is left alone."""
    import comfy.ops
    from pipetrainer.training.quant.guards import force_full_precision_matmul

    if hasattr(comfy.ops, "QuantLinearFunc"):
        ops = comfy.ops.mixed_precision_ops({}, torch.bfloat16)
        model = torch.nn.Sequential(ops.Linear(4, 4))
        assert force_full_precision_matmul(model) == 0
        return
    ops = comfy.ops.mixed_precision_ops({}, torch.bfloat16, full_precision_mm=False)
    model = torch.nn.Sequential(ops.Linear(4, 4), ops.Linear(4, 4))
    assert is_comfy_quant_linear(model[0]) and not isinstance(model[0], torch.nn.Linear)
    assert force_full_precision_matmul(model) == 2
    assert all(m._full_precision_mm for m in model)


# ---- slow tier: the real training process ----------------------------------------------------

TRAINED_LORA = LoraSpec(rank=8, alpha=8.0)


@pytest.fixture(scope="module")
def trained(quantized, demo_cache, comfy_root, tmp_path_factory):
    runs: dict[str, tuple] = {}

    def run(name: str, lr: float = 1e-2):
        key = f"{name}@{lr}"
        if key not in runs:
            path = quantized[name] if name in quantized else name
            spec = make_spec(Path(path), demo_cache.items[:1], tmp_path_factory.mktemp("run") / "run", comfy_root,
                             steps=12, dtype="bf16", lora=TRAINED_LORA, optimizer=OptimizerSpec(lr=lr, weight_decay=0.0))
            code, events = run_training(spec)
            assert code == 0, [e for e in events if e["type"] == "error"]
            runs[key] = (spec, losses(events))
        return runs[key]

    return run


# fp8 e4m3fn / e5m2 train in this process (test_lora_trains_on_the_quantized_base_and_leaves_it_untouched);
# the real process tree runs the formats with their own load paths: scaled fp8, per-layer fp8 and ComfyUI's 2026
# per-layer formats (stage-wise deferred load of int8 / nvfp4 / mxfp8 layers on current ComfyUI).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["scaled_fp8", "per_layer", "int8_tensorwise", "nvfp4", "mxfp8"])
def test_quantized_file_trains_in_the_real_process(on_host, trained, quantized, fixture_paths, demo_cache, name):
    """12 seeded steps on one item vs an untrained control (lr 1e-7) of the same file; the saved LoRA
    maps on the quantized base and the fp32 original, and ComfyUI applies it as the trainer computed."""
    from pipetrainer.training.data.micro_batches import load_examples

    _, control = trained(name, lr=1e-7)
    spec, values = trained(name)
    assert len(values) == 12 and all(math.isfinite(v) for v in values), values
    assert sum(values[-4:]) < 0.8 * sum(control[-4:]), (values, control)
    tensors = load_file(spec.lora_output)
    assert unmapped_keys(tensors, _load(quantized[name])) == set()
    assert unmapped_keys(tensors, _load(fixture_paths.mmdit, "fp32")) == set()
    example = load_examples(demo_cache.items[:1])[0]
    x0 = _load(quantized[name]).model.process_latent_in(example.latent.float()[None])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9))
    batch = (x0, example.cond.float()[None], example.pooled.float()[None], noise, torch.tensor([0.6]))
    diff, effect, _ = trainer_vs_comfyui(quantized[name], TRAINED_LORA, tensors, batch)
    assert diff <= FORMATS[name].tolerance, (diff, FORMATS[name].tolerance)
    assert effect > 10 * FORMATS[name].tolerance, effect


# Stacked LoRAs on scaled bases: tests/test_stacked_quantized_preflight.py (preflight and loader).


def test_gguf_without_comfyui_gguf_says_where_to_get_it(tmp_path):
    recipe = ModelRecipe("gguf", str(tmp_path / "model.gguf"), extension_path=str(tmp_path / "ComfyUI-GGUF"))
    with pytest.raises(FileNotFoundError, match=r"ComfyUI-GGUF was not found.*github.com/city96/ComfyUI-GGUF"):
        load_model(recipe, "bf16")


def test_convrot_w4a4_and_unknown_formats_are_refused(quantized, tmp_path, comfy_root):
    """convrot_w4a4 is refused with its reason where ComfyUI has it; a format this ComfyUI lacks (all four
    2026 formats on 0.3.75) is refused naming what it has; by preflight and by the training process's loader."""
    import json

    import comfy.quant_ops
    from pipetrainer.nodes.checks.preflight import quant_format_problems
    from pipetrainer.training.quant.formats import quant_format_problem
    from safetensors.torch import save_file

    convrot = tmp_path / "convrot.safetensors"  # the header is all the check reads
    layers = {"joint_blocks.0.x_block.mlp.fc1": {"format": "convrot_w4a4"}}
    save_file({"joint_blocks.0.x_block.mlp.fc1.weight": torch.zeros(4, 2, dtype=torch.int8)}, str(convrot),
              metadata={"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})})
    refused = quant_format_problem(str(convrot), known={"convrot_w4a4", "float8_e4m3fn"})
    assert "quantized as convrot_w4a4, which cannot be trained on" in refused and "no backward" in refused
    unknown = quant_format_problem(str(convrot), known={"float8_e4m3fn"})
    assert "convrot_w4a4, which this ComfyUI cannot load" in unknown and "QUANT_ALGOS has float8_e4m3fn" in unknown
    here = quant_format_problem(str(convrot))
    assert here == (refused if "convrot_w4a4" in comfy.quant_ops.QUANT_ALGOS
                    else quant_format_problem(str(convrot), known=set(comfy.quant_ops.QUANT_ALGOS)))
    assert quant_format_problems("diffusion_model", str(convrot)) == [here]
    assert quant_format_problems("gguf", str(convrot)) == []
    with pytest.raises(ValueError) as raised:
        _load(convrot)
    assert str(raised.value) == here
    assert all(quant_format_problem(str(path)) is None for path in quantized.values())
