"""Optimizers, schedules, LoRA+, weight-decay groups and the EMA (training/optim/optimizers.py).

Fast tier, in this process: every optimizer lowers the tiny MMDiT's loss through its stage layers
against a control on the same seeded batches at a learning rate of ~0; each schedule's curve equals
torch's own schedulers built here; the groups say which weights decay and which learn faster; the
EMA follows its recurrence; schedule-free weights are saved averaged and trained on unchanged; the
Optimizer node reports every bad combination in one message; Prodigy on two gloo ranks (stages that
split the parameters, replicas that hold them all) estimates the step size of one process holding them
all. Slow tier: for every optimizer, a real run resumed from its step-2 checkpoint continues bit for
bit; a 2-stage Prodigy pipeline steps like the 1-stage one and resumes bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.training.optim.optimizers import REGISTRY, build_stage_optimizer, ema_path, missing_package_problem
from pipetrainer.training.spec.choices import OPTIMIZERS, SpecError
from pipetrainer.training.spec.options import CacheItem, LoraSpec, ModelRecipe, OptimizerSpec
from safetensors.torch import load_file, save_file
from torch.optim import lr_scheduler as torch_lr

# (learning rate, steps) per optimizer for the loss test; Prodigy starts from a tiny step-size estimate
# (d0 = 1e-6) and needs more steps before it moves. Measured (held-out loss / the control's): AdamW 0.915,
# AdamW8bit 0.915, Adafactor 0.89, Prodigy 0.92, Lion 0.91, CAME 0.92, AdamWScheduleFree 0.89.
TRAINING = {
    "AdamW": (3e-2, 8), "AdamW8bit": (3e-2, 8), "Adafactor": (1e-2, 8), "Prodigy": (1.0, 30),
    "Lion": (1e-2, 8), "CAME": (1e-2, 8), "AdamWScheduleFree": (3e-2, 8),
}
LORA = LoraSpec(rank=4, alpha=4.0, targets="all_linear")


def test_every_spec_optimizer_is_registered_and_installed():
    assert set(REGISTRY) == set(OPTIMIZERS) == set(TRAINING)
    assert all(missing_package_problem(name) is None for name in OPTIMIZERS)


# ---- the loss falls, in this process ------------------------------------------------------------


def _stage(fixture_paths):
    """The tiny MMDiT's stage layers (fp32) with PEFT LoRA, as the engine builds one stage."""
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.pipelines.base import adapter_for

    patcher = load_model(ModelRecipe("diffusion_model", str(fixture_paths.mmdit), "default"), "fp32")
    adapter = adapter_for("SD3")
    layers = list(enumerate(adapter.stage_layers(patcher.model.diffusion_model), start=1))
    assert inject_lora(layers, adapter.lora_target_regex(LORA.targets), LORA, seed=0) > 0
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in layers})
    freeze_all_but_lora(stage)
    return patcher.model, adapter, layers, stage


def _trainable(stage) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in stage.named_parameters() if p.requires_grad]


def _losses(fixture_paths, spec: OptimizerSpec, steps: int) -> tuple[list[float], float]:
    """``steps`` optimizer steps on one image (batch 2), each with its own seeded noise and sigmas; then
    the loss on four held-out noise draws at fixed sigmas (0.2 to 0.9). Returns (step losses, held-out)."""
    from pipetrainer.training.loop.engine import _inputs_need_grad
    from pipetrainer.training.objective.loss import mse_loss
    from pipetrainer.training.pipelines.base import Batch

    model, adapter, layers, stage = _stage(fixture_paths)
    built = build_stage_optimizer(spec, _trainable(stage), steps)
    g = torch.Generator().manual_seed(0)
    x0, cond, pooled = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 8, 768, generator=g), torch.randn(2, 768, generator=g)
    sampling = model.model_sampling
    values = []
    for _ in range(steps):
        noise, sigma = torch.randn(2, 16, 8, 8, generator=g), torch.rand(2, generator=g) * 0.8 + 0.1
        noisy = sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
        batch = Batch(noisy, sampling.timestep(sigma).float(), cond, pooled, options=adapter.options_type())
        out = _inputs_need_grad(adapter.first_stage_inputs(batch))
        for _, layer in layers:
            out = layer(out)
        loss = mse_loss(out, noise - x0)
        loss.backward()
        built.optimizer.step()
        built.scheduler.step()
        built.optimizer.zero_grad(set_to_none=True)
        values.append(loss.item())
    g = torch.Generator().manual_seed(1)
    held_out = 0.0
    with torch.no_grad():
        for k in range(4):
            noise, sigma = torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.2 + 0.2 * k, 0.3 + 0.2 * k])
            noisy = sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
            out = adapter.first_stage_inputs(Batch(noisy, sampling.timestep(sigma).float(), cond, pooled,
                                                   options=adapter.options_type()))
            for _, layer in layers:
                out = layer(out)
            held_out += mse_loss(out, noise - x0).item()
    return values, held_out


