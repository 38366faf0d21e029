"""Flux.2: ComfyUI's Flux2 config class at hidden 64 (0.3.75 detection pins 48 heads), in memory.

Flux.2's layout (shared modulation, 4 rotary axes, SiLU-gated MLPs, no biases, patch size 1, no
pooled vector) in the tiny sizes; two reference latents exercise ComfyUI's ``index`` placement
(``ref_index_scale`` 10). The cond has 512 tokens, the length ComfyUI's ``Flux2.extra_conds`` pads
every shorter cond to (the generic oracle hands ``apply_model`` the cond as is); the padding itself is
checked against ``extra_conds`` in tests/test_flux2.py.
"""

from __future__ import annotations

import torch

from . import Row
from .common import from_config

REFERENCE_SHAPES = ((8, 6, 4), (8, 3, 5))


def flux2_small(guidance_embed: bool = True):
    import comfy.supported_models
    from pipetrainer.devkit.fixtures import flux_params

    unet = {"image_model": "flux2", **flux_params(
        in_channels=8, out_channels=8, vec_in_dim=None, context_in_dim=16, hidden_size=64, mlp_ratio=3.0,
        num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 8, 8, 8], theta=2000, patch_size=1,
        qkv_bias=False, guidance_embed=guidance_embed, global_modulation=True, mlp_silu_act=True, ops_bias=False,
        default_ref_method="index", ref_index_scale=10.0)}
    from comfy.ldm.flux.model import FluxParams

    if "txt_ids_dims" in FluxParams.__dataclass_fields__:  # current ComfyUI names the text rotary axis
        unet["txt_ids_dims"] = [3]
    return from_config(comfy.supported_models.Flux2, unet, seed=1)  # a seed whose LoRA gradients are not tiny (finite-difference check)


def _extras(model, x0, g):
    raw = [torch.randn(1, *shape, generator=g) for shape in REFERENCE_SHAPES]
    return {f"reference_{i}": model.process_latent_in(r) for i, r in enumerate(raw)}


def _kwargs(cond, pooled, options, extras):
    refs = [extras[f"reference_{i}"] for i in range(len(extras))]
    return {"guidance": torch.full((cond.shape[0],), options.guidance), "ref_latents": refs}


ROWS = [
    Row("Flux2", "ComfyUI's Flux2 config class, hidden 64, 2 reference latents, in memory",
        load=lambda comfy_root, fixture_paths: flux2_small(), latent=(8, 7, 5), tokens=512, comfy_kwargs=_kwargs,
        extras=_extras),
]
