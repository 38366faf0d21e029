"""Every in-memory family row across real stage boundaries (the rows of tests/family_rows/ without a detected
file: ComfyUI's detection pins those families at full size, so the process-tree test of tests/test_families.py
cannot take them).

- Cut the layer list anywhere: no tensor appears twice in the tuple (a boundary would send it twice), and the
  rest of the model uses every tensor sent (a gradient reaches each floating one that is not empty).
- Two training steps through DeepSpeed's pipeline engine (the trainer's first layer, contiguity hook, LoRA
  injection, stage engine and single backward per stage) on real gloo ranks give the same losses and LoRA in 1
  and 2 stages, bitwise in fp32 (a row's ``stage_split``). Without the single backward (patches/
  deepspeed_pipe_backward.py) every row whose stage-1 LoRA feeds two sent tensors (skips, two streams, a shared
  ``vec``) differs by fp32 rounding after one step.

A new family's rows join both checks by existing; all selected rows train in one start-up per world size.
A row whose family this ComfyUI lacks skips with the reason its ``load`` gives.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows import all_rows
from pipetrainer.tests.family_rows.common import joined_streams

ROWS = {row.name: row for row in all_rows() if row.model_path is None}
SPLIT = sorted(name for name, row in ROWS.items() if not row.stage_split.startswith("as "))
THIS = "pipetrainer.tests.test_stage_split"


def _batch(row, model, g: torch.Generator):
    """A seeded ``(Batch, target)`` of the row's shapes at sigma index 300, noised as the trainer noises."""
    from pipetrainer.training.objective.loss import noisy_input_and_target
    from pipetrainer.training.pipelines.base import Batch, adapter_for

    adapter = adapter_for(row.family)
    context, pooled_dim = adapter.conditioning_dims(model.diffusion_model)
    ms = model.model_sampling
    raw = torch.randn(1, *row.latent, generator=g)
    x0 = model.process_latent_in(raw)
    sigmas = getattr(ms, "sigmas", None)
    sigma = sigmas[[min(300, len(sigmas) - 1)]].float() if sigmas is not None else torch.tensor([0.7])
    noised = noisy_input_and_target(ms, x0, torch.randn(x0.shape, generator=g), sigma)
    cond = torch.randn(1, row.tokens, context, generator=g)
    pooled = torch.randn(1, pooled_dim, generator=g) if pooled_dim else None
    extras = row.extras(model, x0, g)
    x0, shapes = joined_streams(adapter, model, raw, x0, extras)
    if shapes:  # a model taking several latents as one (LTX-2): packed, noised as one
        noised = noisy_input_and_target(ms, x0, torch.randn(x0.shape, generator=g), sigma)
    batch = Batch(noised.network_input, noised.timestep, cond, pooled, extras=extras,
                  options=adapter.options_type(), latent_shapes=shapes)
    return batch, noised.target


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
        floats = [t for t in sent if t.is_floating_point() and t.numel()]  # an empty tensor carries nothing
        grads = torch.autograd.grad(rest.square().mean(), floats, allow_unused=True)
        assert all(gr is not None for gr in grads), (cut, [gr is None for gr in grads])


def train_steps(row, world: int, steps: int = 2) -> dict:
    """``steps`` steps (2 in the tests) of one row through DeepSpeed's pipeline engine in ``world`` stages
    (uniform split): the losses, each LoRA tensor's sum, each step's wall seconds (bench/family_steps.py)."""
    import time

    from deepspeed.pipe import PipelineModule
    from pipetrainer.devkit.host import comfyui_root
    from pipetrainer.patches.deepspeed_pipe_backward import use_single_backward
    from pipetrainer.patches.deepspeed_stage_engine import build_stage_engine
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.loop.engine import _contiguous_outputs, _inputs_need_grad
    from pipetrainer.training.objective.loss import mse_loss
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import LoraSpec

    model = row.load(comfyui_root(), None).model
    adapter = adapter_for(row.family)
    layers = adapter.stage_layers(model.diffusion_model)
    parameters = sum(p.numel() for p in model.diffusion_model.parameters())  # the base model's, before LoRA
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
    # as the trainer does (training/loop/engine.py): one backward over all of a stage's outputs. DeepSpeed's own
    # backward runs one pass per output, so a stage-1 weight that feeds several sent tensors gets X^T G1 + X^T G2
    # where one stage computes X^T (G1 + G2): fp32 rounding apart after the first step
    assert use_single_backward(engine)

    def batches():
        g = torch.Generator().manual_seed(0)
        while True:
            batch, target = _batch(row, model, g)
            yield adapter.first_stage_inputs(batch), target

    data = batches()
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(float(engine.train_batch(data)))
        seconds.append(time.perf_counter() - start)
    lora = {name: p.detach().double().sum().item() for name, p in module.named_parameters() if p.requires_grad}
    return {"losses": losses, "lora": lora, "seconds": seconds, "parameters": parameters}