@pytest.fixture(scope="module")
def control(fixture_paths):
    """The same seeded batches at a learning rate of ~0: the loss without learning."""
    return _losses(fixture_paths, OptimizerSpec(lr=1e-12, weight_decay=0.0), 8)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_lowers_the_loss_against_an_untrained_control(fixture_paths, control, name):
    lr, steps = TRAINING[name]
    values, held_out = _losses(fixture_paths, OptimizerSpec(name=name, lr=lr, weight_decay=0.0), steps)
    control_values, control_held_out = control
    assert all(math.isfinite(v) for v in values), values
    assert values[0] == pytest.approx(control_values[0], rel=1e-5)  # B = 0: the first step is the base model's
    assert held_out < 0.95 * control_held_out, (name, held_out / control_held_out, values)


# ---- schedules: torch's own schedulers as the oracle --------------------------------------------

BASE, TOTAL = 0.01, 20


def _oracle_cases():
    """(spec, oracle built from torch's schedulers on an optimizer whose rate is BASE, checkpoints)."""
    return {
        "constant": (OptimizerSpec(lr=BASE), lambda o: torch_lr.ConstantLR(o, factor=1.0, total_iters=0),
                     {0: BASE, 19: BASE}),
        "constant+warmup": (
            OptimizerSpec(lr=BASE, warmup_steps=4),
            lambda o: torch_lr.SequentialLR(o, [torch_lr.LinearLR(o, 0.25, 1.0, total_iters=3),
                                                torch_lr.ConstantLR(o, factor=1.0, total_iters=0)], milestones=[4]),
            {0: BASE / 4, 1: BASE / 2, 3: BASE, 4: BASE, 19: BASE}),
        "linear+min": (OptimizerSpec(lr=BASE, schedule="linear", min_lr_ratio=0.1),
                       lambda o: torch_lr.LinearLR(o, 1.0, 0.1, total_iters=20),
                       {0: BASE, 10: BASE * (1 - 0.9 * 10 / 20)}),
        "linear+warmup": (
            OptimizerSpec(lr=BASE, schedule="linear", warmup_steps=5),
            lambda o: torch_lr.SequentialLR(o, [torch_lr.LinearLR(o, 0.2, 1.0, total_iters=4),
                                                torch_lr.LinearLR(o, 1.0, 0.0, total_iters=15)], milestones=[5]),
            {0: BASE / 5, 4: BASE, 5: BASE, 19: BASE / 15}),
        "cosine": (OptimizerSpec(lr=BASE, schedule="cosine"), lambda o: torch_lr.CosineAnnealingLR(o, T_max=20),
                   {k: BASE * 0.5 * (1 + math.cos(math.pi * k / 20)) for k in (0, 7, 19)}),
        "cosine+warmup+min": (
            OptimizerSpec(lr=BASE, schedule="cosine", warmup_steps=3, min_lr_ratio=0.1),
            lambda o: torch_lr.SequentialLR(o, [torch_lr.LinearLR(o, 1 / 3, 1.0, total_iters=2),
                                                torch_lr.CosineAnnealingLR(o, T_max=17, eta_min=0.1 * BASE)],
                                            milestones=[3]),
            {0: BASE / 3, 2: BASE, 3: BASE, 12: BASE * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 17)))}),
        "cosine_with_restarts": (
            OptimizerSpec(lr=BASE, schedule="cosine_with_restarts", warmup_steps=2, cycles=3, min_lr_ratio=0.05),
            lambda o: torch_lr.SequentialLR(o, [torch_lr.LinearLR(o, 0.5, 1.0, total_iters=1),
                                                torch_lr.CosineAnnealingWarmRestarts(o, T_0=6, eta_min=0.05 * BASE)],
                                            milestones=[2]),
            {0: BASE / 2, 2: BASE, 8: BASE, 14: BASE, 13: BASE * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * 5 / 6)))}),
    }


