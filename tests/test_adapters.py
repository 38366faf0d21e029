"""Adapter types (LoRA, LoKr, LoHa) against ComfyUI's own LoRA loader.

For each type the tiny MMDiT gets the type's PEFT adapters (the trainer's injection), every factor is
randomised (a zero-initialised factor would make "ComfyUI applies it the same" hold for any bug), the
file tensors are built by the function the engine saves with, and ComfyUI's loader must map every
key and reproduce the trainer's forward. LoKr is run with a decomposed ``w2`` (alpha written, ComfyUI
scales) and with both factors whole (scale folded into ``w1``: ComfyUI ignores alpha there), so both
file layouts are exercised. Tolerance: 1e-4 max abs difference of the fp32 velocity (the LoRA
oracle's in tests/test_oracles.py), while the adapter moves it by > 100x that.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

CASES = {  # id: (LoraSpec fields, the file must have these key endings, and not these)
    "lora": (dict(adapter="lora", rank=4, alpha=2.0), (".lora_A.weight", ".lora_B.weight", ".alpha"), ()),
    "lokr-decomposed": (dict(adapter="lokr", rank=4, alpha=2.0), (".lokr_w1", ".lokr_w2_a", ".lokr_w2_b", ".alpha"),
                        (".lokr_w2",)),
    "lokr-whole": (dict(adapter="lokr", rank=64, alpha=16.0), (".lokr_w1", ".lokr_w2"), (".lokr_w2_a", ".alpha")),
    "lokr-factor4": (dict(adapter="lokr", rank=4, alpha=4.0, factor=4), (".lokr_w1", ".lokr_w2_a", ".alpha"), ()),
    "loha": (dict(adapter="loha", rank=4, alpha=2.0), (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".alpha"),
             ()),
}
TOLERANCE = 1e-4


def _stage(fixture_paths, lora, seed: int = 5):
    """The tiny MMDiT's stage layers with ``lora``'s adapters injected, named like a PipelineModule."""
    import comfy.sd
    from pipetrainer.training.adapters.inject import inject_lora
    from pipetrainer.training.pipelines.base import adapter_for

    patcher = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    adapter = adapter_for("SD3")
    dm = patcher.model.diffusion_model
    indexed = [(i + 1, layer) for i, layer in enumerate(adapter.stage_layers(dm))]  # layer 0: input prep
    assert inject_lora(indexed, adapter.lora_target_regex(lora.targets), lora, seed=seed) > 0
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in indexed})
    return patcher, adapter, indexed, stage


def _inputs(patcher, adapter):
    from pipetrainer.training.pipelines.base import Batch

    g = torch.Generator().manual_seed(11)
    dm = patcher.model.diffusion_model
    context, pooled_dim = adapter.conditioning_dims(dm)
    noisy = torch.randn(1, 16, 8, 8, generator=g)
    cond, pooled = torch.randn(1, 7, context, generator=g), torch.randn(1, pooled_dim, generator=g)
    sigma = torch.tensor([0.6])
    ms = patcher.model.model_sampling
    batch = Batch(noisy, ms.timestep(sigma).float(), cond, pooled, options=adapter.options_type())
    return noisy, cond, pooled, sigma, batch


def _trainer_velocity(indexed, adapter, batch) -> torch.Tensor:
    from pipetrainer.training.loop.engine import _inputs_need_grad

    x = _inputs_need_grad(adapter.first_stage_inputs(batch))
    with torch.no_grad():
        for _, layer in indexed:
            x = layer(x)
    return x


def _comfy_velocity(patcher, noisy, cond, pooled, sigma) -> torch.Tensor:
    with torch.no_grad():
        denoised = patcher.model.apply_model(noisy, sigma, c_crossattn=cond, y=pooled)
    return (noisy - denoised) / sigma  # flow models: denoised = x - sigma * v


@pytest.fixture(scope="module")
def comfy_mmdit(fixture_paths):
    """ComfyUI's own tiny MMDiT, loaded once: each test patches a clone and unpatches it."""
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))


