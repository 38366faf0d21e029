"""Chroma beyond the generic family checks (tests/test_families.py, row ``Chroma``).

- A micro-batch of captions of different lengths: the zero tokens the shorter caption gets are
  masked out of the attention keys, so each example's output equals ComfyUI's ``apply_model`` on that
  example alone with its own, unpadded cond (what sampling computes); without the mask it would not.
- Full size: ComfyUI's detection on a shapes-only (meta) state dict of the real Chroma layout
  (8.9 B parameters, never materialised) gives model_base.Chroma, which the family accepts;
  Chroma Radiance (pixel space) is detected as its subclass and refused by name.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.chroma import chroma_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for

CHROMA_FULL = dict(in_channels=64, out_channels=64, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
                   depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
                   in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5)


def _params(cls, **params) -> dict:
    """``params`` plus the fields current ComfyUI's Chroma dataclasses require (absent on 0.3.75)."""
    fields = cls.__dataclass_fields__
    return {**{k: v for k, v in (("txt_ids_dims", []), ("vec_in_dim", None)) if k in fields}, **params}


def detected_on_meta(network: torch.nn.Module):
    """ComfyUI's detection of ``network``'s state dict (shapes only) and its model_base built on meta."""
    import comfy.model_detection

    state = network.state_dict()
    config = comfy.model_detection.model_config_from_unet(state, "")
    assert config is not None, "ComfyUI did not detect the state dict"
    config.set_inference_dtype(torch.bfloat16, None)
    return config, config.get_model(state, "", device=torch.device("meta"))


def test_captions_of_different_lengths_train_as_if_sampled_alone(comfy_root):
    from pipetrainer.training.data.micro_batches import stack_text
    from pipetrainer.training.objective.loss import noisy_input_and_target

    model = chroma_small().model
    adapter = adapter_for("Chroma")
    g = torch.Generator().manual_seed(4)
    x0 = model.process_latent_in(torch.randn(2, 4, 6, 5, generator=g))
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    conds = [torch.randn(7, 8, generator=g), torch.randn(3, 8, generator=g)]
    cond = stack_text(conds, adapter.text_length([len(c) for c in conds]))
    noised = noisy_input_and_target(model.model_sampling, x0, noise, sigma)
    with torch.no_grad():
        out = tuple(adapter.first_stage_inputs(Batch(noised.network_input, noised.timestep, cond, None)))
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        noisy = model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
        ours = model.model_sampling.calculate_denoised(sigma, out, noisy)
        for i, c in enumerate(conds):
            alone = model.apply_model(noisy[i:i + 1], sigma[i:i + 1], c_crossattn=c[None], guidance=torch.zeros(1))
            assert torch.allclose(ours[i:i + 1], alone, rtol=0, atol=1e-5 * alone.abs().max().item())
        padded = model.apply_model(noisy[1:], sigma[1:], c_crossattn=cond[1:], guidance=torch.zeros(1))
        assert (padded - ours[1:]).abs().max() > 1e-3 * padded.abs().max()  # the mask matters


def test_full_size_chroma_is_detected_and_accepted_on_shapes_only(comfy_root):
    from comfy.ldm.chroma.model import Chroma, ChromaParams
    from pipetrainer.training.pipelines import checks

    with torch.device("meta"):
        network = Chroma(operations=torch.nn, **_params(ChromaParams, **CHROMA_FULL))
    config, model = detected_on_meta(network)
    assert type(model).__name__ == "Chroma" and family_name_for(model) == "Chroma"
    dm = model.diffusion_model
    adapter = adapter_for("Chroma")
    assert checks.model_support_problems(model) == []
    assert adapter.conditioning_dims(dm) == (4096, 0)
    assert len(adapter.stage_layers(dm)) == 19 + 38 + 2
    assert checks.block_layout(model) == [False, False, *[True] * 57, False]
    # rank 16 over the blocks' attention: 19 double blocks x 2 streams x (qkv + proj), 38 singles x (linear1 + linear2)
    expected = 16 * (19 * 2 * ((3072 + 9216) + (3072 + 3072)) + 38 * ((3072 + 21504) + (15360 + 3072)))
    assert checks.lora_parameter_count(model, 16, "attention") == expected
    assert sum(p.numel() for p in dm.parameters()) > 8.5e9


def test_chroma_radiance_is_refused_by_name(comfy_root):
    import comfy.ldm.chroma_radiance.model as radiance
    from pipetrainer.training.pipelines import checks

    params = radiance.ChromaRadianceParams.__dataclass_fields__
    full = {**CHROMA_FULL, "in_channels": 3, "out_channels": 3, "patch_size": 16, "nerf_hidden_size": 64,
            "nerf_mlp_ratio": 4, "nerf_depth": 4, "nerf_max_freqs": 8, "nerf_tile_size": 512,
            "nerf_final_head_type": "linear", "nerf_embedder_dtype": torch.float32,
            "use_x0": False, "use_sequential_txt_ids": False}  # the last two: current ComfyUI only
    full = {k: v for k, v in full.items() if k in params}
    with torch.device("meta"):
        network = radiance.ChromaRadiance(operations=torch.nn, **_params(radiance.ChromaRadianceParams, **full))
    _, model = detected_on_meta(network)
    assert type(model).__name__ == "ChromaRadiance" and family_name_for(model) == "Chroma"
    problems = checks.model_support_problems(model)
    assert len(problems) == 1 and "Chroma Radiance" in problems[0]
    with pytest.raises(NotImplementedError, match="Chroma Radiance"):
        adapter_for("Chroma").stage_layers(model.diffusion_model)