def _curve(optimizer, scheduler, steps: int) -> list[list[float]]:
    """Each group's rate at each step (read before the step, as the step uses it)."""
    out = []
    for _ in range(steps):
        out.append([float(g["lr"]) for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("case", list(_oracle_cases()))
def test_each_schedule_is_torch_s_own_curve_warm_up_included(case):
    spec, oracle, points = _oracle_cases()[case]
    spec = dataclasses.replace(spec, lora_plus_ratio=4.0)  # a second group: the floor is per group
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2, 2))
    built = build_stage_optimizer(spec, [("x.lora_A.default.weight", a), ("x.lora_B.default.weight", b)], TOTAL)
    ours = _curve(built.optimizer, built.scheduler, TOTAL)
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    expected = [lrs[0] for lrs in _curve(reference, oracle(reference), TOTAL)]
    assert [lrs[0] for lrs in ours] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert [lrs[1] for lrs in ours] == pytest.approx([4 * v for v in expected], rel=1e-9, abs=1e-15)
    for step, value in points.items():  # the oracle itself, against closed forms
        assert expected[step] == pytest.approx(value, rel=1e-9), (step, expected[step], value)


def test_a_resumed_schedule_continues_from_the_saved_step_on_its_own_curve():
    """LambdaLR keeps only the step in its state: the loaded scheduler goes on where it stopped."""
    spec = OptimizerSpec(lr=BASE, schedule="cosine", warmup_steps=3, min_lr_ratio=0.1)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    first = build_stage_optimizer(spec, [("w", p)], TOTAL)
    straight = _curve(first.optimizer, first.scheduler, TOTAL)
    head = build_stage_optimizer(spec, [("w", p)], TOTAL)
    _curve(head.optimizer, head.scheduler, 7)
    tail = build_stage_optimizer(spec, [("w", p)], TOTAL)
    tail.optimizer.load_state_dict(head.optimizer.state_dict())
    tail.scheduler.load_state_dict(head.scheduler.state_dict())
    assert _curve(tail.optimizer, tail.scheduler, TOTAL - 7) == straight[7:]


# ---- parameter groups ---------------------------------------------------------------------------


def _named_adapter_params():
    g = torch.Generator().manual_seed(0)
    return [
        ("1.attn.qkv.lora_A.default.weight", torch.nn.Parameter(torch.randn(4, 8, generator=g))),
        ("1.attn.qkv.lora_B.default.weight", torch.nn.Parameter(torch.randn(8, 4, generator=g))),
        ("1.attn.qkv.bias", torch.nn.Parameter(torch.randn(8, generator=g))),
        ("1.attn.qkv.lora_magnitude_vector.default.weight", torch.nn.Parameter(torch.randn(8, generator=g))),
    ]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_dimensional_weights_never_decay_and_lora_plus_speeds_up_b_only(name):
    named = _named_adapter_params()
    a, b, bias, magnitude = (p for _, p in named)
    lr = 1.0 if name == "Prodigy" else 1e-3
    plus = 0.0 if name == "Prodigy" else 16.0  # Prodigy takes one rate for all groups (the spec refuses LoRA+)
    built = build_stage_optimizer(OptimizerSpec(name=name, lr=lr, weight_decay=0.1, lora_plus_ratio=plus), named, 10)
    groups = {g["group"]: g for g in built.optimizer.param_groups}
    assert built.optimizer.param_groups[0]["group"] == "decay"  # the group whose rate the events report
    assert {id(p) for p in groups["no_decay"]["params"]} == {id(bias), id(magnitude)}
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert groups["decay"]["weight_decay"] == 0.1 and groups["decay"]["lr"] == pytest.approx(lr)
    if plus:
        assert [id(p) for p in groups["decay"]["params"]] == [id(a)]
        assert [id(p) for p in groups["lora_plus"]["params"]] == [id(b)]
        assert groups["lora_plus"]["lr"] == pytest.approx(16 * lr) and groups["lora_plus"]["weight_decay"] == 0.1
    else:
        assert [id(p) for p in groups["decay"]["params"]] == [id(a), id(b)] and "lora_plus" not in groups