def _comfy_applied(model, tensors, inputs, caplog) -> torch.Tensor:
    """ComfyUI's forward with ``tensors`` loaded by its own loader; asserts every key was mapped."""
    import comfy.lora
    import comfy.sd

    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    caplog.clear()
    with caplog.at_level("WARNING"):
        patches = comfy.lora.load_lora(tensors, key_map)
        patched, _ = comfy.sd.load_lora_for_models(model, None, tensors, 1.0, 0)
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(patches) == len({k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0]
                                 for k in tensors if not k.endswith(".alpha")})
    patched.patch_model()
    try:
        return _comfy_velocity(patched, *inputs[:4])
    finally:
        patched.unpatch_model()


def _randomise(stage, seed: int) -> None:
    """Every adapter factor gets N(0, 0.2²) values, fp32."""
    from pipetrainer.training.adapters.inject import named_lora_parameters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in named_lora_parameters(stage).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("case", list(CASES))
def test_comfyui_loads_every_key_and_applies_the_trained_forward(case, fixture_paths, comfy_mmdit, caplog):
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, named_lora_parameters
    from pipetrainer.training.adapters.kinds import adapter_kind
    from pipetrainer.training.adapters.lora_file import stage_lora_tensors
    from pipetrainer.training.loop.health import LoraUntrained, check_lora_update
    from pipetrainer.training.spec.options import LoraSpec

    fields, present, absent = CASES[case]
    lora = LoraSpec(targets="all_linear", save_dtype="fp32", **fields)
    kind = adapter_kind(lora.adapter)
    patcher, adapter, indexed, stage = _stage(fixture_paths, lora)
    trainable = freeze_all_but_lora(stage)
    named = named_lora_parameters(stage)
    # Freezing and gathering find exactly the type's factors, fp32, and nothing else trains.
    assert {id(p) for p in trainable} == {id(p) for p in named.values()}
    assert {id(p) for p in stage.parameters() if p.requires_grad} == {id(p) for p in trainable}
    assert {n.split(".default")[0].rsplit(".", 1)[-1] for n in named} <= set(kind.factors)
    assert {p.dtype for p in trainable} == {torch.float32}
    paths = {i: layer.comfy_paths for i, layer in indexed}
    inputs = _inputs(patcher, adapter)
    noisy, cond, pooled, sigma, batch = inputs

    # Fresh: the zero factors make the update zero (ComfyUI's base forward), and the save check refuses it.
    fresh = stage_lora_tensors(stage, paths, lora)
    with pytest.raises(LoraUntrained):
        check_lora_update(fresh, 1, 1e-4, kind.zero_init_suffixes)
    base = _comfy_velocity(comfy_mmdit, noisy, cond, pooled, sigma)
    assert (_trainer_velocity(indexed, adapter, batch) - base).abs().max().item() <= TOLERANCE

    _randomise(stage, seed=7)
    tensors = stage_lora_tensors(stage, paths, lora)
    check_lora_update(tensors, 1, 1e-4, kind.zero_init_suffixes)
    for ending in present:
        assert any(k.endswith(ending) for k in tensors), (ending, sorted(tensors)[:6])
    for ending in absent:
        assert not any(k.endswith(ending) for k in tensors), ending
    assert all(k.startswith("diffusion_model.") for k in tensors)
    assert {t.dtype for k, t in tensors.items() if not k.endswith(".alpha")} == {torch.float32}

    trained = _trainer_velocity(indexed, adapter, batch)
    applied = _comfy_applied(comfy_mmdit, tensors, inputs, caplog)
    assert torch.equal(_comfy_velocity(comfy_mmdit, noisy, cond, pooled, sigma), base)  # unpatched again
    max_diff = (trained - applied).abs().max().item()
    assert max_diff <= TOLERANCE, max_diff
    assert (base - applied).abs().max().item() > 100 * max(max_diff, 1e-6)  # the adapter really acts


