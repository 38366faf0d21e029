"""AuraFlow: ComfyUI's own AuraFlow config class at dim 32 (detection pins dim 3072: about 340 M parameters a
double block), in memory. The layout keeps what AuraFlow's data flow needs: double blocks, then single blocks
over the joined sequence (1 + 2, so a 2-stage split falls inside the single blocks), 8 register tokens, and a
positional table (``max_seq`` 16: 4 x 4 patches) that the 9 x 5 latent (5 x 3 patches) makes ComfyUI
interpolate bilinearly; the odd sides exercise its padding and crop."""

from __future__ import annotations

from . import Row
from .common import from_config

AURA_CONTEXT = 24  # Pile-T5-XL's 2048 in the real model


def auraflow_small(seed: int = 11):
    """0.17 M parameters (the 256-wide MLPs are the least ComfyUI's ``find_multiple`` allows)."""
    import comfy.supported_models

    unet = {"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 32, "n_layers": 3, "n_double_layers": 1,
            "n_heads": 2, "global_conddim": 32, "cond_seq_dim": AURA_CONTEXT, "max_seq": 16}
    return from_config(comfy.supported_models.AuraFlow, unet, seed=seed)


ROWS = [
    Row("AuraFlow", "ComfyUI's AuraFlow config class, dim 32 (detection pins 3072), in memory",
        load=lambda comfy_root, fixture_paths: auraflow_small(), latent=(4, 9, 5), tokens=5),
]
