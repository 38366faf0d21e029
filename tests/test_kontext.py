"""FLUX.1 Kontext: the Flux family with reference images, beyond the generic checks (row ``FluxKontext``).

Fast tier (ComfyUI's Flux config class at hidden 64, in memory):
- every placement method ComfyUI's Flux knows for ``ref_latents`` (``offset``, Kontext's default;
  ``index``, Flux.2's; ``uxo``) gives the output of ComfyUI's forward called with that method, for
  references of other sizes than the target, in a batch of 2;
- the prediction covers the target only, and the references change it;
- references are optional, latent-processed extras named ``reference_<i>``, numbered without gaps.
Slow tier: the smallest detectable Flux (a FLUX.1 file, 535 M) trains with a reference per item in the
real process tree, and the references reach the model (the first loss differs from a run without them).
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.flux import flux_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, reference_extra
from pipetrainer.training.pipelines.flux import FluxOptions, references_of

OPTIONS = FluxOptions(guidance=3.5)


def _inputs(g: torch.Generator, batch: int = 2):
    x = torch.randn(batch, 4, 7, 5, generator=g)
    t = torch.rand(batch, generator=g)
    context = torch.randn(batch, 5, 8, generator=g)
    y = torch.randn(batch, 8, generator=g)
    refs = [torch.randn(batch, 4, *hw, generator=g) for hw in ((6, 8), (9, 3), (4, 4))]
    return x, t, context, y, refs


def _staged(dm, x, t, context, y, refs):
    adapter = adapter_for("Flux")
    extras = {reference_extra(i): r for i, r in enumerate(refs)}
    out = tuple(adapter.first_stage_inputs(Batch(x, t, context, y, extras=extras, options=OPTIONS)))
    for layer in adapter.stage_layers(dm):
        out = layer(out)
    return out


@pytest.mark.parametrize("method", ["offset", "index", "uxo"])
def test_reference_placement_equals_comfyuis_forward(comfy_root, method):
    dm = flux_small().model.diffusion_model
    x, t, context, y, refs = _inputs(torch.Generator().manual_seed(1))
    dm.params.default_ref_method = method  # what the model says; ComfyUI is told the method explicitly
    guidance = torch.full((2,), OPTIONS.guidance)
    with torch.no_grad():
        ours = _staged(dm, x, t, context, y, refs)
        theirs = dm(x, t, context, y=y, guidance=guidance, ref_latents=refs, ref_latents_method=method)
        without = dm(x, t, context, y=y, guidance=guidance)
    assert ours.shape == x.shape
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), (ours - theirs).abs().max()
    assert (theirs - without).abs().max() > 1e-3 * theirs.abs().max()  # the references act


def test_a_placement_comfyui_adds_later_is_refused_by_name(comfy_root):
    dm = flux_small().model.diffusion_model
    dm.params.default_ref_method = "index_timestep_zero"  # current ComfyUI: references at timestep 0
    x, t, context, y, refs = _inputs(torch.Generator().manual_seed(2), batch=1)
    with pytest.raises(NotImplementedError, match="index_timestep_zero"):
        _staged(dm, x, t, context, y, refs[:1])


def test_references_are_optional_latent_extras_numbered_without_gaps(comfy_root):
    dm = flux_small().model.diffusion_model
    specs = adapter_for("Flux").extras(dm)
    assert list(specs) == [reference_extra(i) for i in range(len(specs))] and len(specs) >= 2
    assert all(s.is_latent and not s.required and s.source == "latent" and s.shape == ("C", "*", "*") for s in specs.values())
    a, b = torch.zeros(1), torch.ones(1)
    assert references_of({"reference_1": b, "reference_0": a, "other": b}) == [a, b]
    with pytest.raises(ValueError, match="without gaps"):
        references_of({"reference_0": a, "reference_2": b})