@pytest.mark.parametrize("adapter", ["lora", "lokr", "loha"])
def test_a_bf16_file_is_torch_rounding_of_the_fp32_file(adapter, fixture_paths, tmp_path):
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, named_lora_parameters
    from pipetrainer.training.adapters.lora_file import atomic_save, stage_lora_tensors
    from pipetrainer.training.spec.options import LoraSpec
    from safetensors.torch import load_file

    lora = LoraSpec(rank=4, alpha=2.0, targets="attention", adapter=adapter, save_dtype="fp32")
    _, _, indexed, stage = _stage(fixture_paths, lora)
    freeze_all_but_lora(stage)
    _randomise(stage, seed=3)
    paths = {i: layer.comfy_paths for i, layer in indexed}
    fp32 = stage_lora_tensors(stage, paths, lora)
    atomic_save(stage_lora_tensors(stage, paths, dataclasses.replace(lora, save_dtype="bf16")),
                tmp_path / "bf16.safetensors", {"adapter": adapter})
    bf16 = load_file(tmp_path / "bf16.safetensors")
    assert set(bf16) == set(fp32)
    for key, value in fp32.items():
        if key.endswith(".alpha"):
            assert bf16[key].dtype == torch.float32 and float(bf16[key]) == float(value)
        else:
            assert bf16[key].dtype == torch.bfloat16
            assert torch.equal(bf16[key], value.to(torch.bfloat16)), key
    if adapter != "lokr":  # the fp32 file holds the trained weights bit for bit (LoKr may fold alpha/rank)
        params = sorted(t.detach().flatten().tolist()[0] for t in named_lora_parameters(stage).values())
        saved = sorted(t.flatten().tolist()[0] for k, t in fp32.items() if not k.endswith(".alpha"))
        assert params == saved


def test_dora_is_not_offered_because_comfyui_applies_it_differently(comfy_root):
    """Why there is no DoRA: PEFT divides the magnitude by the row norm of W + s·BA, ComfyUI's
    ``weight_decompose`` (both hosts) by the row norm of W. If this ever fails, ComfyUI applies PEFT's
    DoRA and the type can be registered (training/adapters/kinds.py)."""
    from comfy.weight_adapter.base import weight_decompose
    from peft import LoraConfig, inject_adapter_in_model
    from pipetrainer.training.spec.choices import ADAPTER_TYPES

    assert "dora" not in ADAPTER_TYPES
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False))
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["0"], use_dora=True), model)
    layer = model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.5)
        layer.lora_magnitude_vector["default"].weight.mul_(1.3)
        peft_weight = model(torch.eye(8)).T  # the effective weight PEFT trains with
    w = layer.base_layer.weight.detach().clone()
    diff = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    magnitude = layer.lora_magnitude_vector["default"].weight.detach().reshape(-1, 1)
    comfy_weight = weight_decompose(magnitude, w.clone(), diff.detach().clone(), 1.0, 1.0, torch.float32, lambda a: a)
    assert (comfy_weight - peft_weight).abs().max().item() > 1e-2


def test_lokr_and_loha_are_refused_on_quantized_layers_and_lora_is_not():
    from pipetrainer.training.adapters.kinds import REGISTRY, quant_layer_problem

    names = ["joint_blocks.0.x_block.attn.qkv", "joint_blocks.0.x_block.mlp.fc1"]
    assert quant_layer_problem(REGISTRY["lora"], names) is None
    for kind in ("lokr", "loha"):
        problem = quant_layer_problem(REGISTRY[kind], names)
        assert problem and kind in problem and "joint_blocks.0.x_block.attn.qkv" in problem and "'lora'" in problem
        assert quant_layer_problem(REGISTRY[kind], []) is None


def test_adapter_type_has_no_problems_on_a_plain_model(fixture_paths):
    import comfy.sd
    from pipetrainer.training.adapters.problems import adapter_target_problems
    from pipetrainer.training.spec.options import LoraSpec

    model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model
    for adapter in ("lora", "lokr", "loha"):
        assert adapter_target_problems(model, LoraSpec(adapter=adapter)) == []


