"""Continuing from an existing LoRA file (``init_lora``) for every adapter type, on the tiny MMDiT.

A randomised adapter (every factor non-zero) is saved by the engine's own save function, a fresh model
is injected from that file, and then: every factor holds the file's exact values (fp32, or a bf16 file's
values widened; LoKr with both factors whole: the file's ``lokr_w1`` with alpha / rank divided back out),
re-saving gives the file again, and ComfyUI's own loader applying the file gives the trainer's forward
(tolerance as tests/test_adapters.py). A file without ``.alpha`` keys (as other trainers write them)
continues at alpha = rank, the scale ComfyUI applies it at. The error cases name the key, the file and what
to set.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pipetrainer.tests.test_adapters import (
    TOLERANCE,
    _comfy_applied,
    _comfy_velocity,
    _inputs,
    _randomise,
    _stage,
    _trainer_velocity,
    comfy_mmdit,  # noqa: F401  (the shared fixture)
)

CASES = {  # id: LoraSpec fields (whole LoKr: rank 64 >= half each factor; alpha / rank = 0.375 is not a power of 2)
    "lora": dict(adapter="lora", rank=4, alpha=3.0),
    "lokr-split": dict(adapter="lokr", rank=4, alpha=3.0),
    "lokr-whole": dict(adapter="lokr", rank=64, alpha=24.0),
    "loha": dict(adapter="loha", rank=4, alpha=3.0),
}


def _save(fixture_paths, path, lora, seed=7, also=()):
    """A randomised adapter of ``lora`` saved as the engine saves it; returns the file's tensors. ``also``:
    ``(path, lora)`` of a second save of the same adapter (another dtype)."""
    from pipetrainer.training.adapters.inject import freeze_all_but_lora
    from pipetrainer.training.adapters.lora_file import atomic_save, stage_lora_tensors
    from safetensors.torch import load_file

    _, _, indexed, stage = _stage(fixture_paths, lora)
    freeze_all_but_lora(stage)
    _randomise(stage, seed=seed)
    paths = {i: layer.comfy_paths for i, layer in indexed}
    for target, spec in ((path, lora), *([also] if also else [])):
        atomic_save(stage_lora_tensors(stage, paths, spec), target, {"adapter": spec.adapter})
    return load_file(path)


def _continued(lora, path):
    from pipetrainer.training.adapters.init_lora import file_digest

    return dataclasses.replace(lora, init_lora=str(path), init_lora_digest=file_digest(path))


def _assert_holds_the_file(stage, paths, lora, file, whole):
    """Every factor is the file's value as fp32 (whole LoKr ``w1``: alpha / rank divided out), and a re-save in
    the file's dtype gives the file back."""
    from pipetrainer.training.adapters.inject import named_lora_parameters
    from pipetrainer.training.adapters.keys import comfy_key_for
    from pipetrainer.training.adapters.kinds import split_adapter_name
    from pipetrainer.training.adapters.lora_file import stage_lora_tensors

    params = named_lora_parameters(stage)
    assert len(params) == len([k for k in file if not k.endswith(".alpha")])
    for name, param in params.items():
        module_key, suffix = comfy_key_for(name, paths, lora.adapter)
        value = file[f"{module_key}.{suffix}"].to(torch.float32)
        assert param.dtype == torch.float32
        if whole and split_adapter_name(name)[1] == "lokr_w1":
            assert torch.equal(param, value / (lora.alpha / lora.rank)), name  # the folded scale, divided back out
        else:
            assert torch.equal(param, value), name
    resaved = stage_lora_tensors(stage, paths, lora)
    assert set(resaved) == set(file)
    for key, value in file.items():
        if whole and key.endswith(".lokr_w1") and value.dtype == torch.float32:
            assert torch.allclose(resaved[key], value, rtol=2e-7, atol=0), key  # (x / s) * s: within an ulp
        else:
            assert torch.equal(resaved[key], value), key


