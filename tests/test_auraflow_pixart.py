"""AuraFlow and PixArt beyond the generic family checks (tests/test_families.py, rows ``AuraFlow``, ``PixArtSigma``,
``PixArtAlpha``), across real stage boundaries.

ComfyUI's detection pins both at full size (AuraFlow dim 3072, PixArt hidden 1152), so no detected file is small
enough for the family table's process-tree test; as for the UNet families (tests/test_unet.py), the tiny in-memory
rows run here: every cut of the layer list sends distinct tensors that the rest uses (AuraFlow's text stream joins
the image stream, PixArt's caption and ``t0`` leave the tuple at the last block while ``t`` goes on to the final
layer), and two training steps through DeepSpeed's pipeline engine on real gloo ranks are bitwise the same in 1 and
2 stages (fp32; no tensor's gradient is summed across a boundary, unlike the UNet's skips).
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.auraflow import ROWS as AURA_ROWS
from pipetrainer.tests.family_rows.pixart import ROWS as PIXART_ROWS
from pipetrainer.tests.test_unet import _batch, _two_steps

ROWS = {row.name: row for row in (*AURA_ROWS, *PIXART_ROWS)}
THIS = "pipetrainer.tests.test_auraflow_pixart"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_stage_boundary_sends_distinct_tensors_that_the_rest_uses(name, comfy_root):
    from pipetrainer.training.pipelines.base import adapter_for

    row = ROWS[name]
    model = row.load(comfy_root, None).model
    adapter = adapter_for(row.family)
    layers = adapter.stage_layers(model.diffusion_model)
    batch, _ = _batch(row, model, torch.Generator().manual_seed(4))
    out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in adapter.first_stage_inputs(batch))
    for cut in range(len(layers)):
        if cut:
            with torch.no_grad():
                out = layers[cut - 1](out)
        assert len({id(t) for t in out}) == len(out), cut
        sent = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in out)
        rest = sent
        for layer in layers[cut:]:
            rest = layer(rest)
        floats = [t for t in sent if t.is_floating_point()]
        grads = torch.autograd.grad(rest.square().mean(), floats, allow_unused=True)
        assert all(gr is not None for gr in grads), (cut, [gr is None for gr in grads])


def two_training_steps(rank: int, world: int) -> dict:
    """On a gloo rank: 2 steps of every row in ``world`` stages, one after the other in the same ranks."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    from pipetrainer.devkit.host import comfyui_root
    from pipetrainer.patches.deepspeed_shm import disable_shm_comm_build
    from pipetrainer.training.model.comfy_env import enable_comfy_training_mode, use_comfyui

    use_comfyui(comfyui_root(), "cpu")
    enable_comfy_training_mode()
    disable_shm_comm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return {name: _two_steps(row, world) for name, row in sorted(ROWS.items())}


@pytest.mark.slow
def test_two_steps_in_one_and_two_stages_are_bitwise_equal(comfy_root, tmp_path):
    from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks

    (ones,) = run_on_gloo_ranks(f"{THIS}:two_training_steps", tmp_path, world=1, collective_timeout_s=120)
    twos = run_on_gloo_ranks(f"{THIS}:two_training_steps", tmp_path, world=2, collective_timeout_s=120)
    assert set(ones) == set(ROWS)
    for name, one in ones.items():
        two = [twos[0][name], twos[1][name]]
        assert len(one["losses"]) == 2 and one["losses"][0] != one["losses"][1], name
        assert two[0]["losses"] == two[1]["losses"] == one["losses"], name
        assert set(two[0]["lora"]) and set(two[1]["lora"]) and not set(two[0]["lora"]) & set(two[1]["lora"]), name
        assert {**two[0]["lora"], **two[1]["lora"]} == one["lora"], name
