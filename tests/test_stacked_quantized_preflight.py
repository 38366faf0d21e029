"""LoRAs stacked on a scaled-fp8, per-layer-quantized or GGUF base are refused by the Train node's
preflight (before any process starts), with the fix, and by the training process's loader alike.

Fast tier, in this process: the tiny MMDiT written in each format (devkit/quant_fixtures.py), loaded by
ComfyUI's own loader, a LoRA stacked on it by ComfyUI's own ``load_lora_for_models`` (what
LoraLoaderModelOnly runs), then the Train node's ``train_problems``. The GGUF case needs ComfyUI-GGUF
for a real MODEL (tests/test_quantized_gguf.py); here its rule is checked on the pure function.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.devkit import quant_fixtures
from pipetrainer.training.model.fingerprint import file_fingerprint
from pipetrainer.training.model.model_source import load_model
from pipetrainer.training.quant.formats import WeightFormat
from pipetrainer.training.quant.stacking import GGUF, recipe_base_kind, stacked_lora_problem
from pipetrainer.training.spec.options import LoraSpec, ModelRecipe, TrainSpec

QKV = "diffusion_model.joint_blocks.1.x_block.attn.qkv"
FIX = "remove the LoRA loaders between the model loader and Train LoRA"
WRITERS = {"plain": None, "fp8": quant_fixtures.write_fp8, "scaled_fp8": quant_fixtures.write_scaled_fp8,
           "per_layer": quant_fixtures.write_per_layer}
REFUSED = {"plain": False, "fp8": False, "scaled_fp8": True, "per_layer": True}


@pytest.fixture(scope="module")
def files(fixture_paths, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stacked-quant")
    return {name: (write(fixture_paths.mmdit, folder / f"mmdit-{name}.safetensors") if write else fixture_paths.mmdit)
            for name, write in WRITERS.items()}


def _lora(rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"{QKV}.lora_up.weight": torch.randn(768, rank, generator=g) * 0.1,
            f"{QKV}.lora_down.weight": torch.randn(rank, 256, generator=g) * 0.1, f"{QKV}.alpha": torch.tensor(2.0)}


def _graph_model(path, stacked: int):
    """The MODEL a graph hands Train LoRA: ComfyUI's loader + recipe, ``stacked`` LoraLoaderModelOnly on top."""
    import comfy.sd
    from pipetrainer.nodes.model_source import attach_recipe

    model = comfy.sd.load_diffusion_model(str(path))
    attach_recipe(model, ModelRecipe("diffusion_model", str(path), "default", file_fingerprint(str(path))))
    for _ in range(stacked):
        model, _clip = comfy.sd.load_lora_for_models(model, None, _lora(), 0.8, 0)
    return model


def test_the_rule_names_the_kind_and_the_fix():
    for kind, what in ((WeightFormat.SCALED_FP8.value, "scaled fp8"), (WeightFormat.PER_LAYER.value, "per-layer"),
                       (GGUF, "GGUF")):
        message = stacked_lora_problem(kind, 2)
        assert message is not None and what in message and FIX in message and "2 LoRAs" in message
        assert stacked_lora_problem(kind, 0) is None
    for kind in (WeightFormat.PLAIN.value, WeightFormat.FP8.value):
        assert stacked_lora_problem(kind, 3) is None
    assert recipe_base_kind("gguf", "/nowhere/model.gguf") == GGUF
    assert recipe_base_kind("diffusion_model", "/nowhere/gone.safetensors") == WeightFormat.PLAIN.value


@pytest.mark.parametrize("name", list(WRITERS))
def test_preflight_refuses_stacked_loras_on_scaled_bases_only(files, demo_cache, tmp_path, name):
    from pipetrainer.nodes.checks.preflight import train_problems

    assert recipe_base_kind("diffusion_model", str(files[name])) == (name if name != "plain" else "plain")
    stacked = _graph_model(files[name], stacked=1)
    assert stacked.patches  # ComfyUI's LoRA loader did patch the MODEL
    problems = train_problems(stacked, demo_cache, LoraSpec(rank=4), TrainSpec(steps=2), str(tmp_path))
    refusals = [p for p in problems if FIX in p]
    assert len(refusals) == int(REFUSED[name]), problems
    bare = train_problems(_graph_model(files[name], stacked=0), demo_cache, LoraSpec(rank=4), TrainSpec(steps=2),
                          str(tmp_path))
    assert not [p for p in bare if FIX in p], bare


@pytest.mark.parametrize("name", ["scaled_fp8", "per_layer"])
def test_the_training_loader_refuses_with_the_same_message(files, name):
    recipe = ModelRecipe("diffusion_model", str(files[name]), loras=(("stacked.safetensors", 1.0),))
    with pytest.raises(ValueError) as info:
        load_model(recipe, "bf16")
    assert str(info.value) == stacked_lora_problem(name, 1)
