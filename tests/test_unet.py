"""The LDM UNet stage layers every UNet family shares (training/pipelines/unet.py), across stage boundaries.

Two layouts: SDXL (a ``y`` vector into the label embedding; ``context`` leaves the tuple before the
last output blocks, which have no transformer) and SD 1.5 (no ``y``; ``context`` goes to the last
block). Both run on the tiny in-memory rows of tests/family_rows/ (ComfyUI's detection pins both
families at full size, so no detected file is small enough for the process-tree test of the family
table): every cut of the layer list sends distinct tensors the rest uses, and two training steps through
DeepSpeed's pipeline engine on real gloo ranks train alike in 1 and 2 stages.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.sd1_sd2 import ROWS as SD_ROWS
from pipetrainer.tests.family_rows.sdxl import ROWS as SDXL_ROWS

ROWS = {row.name: row for row in (*SDXL_ROWS, *SD_ROWS) if row.name in ("SDXL", "SD15")}
THIS = "pipetrainer.tests.test_unet"


def _batch(row, model, g: torch.Generator):
    """A seeded ``(Batch, target)`` of the row's shapes at sigma index 300, noised as the trainer noises."""
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    adapter = adapter_for(row.family)
    context, pooled_dim = adapter.conditioning_dims(model.diffusion_model)
    ms = model.model_sampling
    x0 = model.process_latent_in(torch.randn(1, *row.latent, generator=g))
    noised = noisy_input_and_target(ms, x0, torch.randn(x0.shape, generator=g), ms.sigmas[[300]].float())
    cond = torch.randn(1, row.tokens, context, generator=g)
    pooled = torch.randn(1, pooled_dim, generator=g) if pooled_dim else None
    batch = Batch(noised.network_input, noised.timestep, cond, pooled, extras=row.extras(model, x0, g))
    return batch, noised.target


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_stage_boundary_sends_distinct_tensors_that_the_rest_uses(name, comfy_root):
    """Cut the layer list anywhere: no tensor appears twice in the tuple (a boundary would send it twice),
    and every float tensor of the tuple gets a gradient from the layers after the cut (the engine's rule:
    a received tensor the receiver does not use leaves its gradient undefined)."""
    from pipetrainer.training.pipelines.base import adapter_for

    row = ROWS[name]
    model = row.load(comfy_root, None).model
    adapter = adapter_for(row.family)
    layers = adapter.stage_layers(model.diffusion_model)
    batch, _ = _batch(row, model, torch.Generator().manual_seed(4))
    out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in adapter.first_stage_inputs(batch))
    for cut in range(len(layers) + 1):
        if cut:
            with torch.no_grad():
                out = layers[cut - 1](out)
        if cut == len(layers):
            break
        assert len({id(t) for t in out}) == len(out), cut
        sent = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in out)
        rest = sent
        for layer in layers[cut:]:
            rest = layer(rest)
        floats = [t for t in sent if t.is_floating_point()]
        grads = torch.autograd.grad(rest.square().mean(), floats, allow_unused=True)
        assert all(gr is not None for gr in grads), (cut, [gr is None for gr in grads])


def _two_steps(row, world: int) -> dict:
    """2 steps of one row through DeepSpeed's pipeline engine in ``world`` stages (uniform split): the engine's
    own first layer, contiguity hook, LoRA injection and stage engine."""
    from deepspeed.pipe import PipelineModule
    from pipetrainer.patches.deepspeed_stage_engine import build_stage_engine
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.loop.engine import _contiguous_outputs, _inputs_need_grad
    from pipetrainer.training.objective.loss import mse_loss
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import LoraSpec

    model = row.load(None, None).model
    adapter = adapter_for(row.family)
    layers = adapter.stage_layers(model.diffusion_model)
    for layer in layers:
        layer.register_forward_hook(_contiguous_outputs)
    module = PipelineModule(layers=[_inputs_need_grad, *layers], num_stages=world, loss_fn=mse_loss,
                            partition_method="uniform", dynamic_shape=True)
    local = [(int(name), layer) for name, layer in module.named_children() if name.isdigit()]
    inject_lora(local, adapter.lora_target_regex("attention_mlp"), LoraSpec(rank=4, alpha=4.0), seed=0)
    params = freeze_all_but_lora(module)
    # SGD: Adam would blow fp32 rounding on near-zero gradients up to whole steps of size lr
    engine = build_stage_engine(module, torch.optim.SGD(params, lr=0.1), None, params, {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
        "steps_per_print": 10**9, "gradient_clipping": 0.0})

    def batches():
        g = torch.Generator().manual_seed(0)
        while True:
            batch, target = _batch(row, model, g)
            yield adapter.first_stage_inputs(batch), target

    data = batches()
    losses = [float(engine.train_batch(data)) for _ in range(2)]
    lora = {name: p.detach().double().sum().item() for name, p in module.named_parameters() if p.requires_grad}
    return {"losses": losses, "lora": lora}


def two_training_steps(rank: int, world: int) -> dict:
    """On a gloo rank: :func:`_two_steps` of every row, one after the other in the same ranks (one start-up)."""
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
def test_two_steps_in_one_and_two_stages_train_alike(comfy_root, tmp_path):
    """The skip stack (and SD 1.5's context, to the last block) crosses a real DeepSpeed stage boundary (gloo, the
    engine's pieces): the losses and the trained LoRA of a 2-stage run equal the 1-stage run's (the LoRA to
    rounding)."""
    from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks

    (ones,) = run_on_gloo_ranks(f"{THIS}:two_training_steps", tmp_path, world=1, collective_timeout_s=120)
    twos = run_on_gloo_ranks(f"{THIS}:two_training_steps", tmp_path, world=2, collective_timeout_s=120)
    assert set(ones) == set(ROWS)
    for name, one in ones.items():
        two = [twos[0][name], twos[1][name]]
        assert len(one["losses"]) == 2 and one["losses"] != [0.0, 0.0] and one["losses"][0] != one["losses"][1], name
        assert two[0]["losses"] == two[1]["losses"], name  # the last stage's loss, broadcast to every stage
        merged = {**two[0]["lora"], **two[1]["lora"]}
        assert set(two[0]["lora"]) and set(two[1]["lora"]) and not set(two[0]["lora"]) & set(two[1]["lora"]), name
        # The first step's loss is bitwise the same (same weights, same forward). The LoRA after the steps, and so the
        # second loss, is not bitwise: a skip tensor feeds the next input block and, maybe on another stage, its
        # output block, so its gradient is summed in another order when the stages split (fp32 rounding, ~1e-7).
        assert two[0]["losses"][0] == one["losses"][0], name
        assert abs(two[0]["losses"][1] - one["losses"][1]) <= 1e-6 * abs(one["losses"][1]), name
        assert merged.keys() == one["lora"].keys(), name
        assert all(abs(merged[k] - v) <= 1e-5 * max(1.0, abs(v)) for k, v in one["lora"].items()), name