def two_training_steps(rank: int, world: int) -> dict:
    """On a gloo rank: :func:`train_steps` of the rows named in ``PIPETRAINER_SPLIT_ROWS`` (and as many steps as
    ``PIPETRAINER_SPLIT_STEPS`` says, default 2), one after the other
    in the same ranks (one start-up); a row whose ``load`` skips (a family this ComfyUI lacks) gives its reason."""
    import os
    import traceback

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    from pipetrainer.devkit.host import comfyui_root
    from pipetrainer.patches.deepspeed_shm import disable_shm_comm_build
    from pipetrainer.training.model.comfy_env import enable_comfy_training_mode, use_comfyui

    use_comfyui(comfyui_root(), "cpu")
    enable_comfy_training_mode()
    disable_shm_comm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    results = {}
    steps = int(os.environ.get("PIPETRAINER_SPLIT_STEPS", "2"))
    for name in os.environ["PIPETRAINER_SPLIT_ROWS"].split(","):
        try:
            results[name] = train_steps(ROWS[name], world, steps)
        except pytest.skip.Exception as skipped:  # decided before any collective, alike on every rank
            results[name] = {"skipped": str(skipped)}
        except Exception:  # this row's test fails with it; a rank left in a collective times out and reports
            results[name] = {"error": traceback.format_exc()}  # too. The rows after it are not run: the ranks'
            break  # collectives may be out of step now
    return results


@pytest.fixture(scope="module")
def split_runs(request, tmp_path_factory, comfy_root):
    """``(1-stage result, [2-stage rank results])`` of every selected row, trained in one start-up each."""
    from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks

    selected = sorted({item.callspec.params["name"] for item in request.session.items
                       if item.module is request.module and item.originalname == "test_two_steps_split_as_declared"})
    tmp = tmp_path_factory.mktemp("split")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PIPETRAINER_SPLIT_ROWS", ",".join(selected))
        bounds = {"collective_timeout_s": 120.0, "run_timeout_s": 120.0 + 30.0 * len(selected)}
        (ones,) = run_on_gloo_ranks(f"{THIS}:two_training_steps", tmp, world=1, **bounds)
        twos = run_on_gloo_ranks(f"{THIS}:two_training_steps", tmp, world=2, **bounds)
    return ones, twos


@pytest.mark.slow
@pytest.mark.parametrize("name", SPLIT)
def test_two_steps_split_as_declared(name, split_runs):
    ones, twos = split_runs
    missing = [f"{world} stage(s)" for world, results in ((1, [ones]), (2, twos)) if any(name not in r for r in results)]
    assert not missing, f"{name} was not trained in {', '.join(missing)}: an earlier row failed (see its test)"
    one, two = ones[name], [twos[0][name], twos[1][name]]
    if "skipped" in one:
        pytest.skip(one["skipped"])
    errors = [result["error"] for result in (one, *two) if "error" in result]
    assert not errors, errors[0]
    assert len(one["losses"]) == 2 and one["losses"] != [0.0, 0.0] and one["losses"][0] != one["losses"][1]
    assert two[0]["losses"] == two[1]["losses"]  # the last stage's loss, broadcast to every stage
    assert set(two[0]["lora"]) and set(two[1]["lora"]) and not set(two[0]["lora"]) & set(two[1]["lora"])
    merged = {**two[0]["lora"], **two[1]["lora"]}
    assert merged.keys() == one["lora"].keys()
    assert two[0]["losses"][0] == one["losses"][0]  # same weights, same forward
    if ROWS[name].stage_split == "bitwise":
        assert two[0]["losses"] == one["losses"]
        assert merged == one["lora"]
    else:  # "alike": fp32 rounding (~1e-7) after the first step
        assert abs(two[0]["losses"][1] - one["losses"][1]) <= 1e-6 * abs(one["losses"][1])
        assert all(abs(merged[k] - v) <= 1e-5 * max(1.0, abs(v)) for k, v in one["lora"].items())