@pytest.mark.parametrize("case", list(CASES))
def test_training_starts_from_the_files_exact_weights(case, fixture_paths, comfy_mmdit, caplog, tmp_path):  # noqa: F811
    """bf16 file: injected from it, checked, and ComfyUI's forward with it; then the fp32 file loaded into the
    same adapters by the same function (one model build per file dtype would double the test's time)."""
    from pipetrainer.training.adapters.init_lora import load_init_values, read_init_file
    from pipetrainer.training.adapters.inject import freeze_all_but_lora
    from pipetrainer.training.spec.options import LoraSpec
    from safetensors.torch import load_file

    lora = LoraSpec(targets="attention_mlp", save_dtype="bf16", **CASES[case])
    bf16_path, fp32_path = tmp_path / "bf16.safetensors", tmp_path / "fp32.safetensors"
    bf16 = _save(fixture_paths, bf16_path, lora, also=(fp32_path, dataclasses.replace(lora, save_dtype="fp32")))
    whole = case == "lokr-whole"
    assert any(k.endswith(".lokr_w2") for k in bf16) if whole else True
    assert not any(k.endswith(".alpha") for k in bf16) if whole else any(k.endswith(".alpha") for k in bf16)

    patcher, adapter, indexed, stage = _stage(fixture_paths, _continued(lora, bf16_path), seed=99)  # seed: no matter
    freeze_all_but_lora(stage)
    paths = {i: layer.comfy_paths for i, layer in indexed}
    _assert_holds_the_file(stage, paths, lora, bf16, whole)

    inputs = _inputs(patcher, adapter)
    noisy, cond, pooled, sigma, batch = inputs
    trained = _trainer_velocity(indexed, adapter, batch)
    applied = _comfy_applied(comfy_mmdit, dict(bf16), inputs, caplog)
    base = _comfy_velocity(comfy_mmdit, noisy, cond, pooled, sigma)
    max_diff = (trained - applied).abs().max().item()
    assert max_diff <= TOLERANCE, max_diff
    assert (base - applied).abs().max().item() > 100 * max(max_diff, 1e-6)  # the file really acts

    fp32 = read_init_file(fp32_path)
    fp32_lora = dataclasses.replace(lora, save_dtype="fp32")
    assert load_init_values(indexed, fp32, fp32_lora) == len([k for k in bf16 if not k.endswith(".alpha")])
    _assert_holds_the_file(stage, paths, fp32_lora, load_file(fp32_path), whole)


@pytest.fixture(scope="module")
def lora_file(fixture_paths, tmp_path_factory):
    """One randomised LoRA (rank 4, alpha 3, attention) of the tiny MMDiT, and its spec."""
    from pipetrainer.training.spec.options import LoraSpec

    lora = LoraSpec(rank=4, alpha=3.0, targets="attention", save_dtype="fp32")
    path = tmp_path_factory.mktemp("init") / "base.safetensors"
    return lora, path, _save(fixture_paths, path, lora)


def _problems(model, lora, path):
    from pipetrainer.training.adapters.problems import adapter_target_problems

    return "\n".join(adapter_target_problems(model, _continued(lora, path)))