def _run_spec(tmp_path, lora):
    from pipetrainer.training.spec.options import CacheItem, LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec
    from pipetrainer.training.spec.run_spec import RunSpec

    return RunSpec(
        model=ModelRecipe("diffusion_model", "/m/model.safetensors", "default", "abc"),
        items=(CacheItem("/c/l.safetensors", "/c/t.safetensors", "/d/a.png", "a cat"),),
        lora=lora or LoraSpec(), optimizer=OptimizerSpec(), train=TrainSpec(steps=4), run_dir=str(tmp_path / "run"),
        lora_output="/loras/x.safetensors", comfyui_path="/comfy")


def test_changing_the_adapter_type_refuses_resume_naming_the_field(tmp_path):
    from pipetrainer.training.loop.resume import check_resume, save_checkpoint_spec
    from pipetrainer.training.spec.options import LoraSpec

    earlier = _run_spec(tmp_path, LoraSpec(adapter="lokr", factor=4))
    tag = tmp_path / "run" / "checkpoints" / "step0000002"
    save_checkpoint_spec(tag, earlier)
    for changed, field in ((LoraSpec(adapter="loha"), "lora.adapter"), (LoraSpec(adapter="lokr"), "lora.factor")):
        check = check_resume(dataclasses.replace(earlier, lora=changed, resume_from=str(tag)))
        assert check.refused and field in check.refused, check.refused
    # The file's dtype does not change the weights: same training hash, resume allowed without a warning.
    same = check_resume(dataclasses.replace(earlier, lora=dataclasses.replace(earlier.lora, save_dtype="bf16"),
                                            resume_from=str(tag)))
    assert same.refused is None and not same.warnings


def test_a_spec_recorded_before_adapter_types_existed_keeps_its_hash(tmp_path):
    """An old record has no adapter/factor/save_dtype in its lora part: its hash (the formula ignores the
    new fields at their defaults) must equal a LoRA run's today, or every old checkpoint is refused."""
    import hashlib

    from pipetrainer.training.spec.options import LoraSpec
    from pipetrainer.training.spec.run_spec import RunSpec

    spec = _run_spec(tmp_path, LoraSpec(rank=4, alpha=2.0))
    old = json.loads(spec.to_json())
    for name in ("adapter", "factor", "save_dtype"):
        del old["lora"][name]
    assert RunSpec.from_dict(old).training_hash() == spec.training_hash()
    lokr = dataclasses.replace(spec, lora=dataclasses.replace(spec.lora, adapter="lokr"))
    assert lokr.training_hash() != spec.training_hash()
    assert hashlib.sha256  # the hash stays a sha256 prefix (format unchanged)
    assert len(spec.training_hash()) == 16


def test_spec_problems_for_adapter_combinations(tmp_path):
    from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec

    def problems(lora, **opt):
        spec = _run_spec(tmp_path, lora)
        return "\n".join(dataclasses.replace(spec, optimizer=OptimizerSpec(**opt)).problems())

    assert "dropout" in problems(LoraSpec(adapter="loha", dropout=0.1))
    assert "lora_plus_ratio" in problems(LoraSpec(adapter="lokr"), lora_plus_ratio=16.0)
    assert "factor" in problems(LoraSpec(adapter="lora", factor=4))
    assert "save_dtype" in problems(LoraSpec(save_dtype="fp16"))
    assert "dora" in problems(LoraSpec(adapter="dora"))
    assert problems(LoraSpec(adapter="lokr", factor=8, save_dtype="bf16")) == ""


