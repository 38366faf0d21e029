"""LoRAs stacked on the Train node's MODEL are replayed in the training process, merged before training."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pipetrainer.nodes.checks.stacked_loras import UnsupportedStackedPatch, write_stacked_loras
from pipetrainer.training.model.fingerprint import file_fingerprint
from pipetrainer.training.model.model_source import load_model
from pipetrainer.training.spec.options import ModelRecipe

QKV = "diffusion_model.joint_blocks.1.x_block.attn.qkv"


def _random_lora(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{QKV}.lora_up.weight": torch.randn(768, rank, generator=g) * 0.1,
            f"{QKV}.lora_down.weight": torch.randn(rank, 256, generator=g) * 0.1,
            f"{QKV}.alpha": torch.tensor(2.0)}


def test_two_stacked_loras_are_replayed_exactly(fixture_paths, tmp_path):
    import comfy.sd

    path = str(fixture_paths.mmdit)
    recipe = ModelRecipe("diffusion_model", path, "default", file_fingerprint(path))
    model = comfy.sd.load_diffusion_model(path)
    model, _ = comfy.sd.load_lora_for_models(model, None, _random_lora(1), 0.7, 0)
    model, _ = comfy.sd.load_lora_for_models(model, None, _random_lora(2), -0.4, 0)
    replay = write_stacked_loras(model, recipe, tmp_path)
    assert len(replay.loras) == 2
    model.patch_model()
    expected = model.model.state_dict()[f"{QKV}.weight"].clone()
    model.unpatch_model()
    rebuilt = load_model(replay)
    got = rebuilt.model.state_dict()[f"{QKV}.weight"]
    assert not rebuilt.patches
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, model.model.state_dict()[f"{QKV}.weight"])


def test_same_stack_gives_same_file_names_for_resume(fixture_paths, tmp_path):
    import comfy.sd

    path = str(fixture_paths.mmdit)
    recipe = ModelRecipe("diffusion_model", path, "default", file_fingerprint(path))
    model, _ = comfy.sd.load_lora_for_models(comfy.sd.load_diffusion_model(path), None, _random_lora(3), 1.0, 0)
    a = write_stacked_loras(model, recipe, tmp_path / "a")
    b = write_stacked_loras(model, recipe, tmp_path / "b")
    assert [p.rsplit("/", 1)[1] for p, _ in a.loras] == [p.rsplit("/", 1)[1] for p, _ in b.loras]
    assert dataclasses.replace(a, loras=()) == recipe  # only the LoRA list is added to the recipe


def test_patches_that_are_not_plain_loras_are_refused(fixture_paths, tmp_path):
    import comfy.sd

    path = str(fixture_paths.mmdit)
    recipe = ModelRecipe("diffusion_model", path, "default", file_fingerprint(path))
    model = comfy.sd.load_diffusion_model(path)
    model.add_patches({f"{QKV}.weight": ("diff", (torch.zeros(768, 256),))}, 1.0)
    with pytest.raises(UnsupportedStackedPatch, match="(?i)merge it into the model file"):
        write_stacked_loras(model, recipe, tmp_path)