def test_with_zero_gradients_only_the_matrices_decay():
    """AdamW's update is 0 for a zero gradient: what moves is decay alone, by lr × weight_decay."""
    named = _named_adapter_params()
    before = {n: p.detach().clone() for n, p in named}
    built = build_stage_optimizer(OptimizerSpec(lr=0.1, weight_decay=0.5), named, 10)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    built.optimizer.step()
    for n, p in named:
        expected = before[n] * (1 - 0.1 * 0.5) if p.ndim == 2 else before[n]
        assert torch.equal(p.detach(), expected), n


# ---- EMA and schedule-free weights ----------------------------------------------------------------


def _toy(seed: int = 0, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(width, width // 2)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(width // 2, width, generator=g))
        layer.bias.copy_(torch.randn(width // 2, generator=g))
    data = [(torch.randn(5, width, generator=g), torch.randn(5, width // 2, generator=g)) for _ in range(6)]
    return layer, [("w.lora_A.default.weight", layer.weight), ("w.bias", layer.bias)], data


def _step(layer, built, x, y):
    torch.nn.functional.mse_loss(layer(x), y).backward()
    built.optimizer.step()
    built.scheduler.step()
    built.optimizer.zero_grad(set_to_none=True)


def test_the_ema_follows_its_recurrence_and_leaves_the_training_weights_alone():
    """Oracle: e_1 = w_1, e_k = d·e_(k-1) + (1-d)·w_k over the weights after each step, computed here."""
    layer, named, data = _toy()
    built = build_stage_optimizer(OptimizerSpec(lr=0.05, weight_decay=0.0, ema_decay=0.8), named, 10)
    expected = None
    for x, y in data:
        _step(layer, built, x, y)
        weights = [p.detach().clone() for _, p in named]
        expected = weights if expected is None else [0.8 * e + 0.2 * w for e, w in zip(expected, weights, strict=True)]
    trained = [p.detach().clone() for _, p in named]
    with built.ema_weights():
        inside = [p.detach().clone() for _, p in named]
    for got, want in zip(inside, expected, strict=True):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(inside[0], trained[0])  # the average is not the last weights
    assert all(torch.equal(p.detach(), t) for (_, p), t in zip(named, trained, strict=True))


def test_schedule_free_saves_its_average_and_trains_on_unchanged():
    """Inside ``lora_weights``: what schedulefree's own eval() gives (on a copy). Afterwards, training goes
    on exactly as if nothing was saved (eval() then train() alone changes the last bits of ~0.5% of the
    weights: 2,080 of them here, so some)."""
    spec = OptimizerSpec(name="AdamWScheduleFree", lr=0.05, weight_decay=0.0, warmup_steps=2)
    layer, named, data = _toy(width=64)
    built = build_stage_optimizer(spec, named, 10)
    twin_layer, twin_named, _ = _toy(width=64)
    twin = build_stage_optimizer(spec, twin_named, 10)
    for x, y in data[:3]:
        _step(layer, built, x, y)
        _step(twin_layer, twin, x, y)
    oracle_params, oracle_opt = copy.deepcopy(([p for _, p in named], built.optimizer))
    oracle_opt.eval()
    round_trip, round_trip_opt = copy.deepcopy(([p for _, p in named], built.optimizer))
    round_trip_opt.eval()
    round_trip_opt.train()  # the test can fail: the optimizer's own round trip changes some bits
    assert not all(torch.equal(a, b) for a, b in zip(round_trip, [p for _, p in named], strict=True))
    with built.lora_weights():
        inside = [p.detach().clone() for _, p in named]
    assert all(torch.equal(got, want.detach()) for got, want in zip(inside, oracle_params, strict=True))
    assert not torch.equal(inside[0], twin_layer.weight.detach())  # the average differs from the training weights
    for x, y in data[3:]:
        _step(layer, built, x, y)
        _step(twin_layer, twin, x, y)
    assert all(torch.equal(p.detach(), q.detach()) for (_, p), (_, q) in zip(named, twin_named, strict=True))


def test_ema_file_sits_next_to_the_lora():
    assert ema_path("/m/loras/face.safetensors") == Path("/m/loras/face_ema.safetensors")


# ---- the Optimizer node ---------------------------------------------------------------------------


def _validate(**inputs):
    """True, or the node's problems as the one message ComfyUI lists once for the node."""
    from pipetrainer.nodes.node_problems import NodeProblems
    from pipetrainer.nodes.optimizer import PipeTrainerOptimizer

    try:
        return PipeTrainerOptimizer.validate_inputs(**inputs)
    except NodeProblems as problems:
        return str(problems)


def test_the_optimizer_node_reports_every_bad_combination_in_one_message(comfy_root):
    message = _validate(optimizer="AdamWScheduleFree", learning_rate=1e-3, schedule="cosine", min_lr_ratio=0.0,
                        cycles=3, lora_plus_ratio=0.5, ema_decay=0.999)
    for fragment in ("AdamWScheduleFree is schedule-free", "Set schedule to constant",
                     "already averages its weights", "set ema_decay to 0",
                     "cycles (3) applies only to schedule cosine_with_restarts",
                     "lora_plus_ratio must be 0 (off) or at least 1"):
        assert fragment in message, (fragment, message)
    message = _validate(optimizer="Prodigy", learning_rate=1e-4, schedule="constant", min_lr_ratio=0.1,
                        cycles=1, lora_plus_ratio=16.0, ema_decay=0.0)
    for fragment in ("Prodigy estimates its own step size and wants learning_rate 1.0 (got 0.0001)",
                     "LoRA+ cannot raise lora_B's", "min_lr_ratio (0.1) applies only to a decaying schedule"):
        assert fragment in message, (fragment, message)
    assert message.count("\n") == 2  # one line per problem, all in one message
    assert _validate(optimizer="Prodigy", learning_rate=1.0, schedule="cosine", min_lr_ratio=0.1, cycles=1,
                     lora_plus_ratio=0.0, ema_decay=0.999) is True
    assert _validate(optimizer="Lion", learning_rate=1e-4, schedule="cosine_with_restarts", min_lr_ratio=0.0,
                     cycles=4, lora_plus_ratio=16.0, ema_decay=0.0) is True
    assert "Optimizer 'SGD' is not one of" in _validate(optimizer="SGD", learning_rate=1e-4, schedule="constant")
    assert _validate(optimizer="Prodigy", learning_rate=None, schedule="constant") is True  # linked: execute checks


def test_the_optimizer_node_names_the_inputs_that_combine_and_refuses_at_execution(comfy_root):
    """The inputs that combine are all given to ``validate_inputs`` (ComfyUI leaves their range checks to it)."""
    import inspect

    from pipetrainer.nodes.optimizer import PipeTrainerOptimizer

    named = set(inspect.signature(PipeTrainerOptimizer.validate_inputs).parameters)
    assert {"optimizer", "learning_rate", "schedule", "min_lr_ratio", "cycles", "lora_plus_ratio", "ema_decay"} == named
    inputs = {i.id for i in PipeTrainerOptimizer.define_schema().inputs}
    assert named <= inputs
    with pytest.raises(SpecError, match="wants learning_rate 1.0"):
        PipeTrainerOptimizer.execute("Prodigy", 0.5, 0.0, 0, "constant")
    spec = PipeTrainerOptimizer.execute("Lion", 1e-4, 0.1, 10, "linear", 0.1, 1, 16.0, 0.99).result[0]
    assert spec == OptimizerSpec(name="Lion", lr=1e-4, weight_decay=0.1, warmup_steps=10, schedule="linear",
                                 min_lr_ratio=0.1, lora_plus_ratio=16.0, ema_decay=0.99)


def test_a_warm_up_as_long_as_the_run_is_refused_with_the_run_s_steps(fixture_paths, comfy_root, tmp_path):
    item = CacheItem(str(tmp_path / "l.safetensors"), str(tmp_path / "t.safetensors"), "a.png", "a")
    optimizer = OptimizerSpec(lr=1e-3, schedule="cosine_with_restarts", warmup_steps=12, cycles=2)
    with pytest.raises(SpecError) as err:
        make_spec(fixture_paths.mmdit, [item], tmp_path / "run", comfy_root, steps=10, optimizer=optimizer)
    assert "warmup_steps (12) must be fewer than the Train node's steps (10)" in str(err.value)
    fits = dataclasses.replace(optimizer, warmup_steps=7, cycles=4)
    with pytest.raises(SpecError, match=r"cycles \(4\) is more than the 3 steps after warm-up"):
        make_spec(fixture_paths.mmdit, [item], tmp_path / "run", comfy_root, steps=10, optimizer=fits)


# ---- Prodigy across ranks: one step-size estimate for the whole model ---------------------------

PRODIGY_SHAPES = ((8, 4), (4, 8), (12,), (6, 6), (3, 5), (7,))
PRODIGY_STEPS = 20  # d settles by then: 1.36 for the whole, 0.61 and 2.17 for the halves alone
# How far the d of several ranks may lie from the 1-rank d (relative): a bound on float64 rounding, not a
# value measured on one machine. Every float32 quantity (each parameter's dot g_i = grad . (p0 - p), its sum
# of |s|, the weights) is computed alike on both sides, bit for bit (the weights came out bitwise equal); only the
# float64 sums of the n = 6 per-parameter terms are added in another order (on each rank, then over the
# ranks). A sum of n terms of one sign has, in any order, a relative error of at most (n - 1) * eps (eps:
# float64 machine epsilon, 2.2e-16, twice the unit roundoff, so every bound below is doubled). With E_k the
# relative difference in d_k and in Prodigy's running numerator N after k steps:
#   - each numerator term (d / d0) * (d * lr) * g_i is quadratic in d: 2 * E_k, plus 3 roundings;
#   - N_k = beta3 * N_{k-1} + sum of the n terms: <= 2 * E_k + (n + 2) * eps;
#   - the denominator, a sum of n terms each alike on both sides: (n - 1) * eps; d_hat = N / D: one more;
#   - d = max(d, d_hat) takes d_hat's difference at most: E_{k+1} <= 2 * E_k + (2n + 2) * eps, E_0 = 0,
# so E_K <= (2n + 2) * eps * 2**K: 14 * 2.2e-16 * 2**20 = 3.3e-9. The terms are of one sign while d grows
# (g_i > 0 on every step here until d settles at step 16; once d stops following d_hat, d_hat's errors no
# longer reach it). Observed: 3.8e-12 (a ~1e-16 difference at step 1, doubled on each of the 15 growing
# steps). The killed mutants are far outside: float32 all-reduce sums put d 1.8e-7 to 4.4e-7 off by the
# last step, a per-stage estimate over 30%. (The bound holds while the float32 roundings of d-dependent
# scalars agree: one lying within E * |x| of a float32 rounding boundary, chance ~2**24 * E per rounding, or
# ~1e-3 over this whole run, would change the weights by an ulp and d by more.)
PRODIGY_D_REL = (2 * len(PRODIGY_SHAPES) + 2) * sys.float_info.epsilon * 2.0**PRODIGY_STEPS


def _prodigy_trajectory(indices: list[int], plain: bool = False) -> dict:
    """Prodigy (by build_stage_optimizer; ``plain``: prodigyopt's own, never summed) on the seeded
    parameters ``indices`` of PRODIGY_SHAPES, each pulled towards its own seeded target with seeded noise
    (the gradient depends on the weights, so a different d changes the path; odd-numbered targets lie
    farther away, so the two halves alone would estimate different step sizes). Returns d per step and
    the final weights."""
    from prodigyopt import Prodigy

    params = []
    for i in indices:
        g = torch.Generator().manual_seed(100 + i)
        params.append((f"p{i}", torch.nn.Parameter(torch.randn(*PRODIGY_SHAPES[i], generator=g)),
                       torch.randn(*PRODIGY_SHAPES[i], generator=g) * (1 + 5 * (i % 2))))  # unlike halves
    spec = OptimizerSpec(name="Prodigy", lr=1.0, weight_decay=0.01)
    if plain:
        optimizer = Prodigy([p for _, p, _ in params], lr=1.0, weight_decay=0.01)
    else:
        optimizer = build_stage_optimizer(spec, [(n, p) for n, p, _ in params], PRODIGY_STEPS).optimizer
    ds = []
    for step in range(PRODIGY_STEPS):
        for i, (_, p, target) in zip(indices, params, strict=True):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
            p.grad = (p.detach() - target) + 0.1 * noise
        optimizer.step()
        ds.append(float(optimizer.param_groups[0]["d"]))
    return {"d": ds, "weights": {n: p.detach().flatten().tolist() for n, p, _ in params}}


def prodigy_on_ranks(rank: int, world: int) -> dict:
    """On each of 2 gloo ranks: the parameters split like pipeline stages (rank r holds every world-th
    one), held whole like data-parallel replicas, and the stage split with prodigyopt's plain Prodigy."""
    everything = list(range(len(PRODIGY_SHAPES)))
    share = everything[rank::world]
    return {"stages": _prodigy_trajectory(share), "replicas": _prodigy_trajectory(everything),
            "plain_stages": _prodigy_trajectory(share, plain=True)}


def test_prodigy_on_several_ranks_estimates_the_one_rank_step_size(tmp_path):
    """Stages that each hold part of the parameters, or replicas that each hold all of them, get the d of
    one process holding them all (float64 sums, only their order differs), and so the same weights;
    prodigyopt's plain Prodigy on a stage's share estimates another d, which is what this prevents."""
    from pipetrainer.tests.gloo_ranks import run_on_gloo_ranks

    one = _prodigy_trajectory(list(range(len(PRODIGY_SHAPES))))
    ranks = run_on_gloo_ranks(f"{__name__}:prodigy_on_ranks", tmp_path)
    for r in ranks:
        assert r["stages"]["d"] == pytest.approx(one["d"], rel=PRODIGY_D_REL, abs=0), (r["stages"]["d"], one["d"])
        assert r["replicas"]["d"] == pytest.approx(one["d"], rel=PRODIGY_D_REL, abs=0)
        for part in ("stages", "replicas"):
            for name, values in r[part]["weights"].items():
                assert values == pytest.approx(one["weights"][name], rel=1e-6, abs=1e-7), (part, name)
        plain = r["plain_stages"]["d"]
        assert abs(plain[-1] - one["d"][-1]) > 0.3 * one["d"][-1], (plain, one["d"])  # the oracle can tell


# ---- slow tier: exact resume in the real process tree ---------------------------------------------


def _random_item(folder: Path) -> CacheItem:
    """One cached example for the tiny MMDiT (16-channel 8x8 latent, CLIP-L-wide embeddings): no encoders."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    save_file({"latent": torch.randn(16, 8, 8, generator=g)}, str(folder / "latent.safetensors"))
    save_file({"cond": torch.randn(6, 768, generator=g), "pooled": torch.randn(768, generator=g)},
              str(folder / "text.safetensors"))
    return CacheItem(str(folder / "latent.safetensors"), str(folder / "text.safetensors"), "random.png", "random")


def _resume_spec(name: str) -> OptimizerSpec:
    """A schedule whose rate changes at every step (warm-up, then cosine), so a lost schedule state shows;
    the EMA on for AdamW."""
    lr, _ = TRAINING[name]
    if name == "AdamWScheduleFree":
        return OptimizerSpec(name=name, lr=lr, weight_decay=0.01, warmup_steps=2)
    return OptimizerSpec(name=name, lr=lr, weight_decay=0.01, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1,
                         lora_plus_ratio=0.0 if name == "Prodigy" else 4.0, ema_decay=0.9 if name == "AdamW" else 0.0)


def _same_file(a: str | Path, b: str | Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_resumes_bit_exactly(fixture_paths, comfy_root, tmp_path, name):
    """A 4-step run that also saves at step 2, and a run resumed from that checkpoint: the same losses
    and the same LoRA (and EMA) bits. The first run has the full step count rather than stopping at 2,
    because the schedule is spread over the run's steps (a 2-step run would decay faster)."""
    items = [_random_item(tmp_path / "cache")]
    settings = dict(steps=4, gradient_checkpointing=False, optimizer=_resume_spec(name))
    straight = make_spec(fixture_paths.mmdit, items, tmp_path / "straight", comfy_root, save_every=2, **settings)
    code, events = run_training(straight)
    assert code == 0, [e for e in events if e["type"] == "error"]
    checkpoint = next(e["checkpoint"] for e in events if e["type"] == "saved" and e["step"] == 2)
    resumed = make_spec(fixture_paths.mmdit, items, tmp_path / "resumed", comfy_root, resume_from=checkpoint,
                        **settings)
    code, resumed_events = run_training(resumed)
    assert code == 0, [e for e in resumed_events if e["type"] == "error"]
    assert [e["step"] for e in resumed_events if e["type"] == "step"] == [3, 4]
    assert losses(resumed_events) == losses(events)[2:]  # fp32: bitwise
    assert _same_file(resumed.lora_output, straight.lora_output)
    if straight.optimizer.ema_decay:
        assert _same_file(ema_path(resumed.lora_output), ema_path(straight.lora_output))
        assert not _same_file(ema_path(straight.lora_output), straight.lora_output)


@pytest.mark.slow
def test_prodigy_on_two_stages_steps_like_one_stage_and_resumes_exactly(fixture_paths, comfy_root, tmp_path):
    """Real pipelines: the 2-stage run's step size (the step events' rate: d × lr, from stage 0) is the
    1-stage run's, where a per-stage estimate would differ; and the 2-stage run resumed from its
    step-2 checkpoint continues bit for bit (the all-reduced sums come back the same)."""
    items = [_random_item(tmp_path / "cache")]
    settings = dict(steps=4, gradient_checkpointing=False, optimizer=_resume_spec("Prodigy"))
    runs = {}
    for stages in (1, 2):
        spec = make_spec(fixture_paths.mmdit, items, tmp_path / f"stages{stages}", comfy_root,
                         pipeline_stages=stages, save_every=2, **settings)
        code, events = run_training(spec)
        assert code == 0, [e for e in events if e["type"] == "error"]
        runs[stages] = (spec, events)
    rates = {stages: [e["lr"] for e in events if e["type"] == "step"] for stages, (_, events) in runs.items()}
    assert rates[2] == pytest.approx(rates[1], rel=1e-9), rates
    assert losses(runs[2][1]) == pytest.approx(losses(runs[1][1]), rel=1e-6)
    straight, events = runs[2]
    checkpoint = next(e["checkpoint"] for e in events if e["type"] == "saved" and e["step"] == 2)
    resumed = make_spec(fixture_paths.mmdit, items, tmp_path / "resumed", comfy_root, pipeline_stages=2,
                        resume_from=checkpoint, **settings)
    code, resumed_events = run_training(resumed)
    assert code == 0, [e for e in resumed_events if e["type"] == "error"]
    assert losses(resumed_events) == losses(events)[2:]
    assert [e["lr"] for e in resumed_events if e["type"] == "step"] == rates[2][2:]
    assert _same_file(resumed.lora_output, straight.lora_output)