def test_the_lora_adapter_node_offers_the_types_and_saves_bf16_by_default(comfy_root):
    from pipetrainer.nodes.lora_adapter import PipeTrainerLoRA
    from pipetrainer.nodes.node_problems import NodeProblems
    from pipetrainer.training.spec.choices import SpecError

    spec = PipeTrainerLoRA.execute(8, 8.0, 0.0, "attention_mlp").result[0]
    assert (spec.adapter, spec.save_dtype, spec.factor) == ("lora", "bf16", -1)
    spec = PipeTrainerLoRA.execute(8, 8.0, 0.0, "attention_mlp", adapter="loha", factor=4, save_dtype="fp32").result[0]
    assert (spec.adapter, spec.factor, spec.save_dtype) == ("loha", -1, "fp32")  # factor is LoKr's only
    assert PipeTrainerLoRA.execute(8, 8.0, 0.0, "attention", adapter="lokr", factor=4).result[0].factor == 4
    with pytest.raises(NodeProblems, match="dropout"):  # listed once on the node (nodes/node_problems.py)
        PipeTrainerLoRA.validate_inputs(adapter="lokr", dropout=0.1, factor=-1)
    assert PipeTrainerLoRA.validate_inputs(adapter="lokr", dropout=0.0, factor=4) is True
    with pytest.raises(SpecError):
        PipeTrainerLoRA.execute(8, 8.0, 0.2, "attention", adapter="loha")
    schema = PipeTrainerLoRA.define_schema()
    names = [i.id for i in schema.inputs]
    assert names[:4] == ["rank", "alpha", "dropout", "targets"]  # saved workflows keep their widget order
    assert names[4:] == ["adapter", "factor", "save_dtype", "blocks", "init_lora"]


def test_lokr_on_a_per_layer_quantized_model_is_refused_in_preflight_and_at_injection(fixture_paths, tmp_path):
    """ComfyUI's per-layer-quantized Linears (not nn.Linear) take the project's LoRA only: preflight names
    them for lokr/loha, and injection (the training process) refuses with the same message."""
    from pipetrainer.devkit import quant_fixtures
    from pipetrainer.training.adapters.inject import inject_lora
    from pipetrainer.training.adapters.problems import adapter_target_problems
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe

    path = quant_fixtures.write_per_layer(fixture_paths.mmdit, tmp_path / "mmdit-per-layer.safetensors")
    patcher = load_model(ModelRecipe("diffusion_model", str(path), "default"), "fp32")
    assert adapter_target_problems(patcher.model, LoraSpec(adapter="lora")) == []
    for kind in ("lokr", "loha"):
        (problem,) = adapter_target_problems(patcher.model, LoraSpec(adapter=kind))
        assert f"'{kind}'" in problem and "per-layer-quantized" in problem and "joint_blocks." in problem
    family = adapter_for("SD3")
    lora = LoraSpec(adapter="lokr", rank=4, targets="attention")
    layers = list(enumerate(family.stage_layers(patcher.model.diffusion_model), start=1))
    with pytest.raises(ValueError, match="per-layer-quantized"):
        inject_lora(layers, family.lora_target_regex(lora.targets), lora, seed=0)


@pytest.mark.slow
def test_a_lokr_run_trains_and_saves_a_bf16_file_comfyui_loads(fixture_paths, comfy_root, demo_cache, tmp_path, caplog):
    """LoKr through the real training process tree (3 steps, bf16 file): the loss is finite, the file
    is LoKr in bf16 with the run's metadata, its zero factor has moved, and ComfyUI maps every key."""
    import math

    import comfy.lora
    import comfy.sd
    from pipetrainer.tests.helpers import losses, make_spec, run_training
    from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec
    from safetensors import safe_open
    from safetensors.torch import load_file

    lora = LoraSpec(rank=4, alpha=4.0, targets="attention", adapter="lokr", factor=4, save_dtype="bf16")
    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=3, lora=lora,
                     optimizer=OptimizerSpec(lr=1e-2, weight_decay=0.0))
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] == "error"]
    assert len(losses(events)) == 3 and all(math.isfinite(v) for v in losses(events))
    tensors = load_file(spec.lora_output)
    with safe_open(spec.lora_output, "pt") as f:
        meta = f.metadata()
    assert (meta["adapter"], meta["save_dtype"]) == ("lokr", "bf16")
    assert {t.dtype for k, t in tensors.items() if not k.endswith(".alpha")} == {torch.bfloat16}
    w1 = [t for k, t in tensors.items() if k.endswith(".lokr_w1")]
    assert w1 and any(bool(t.any()) for t in w1)  # the zero-initialised factor trained
    model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    with caplog.at_level("WARNING"):
        comfy.lora.load_lora(tensors, comfy.lora.model_lora_keys_unet(model.model, {}))
    assert "lora key not loaded" not in caplog.text


