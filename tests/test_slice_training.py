"""The slice's training contract on the tiny MMDiT: it learns, and ComfyUI reproduces what it trained."""

from __future__ import annotations

import statistics

import torch
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.training.spec.options import LoraSpec, OptimizerSpec, TimestepSpec
from safetensors.torch import load_file


def test_overfitting_one_image_lowers_the_loss(fixture_paths, comfy_root, demo_cache, tmp_path):
    one = demo_cache.items[:1] * 4
    spec = make_spec(fixture_paths.mmdit, one, tmp_path / "run", comfy_root, steps=60, seed=7,
                     optimizer=OptimizerSpec(lr=1e-2, weight_decay=0.0), timesteps=TimestepSpec(shift="none"),
                     lora=LoraSpec(rank=16, alpha=16.0, targets="all_linear"))
    code, events = run_training(spec)
    assert code == 0, events
    curve = losses(events)
    assert len(curve) == 60 and all(map(torch.isfinite, torch.tensor(curve)))
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-10:])
    assert last < 0.85 * first, (first, last, curve)
    saved = load_file(spec.lora_output)
    assert saved and all(k.startswith("diffusion_model.joint_blocks.") for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("lora_B.weight"))


def _trainer_forward_and_lora(patcher, inputs, seed: int):
    """Stage layers with injected PEFT LoRA (nonzero B), run in sequence like a 1-stage pipeline."""
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora, named_lora_parameters
    from pipetrainer.training.adapters.lora_file import lora_state_dict
    from pipetrainer.training.loop.engine import _inputs_need_grad
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import LoraSpec

    adapter = adapter_for("SD3")
    layers = adapter.stage_layers(patcher.model.diffusion_model)
    indexed = [(i + 1, layer) for i, layer in enumerate(layers)]
    spec = LoraSpec(rank=4, alpha=3.0, targets="all_linear")
    assert inject_lora(indexed, adapter.lora_target_regex(spec.targets), spec, seed) > 0
    holder = torch.nn.ModuleDict({str(i): layer for i, layer in indexed})
    freeze_all_but_lora(holder)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_lora_parameters(holder).items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x = _inputs_need_grad(inputs)
    with torch.no_grad():
        for _, layer in indexed:
            x = layer(x)
    paths = {i: layer.comfy_paths for i, layer in indexed}
    return x, lora_state_dict(named_lora_parameters(holder), paths, spec.alpha)


def test_comfy_lora_loader_reproduces_the_trainer_forward(fixture_paths, demo_cache, caplog):
    """fp32: max abs difference <= 1e-4 (relative ~1e-5) between PEFT's forward and ComfyUI's merged LoRA."""
    import comfy.lora
    import comfy.sd
    from pipetrainer.training.data.micro_batches import load_examples
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    trainer_model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    comfy_model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    base = trainer_model.model
    example = load_examples(demo_cache.items[:1])[0]
    x0 = base.process_latent_in(example.latent[None].float())
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.5])
    noisy, timestep, _ = noisy_input_and_target(base.model_sampling, x0, noise, sigma)
    inputs = adapter_for("SD3").first_stage_inputs(Batch(noisy, timestep, example.cond[None], example.pooled[None]))
    trained_out, lora_sd = _trainer_forward_and_lora(trainer_model, inputs, seed=5)

    key_map = comfy.lora.model_lora_keys_unet(comfy_model.model, {})
    with caplog.at_level("WARNING"):
        loaded = comfy.lora.load_lora(lora_sd, key_map)
    assert "lora key not loaded" not in caplog.text
    assert len(loaded) == len(lora_sd) // 3  # every module's A, B and alpha consumed
    patched, _ = comfy.sd.load_lora_for_models(comfy_model, None, lora_sd, 1.0, 0)
    patched.patch_model()
    try:
        with torch.no_grad():
            denoised = patched.model.apply_model(noisy, sigma, c_crossattn=example.cond[None], y=example.pooled[None])
    finally:
        patched.unpatch_model()
    comfy_out = (noisy - denoised) / sigma.view(-1, 1, 1, 1)  # flow models: denoised = x - sigma * v
    assert trained_out.shape == comfy_out.shape
    max_diff = (trained_out - comfy_out).abs().max().item()
    assert max_diff <= 1e-4, max_diff
    with torch.no_grad():
        base_out = (noisy - comfy_model.model.apply_model(noisy, sigma, c_crossattn=example.cond[None],
                                                          y=example.pooled[None])) / 0.5
    assert (base_out - comfy_out).abs().max().item() > 100 * max_diff  # the LoRA really changed the output
