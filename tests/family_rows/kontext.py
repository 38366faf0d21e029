"""FLUX.1 Kontext: the Flux family with reference images (``reference_0``, ``reference_1`` extras).

Same model as the Flux row (Kontext is a FLUX.1 dev network; ComfyUI builds it with the same config
class), but every example carries two reference latents of other sizes than the target, so the
generic checks compare the staged forward with ComfyUI's ``apply_model(..., ref_latents=[...])``:
the reference tokens' rotary placement (ComfyUI's default ``offset`` method) and the cut back to the
target's tokens.
"""

from __future__ import annotations

import torch

from . import Row
from .flux import flux_small

REFERENCE_SHAPES = ((4, 6, 8), (4, 5, 5))  # raw latent shapes: wider, then smaller than the 7x5 target


def _extras(model, x0, g):
    raw = [torch.randn(1, *shape, generator=g) for shape in REFERENCE_SHAPES]
    return {f"reference_{i}": model.process_latent_in(r) for i, r in enumerate(raw)}


def _kwargs(cond, pooled, options, extras):
    refs = [extras[f"reference_{i}"] for i in range(len(extras))]
    return {"y": pooled, "guidance": torch.full((cond.shape[0],), options.guidance), "ref_latents": refs}


ROWS = [
    Row("Flux", "ComfyUI's Flux config class, hidden 64, with two reference latents (Kontext), in memory",
        load=lambda comfy_root, fixture_paths: flux_small(), latent=(4, 7, 5), tokens=5, comfy_kwargs=_kwargs,
        extras=_extras, id="FluxKontext"),
]