def _write(path, tensors):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_a_file_for_another_model_or_other_settings_is_a_preflight_error(lora_file, comfy_mmdit, tmp_path):  # noqa: F811
    lora, path, file = lora_file
    model = comfy_mmdit.model
    assert _problems(model, lora, path) == ""

    # Keys of a module this model does not have (a LoRA for another model): named, with the file.
    foreign = dict(file)
    for key in [k for k in file if ".joint_blocks.0.x_block.attn.qkv." in k]:
        foreign[key.replace("joint_blocks.0.", "joint_blocks.9.")] = foreign.pop(key)
    text = _problems(model, lora, _write(tmp_path / "other.safetensors", foreign))
    assert "diffusion_model.joint_blocks.9.x_block.attn.qkv" in text and "another model" in text
    assert str(tmp_path / "other.safetensors") in text
    assert "no weights for 1 " in text and "joint_blocks.0.x_block.attn.qkv" in text

    # Keys in another format (kohya / ComfyUI native trainer names) and of a text encoder.
    odd = {**file, "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(2, 2)}
    text = _problems(model, lora, _write(tmp_path / "odd.safetensors", odd))
    assert "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight" in text and "format" in text

    # Other settings: each error says which value to set.
    assert "set rank to 4" in _problems(model, dataclasses.replace(lora, rank=8), path)
    assert "set alpha to 3" in _problems(model, dataclasses.replace(lora, alpha=4.0), path)
    assert "set adapter to 'lora'" in _problems(model, dataclasses.replace(lora, adapter="loha"), path)
    wider = _problems(model, dataclasses.replace(lora, targets="attention_mlp"), path)
    assert "has no weights for" in wider and "targets preset" in wider
    narrower = _problems(model, dataclasses.replace(lora, blocks="0-1"), path)
    assert "outside targets" in narrower and "joint_blocks.2." in narrower


def test_a_file_without_alpha_keys_continues_at_the_strength_comfyui_applies_it(
        lora_file, fixture_paths, comfy_mmdit, caplog, tmp_path):  # noqa: F811
    """A LoRA file without ``.alpha`` keys (other trainers write none): ComfyUI applies ``B @ A`` at scale 1,
    i.e. alpha = rank. The file's rank is 4; the LoRA Adapter's alpha 3 would train it at 3/4 of the strength
    ComfyUI gives it, so both checks (preflight and the training process's) refuse it and name alpha 4 (a
    check that took the node's alpha for the file's finds nothing wrong: this fails). At alpha 4 every
    module's effective update (PEFT's alpha / rank times ``B @ A``) is the update ComfyUI's own loader computes
    for the file, and the trainer's forward is ComfyUI's forward with the file."""
    import comfy.lora
    from pipetrainer.training.adapters.init_lora import InitLoraError, check_init_lora, read_init_file
    from pipetrainer.training.adapters.inject import freeze_all_but_lora
    from pipetrainer.training.adapters.keys import comfy_key_for
    from pipetrainer.training.pipelines.base import adapter_for

    lora, _, file = lora_file
    bare = {k: v for k, v in file.items() if not k.endswith(".alpha")}
    assert len(bare) < len(file)  # the saved file had alpha keys: they are gone
    path = _write(tmp_path / "no-alpha.safetensors", bare)
    assert lora.rank == 4 and lora.alpha != lora.rank  # the node's alpha is not the file's (rank)
    model = comfy_mmdit.model
    refused = _problems(model, lora, path)
    assert "has alpha 4," in refused and "set alpha to 4" in refused and str(path) in refused, refused
    regex = adapter_for("SD3").lora_target_regex(lora.targets)
    with pytest.raises(InitLoraError, match="set alpha to 4"):
        check_init_lora(read_init_file(path), _continued(lora, path), model.diffusion_model, regex)

    at_rank = dataclasses.replace(lora, alpha=float(lora.rank))
    assert _problems(model, at_rank, path) == ""
    patcher, adapter, indexed, stage = _stage(fixture_paths, _continued(at_rank, path), seed=99)
    freeze_all_but_lora(stage)
    paths = {i: layer.comfy_paths for i, layer in indexed}
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    patches = comfy.lora.load_lora(bare, key_map)  # ComfyUI's loader: alpha None, scale 1.0
    modules = [(n, m) for n, m in stage.named_modules() if "default" in getattr(m, "lora_A", {})]
    assert len(modules) == len(patches) == len(bare) // 2
    for name, module in modules:
        module_key, _ = comfy_key_for(f"{name}.lora_A.default.weight", paths, "lora")
        weight = module.base_layer.weight
        comfy_delta = patches[f"{module_key}.weight"].calculate_weight(
            torch.zeros(weight.shape), f"{module_key}.weight", 1.0, 1.0, None, lambda w: w)
        product = module.lora_B["default"].weight @ module.lora_A["default"].weight
        trained_delta = module.scaling["default"] * product
        assert torch.allclose(trained_delta, comfy_delta, rtol=1e-6, atol=1e-7), module_key
        # The oracle can tell: the node's alpha 3 would give 3/4 of ComfyUI's update.
        assert not torch.allclose(lora.alpha / lora.rank * product, comfy_delta, rtol=1e-3, atol=1e-5)

    inputs = _inputs(patcher, adapter)
    noisy, cond, pooled, sigma, batch = inputs
    trained = _trainer_velocity(indexed, adapter, batch)
    applied = _comfy_applied(comfy_mmdit, dict(bare), inputs, caplog)
    base = _comfy_velocity(comfy_mmdit, noisy, cond, pooled, sigma)
    max_diff = (trained - applied).abs().max().item()
    assert max_diff <= TOLERANCE, max_diff
    assert (base - applied).abs().max().item() > 100 * max(max_diff, 1e-6)  # the file really acts


def test_a_wrong_shape_names_the_key_the_file_and_the_expected_shape(lora_file, fixture_paths, tmp_path):
    from pipetrainer.training.adapters.init_lora import InitLoraError

    lora, _, file = lora_file
    bad = dict(file)
    key = sorted(k for k in file if k.endswith(".lora_B.weight"))[0]
    out, rank = bad[key].shape
    bad[key] = torch.zeros(out + 3, rank)  # same rank, another width: another model's module
    path = _write(tmp_path / "shape.safetensors", bad)
    with pytest.raises(InitLoraError) as info:
        _stage(fixture_paths, _continued(lora, path))
    text = str(info.value)
    assert key in text and str(path) in text and f"[{out + 3}, {rank}]" in text and f"expected [{out}, {rank}]" in text


def test_a_lokr_file_with_another_layout_names_the_rank_to_set(fixture_paths, tmp_path):
    """A whole-factor LoKr file (rank 64) under rank 4 (PEFT decomposes w2 there): the layouts differ."""
    from pipetrainer.training.adapters.init_lora import InitLoraError
    from pipetrainer.training.spec.options import LoraSpec

    whole = LoraSpec(adapter="lokr", rank=64, alpha=24.0, targets="attention", save_dtype="bf16")
    path = tmp_path / "whole.safetensors"
    _save(fixture_paths, path, whole)
    with pytest.raises(InitLoraError) as info:
        _stage(fixture_paths, _continued(dataclasses.replace(whole, rank=4, alpha=3.0), path))
    assert "lokr_w2" in str(info.value) and "rank 4" in str(info.value) and str(path) in str(info.value)


def test_the_files_digest_is_checked_and_is_part_of_the_training_hash(lora_file, comfy_mmdit, tmp_path):  # noqa: F811
    from pipetrainer.tests.test_adapters import _run_spec
    from pipetrainer.training.adapters.init_lora import InitLoraError, check_init_lora, read_init_file
    from pipetrainer.training.pipelines.base import adapter_for

    lora, path, file = lora_file
    copy = _write(tmp_path / "copy.safetensors", file)
    a, b = _continued(lora, path), _continued(lora, copy)
    spec = _run_spec(tmp_path, a)
    assert dataclasses.replace(spec, lora=dataclasses.replace(b, init_lora=a.init_lora)).training_hash() == \
        spec.training_hash() or a.init_lora_digest != b.init_lora_digest
    moved = dataclasses.replace(spec, lora=dataclasses.replace(a, init_lora="/elsewhere/x.safetensors"))
    assert moved.training_hash() == spec.training_hash()  # the path is not hashed, the content is
    other = dataclasses.replace(spec, lora=dataclasses.replace(a, init_lora_digest="0" * 64))
    assert other.training_hash() != spec.training_hash()
    fresh = dataclasses.replace(spec, lora=lora)
    assert fresh.training_hash() != spec.training_hash()

    dm = comfy_mmdit.model.diffusion_model
    regex = adapter_for("SD3").lora_target_regex(lora.targets)
    check_init_lora(read_init_file(path), a, dm, regex)
    with pytest.raises(InitLoraError, match="changed since the graph was queued"):
        check_init_lora(read_init_file(path), dataclasses.replace(a, init_lora_digest="0" * 64), dm, regex)


def test_the_lora_adapter_node_offers_the_loras_folder_and_records_the_digest(comfy_root, lora_file):
    import shutil

    import folder_paths
    from pipetrainer.nodes.lora_adapter import PipeTrainerLoRA, _init_lora_options
    from pipetrainer.training.adapters.init_lora import file_digest

    lora, path, _ = lora_file
    folder = folder_paths.get_folder_paths("loras")[0]
    name = "pipetrainer-test-init.safetensors"
    target = shutil.copyfile(path, f"{folder}/{name}")
    try:
        folder_paths.filename_list_cache.pop("loras", None)
        assert _init_lora_options()[0] == "none" and name in _init_lora_options()
        out = PipeTrainerLoRA.execute(4, 3.0, 0.0, "attention", init_lora=name).args[0]
        assert out.init_lora == target and out.init_lora_digest == file_digest(path)
        assert PipeTrainerLoRA.execute(4, 3.0, 0.0, "attention").args[0].init_lora == ""
        assert PipeTrainerLoRA.fingerprint_inputs(init_lora=name)[0] == target
    finally:
        import os

        os.unlink(target)


@pytest.mark.slow
def test_a_real_run_continues_from_the_file(fixture_paths, demo_cache, comfy_root, tmp_path):
    """Two AdamW steps in the real process tree from a randomised file on blocks 1-3: the saved LoRA has exactly
    the file's keys (block 0 got no adapter) and is the file moved by at most two Adam steps (each moves a
    weight by <= lr, weight decay 0), not a fresh adapter (Kaiming A, zero B)."""
    from pipetrainer.tests.helpers import make_spec, run_training
    from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec
    from safetensors.torch import load_file

    lora = LoraSpec(rank=4, alpha=3.0, targets="attention", save_dtype="fp32", blocks="1-3")
    path = tmp_path / "start.safetensors"
    start = {k: v for k, v in _save(fixture_paths, path, lora).items() if ".joint_blocks.0." not in k}
    _write(path, start)  # the file of a run on blocks 1-3 (block 0 never had an adapter)
    lr = 1e-3
    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=2,
                     lora=_continued(lora, path), optimizer=OptimizerSpec(lr=lr, weight_decay=0.0))
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] == "error"]
    saved = load_file(spec.lora_output)
    assert set(saved) == set(start)
    moved = max((saved[k] - start[k]).abs().max().item() for k in start if not k.endswith(".alpha"))
    assert 0 < moved <= 2 * lr * (1 + 1e-3), moved