GGUF_PATH = os.environ.get("COMFYUI_GGUF_PATH", "")


@pytest.mark.skipif(not GGUF_PATH or not Path(GGUF_PATH, "ops.py").is_file(),
                    reason="set COMFYUI_GGUF_PATH to a checkout of github:city96/ComfyUI-GGUF")
@pytest.mark.parametrize("adapter", ["lokr", "loha"])
def test_lokr_and_loha_on_a_gguf_base_apply_in_comfyui_gguf_as_trained(adapter, fixture_paths, tmp_path):
    """ComfyUI-GGUF's Linears are nn.Linear subclasses holding Q8_0 blocks: PEFT's LoKr/LoHa wrap them
    (the delta weight takes the layer's logical shape), and ComfyUI-GGUF's patcher applies the file at
    dequantization. fp32 compute; bound on max|diff| / max|output|: 1e-4."""
    import comfy.sd
    from pipetrainer.devkit import quant_fixtures
    from pipetrainer.tests.quant_helpers import model_inputs, random_batch, run_layers, with_lora
    from pipetrainer.training.adapters.inject import freeze_all_but_lora
    from pipetrainer.training.adapters.lora_file import stage_lora_tensors
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.pipelines.base import Batch
    from pipetrainer.training.quant.gguf import gguf_module
    from pipetrainer.training.spec.options import LoraSpec, ModelRecipe

    path = quant_fixtures.write_gguf(fixture_paths.mmdit, tmp_path / "mmdit-Q8_0.gguf", "Q8_0",
                                     original=tmp_path / "mmdit-original.safetensors")

    def load():
        return load_model(ModelRecipe("gguf", str(path), extension_path=GGUF_PATH), "fp32")

    lora = LoraSpec(rank=4, alpha=2.0, targets="all_linear", adapter=adapter, save_dtype="fp32")
    ours = load()
    family, layers, stage = with_lora(ours, lora)
    freeze_all_but_lora(stage)
    _randomise(stage, seed=7)
    tensors = stage_lora_tensors(stage, {i: layer.comfy_paths for i, layer in layers}, lora)
    batch = random_batch(1)
    noisy, timestep, cond, pooled = model_inputs(ours.model, *batch)
    with torch.no_grad():
        got = run_layers(layers, family.first_stage_inputs(Batch(noisy, timestep, cond, pooled,
                                                                 options=family.options_type()))).float()
    theirs = gguf_module(GGUF_PATH, "nodes").GGUFModelPatcher.clone(load())
    dm = theirs.model.diffusion_model
    noisy, timestep, cond, pooled = model_inputs(theirs.model, *batch)
    with torch.no_grad():
        plain = dm(noisy, timestep, context=cond, y=pooled).float()
        patched, _ = comfy.sd.load_lora_for_models(theirs, None, tensors, 1.0, 0)
        patched.patch_model()
        try:
            reference = dm(noisy, timestep, context=cond, y=pooled).float()
        finally:
            patched.unpatch_model()
    scale = reference.abs().max().item()
    diff, effect = (got - reference).abs().max().item() / scale, (reference - plain).abs().max().item() / scale
    assert diff <= 1e-4 and effect > 100 * diff, (diff, effect)  # measured ~3e-7 and 0.01-0.03
