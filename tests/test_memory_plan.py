"""``blocks_to_swap`` auto: the memory plan against stated capacities, and its resolution in the Train node.

The planner (training/offload/memory_plan.py) is pure arithmetic, so its cases state the GPU's free memory
and each stage's bytes and check the number it picks, its refusal and its formula. The node-layer part
(nodes/checks/memory.py) runs on the real tiny MMDiT loaded by our loader node and the real demo cache:
on this CPU host auto becomes 0 with a note; with stated GPUs (no GPU is needed to plan for one) an
unreadable free memory is refused, and each stage's bytes are the blocks' own tensors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from pipetrainer.training.offload.memory_plan import (
    ACTIVATION_WIDTHS,
    GIB,
    GpuBudget,
    Margin,
    StageWeights,
    Workload,
    lora_bytes_per_param,
    plan_blocks_to_swap,
    stage_need,
)
from pipetrainer.training.offload.stages import balanced_boundaries
from pipetrainer.training.spec.choices import SpecError
from pipetrainer.training.spec.options import BLOCKS_TO_SWAP_AUTO, LoraSpec, OptimizerSpec

NO_MARGIN = Margin(fixed_bytes=0, fraction=0.0)
WEIGHTS_ONLY = Workload(tokens=0, hidden=0, lora_bytes_per_param=0)  # no activations, no LoRA: weights alone


def _stage(blocks: int = 19, block_gib: float = 1.0, rest_gib: float = 3.0, lora_params: int = 0) -> StageWeights:
    return StageWeights(tuple([int(block_gib * GIB)] * blocks), int(rest_gib * GIB), blocks + 2, lora_params)


def _gpu(free_gib: float, index: int = 0) -> GpuBudget:
    return GpuBudget(f"GPU {index} (Test)", int(free_gib * GIB))


# ---- the planner against stated capacities -----------------------------------------------------------
def test_a_19_block_stage_against_24_12_and_4_gib_free():
    """19 blocks of 1 GiB + 3 GiB rest = 22 GiB; swapped blocks keep 2 on the GPU (computing + prefetched)."""
    stage = _stage()
    roomy = plan_blocks_to_swap([stage], [_gpu(24)], WEIGHTS_ONLY, NO_MARGIN)
    assert roomy.blocks_to_swap == 0 and roomy.problem is None
    assert "stage 0 needs 22.0 GiB, 24.0 GiB free on GPU 0 (Test): no block swapped" in roomy.text()

    tight = plan_blocks_to_swap([stage], [_gpu(12)], WEIGHTS_ONLY, NO_MARGIN)
    assert tight.blocks_to_swap == 12  # 3 rest + 7 kept + 2 in flight = 12
    assert tight.stages[0].need.weights == 12 * GIB
    assert "stage 0 needs 22.0 GiB, 12.0 GiB free on GPU 0 (Test): 12 of 19 blocks swapped (12.0 GiB)" in tight.text()
    assert tight.text().endswith("blocks_to_swap auto = 12.")

    short = plan_blocks_to_swap([stage], [_gpu(4)], WEIGHTS_ONLY, NO_MARGIN)
    assert short.blocks_to_swap is None
    problem = short.problem
    assert "stage 0 needs 5.0 GiB with all 19 of its blocks swapped" in problem  # 3 rest + 2 in flight
    assert "GPU 0 (Test) has 4.0 GiB free" in problem
    for fix in ("pipeline_stages", "resolution", "fewer frames", "batch_size", "fp8 weight_dtype",
                "set blocks_to_swap to a number"):
        assert fix in problem, fix


def test_one_gib_less_swaps_one_block_more_and_the_margin_counts():
    stage = _stage()
    assert plan_blocks_to_swap([stage], [_gpu(11)], WEIGHTS_ONLY, NO_MARGIN).blocks_to_swap == 13
    # A fixed margin of 1 GiB is the same as 1 GiB less free memory.
    assert plan_blocks_to_swap([stage], [_gpu(12)], WEIGHTS_ONLY, Margin(GIB, 0.0)).blocks_to_swap == 13
    # ComfyUI's models that the Train node unloads before the launch count as free.
    freed = GpuBudget("GPU 0", 8 * GIB, releasable_bytes=4 * GIB)
    assert plan_blocks_to_swap([stage], [freed], WEIGHTS_ONLY, NO_MARGIN).blocks_to_swap == 12


def test_the_estimate_is_the_stated_formula():
    """weights + LoRA x (8 + optimizer state) + activations (checkpoint boundaries per micro-batch in
    flight, one recomputed chunk and its gradients), then the margin's fraction and fixed bytes."""
    stage = StageWeights(block_bytes=(100, 100, 300, 200), rest_bytes=50, layers=6, lora_params=1000)
    work = Workload(tokens=64, hidden=32, batch_size=2, grad_accum=4, stages=3, dtype_bytes=2,
                    checkpointing=True, checkpoint_interval=2, lora_bytes_per_param=lora_bytes_per_param("AdamW"))
    margin = Margin(fixed_bytes=1000, fraction=0.5)
    h = 64 * 2 * 32 * 2
    need = stage_need(0, stage, work, margin, swapped=3)  # blocks 1..3 swapped: 100 kept, a chunk of 2 + 1 in flight
    assert need.weights == 50 + 100 + 3 * 300
    assert need.lora == 1000 * 16
    in_flight = 3  # min(stages - stage, grad_accum)
    assert need.activations == in_flight * math.ceil(6 / 2) * h + 3 * ACTIVATION_WIDTHS * h + 2 * 3 * h
    assert need.margin == int((need.weights + need.lora + need.activations) * 0.5) + 1000
    last = stage_need(2, stage, work, margin, swapped=3)  # the last stage holds one micro-batch
    assert last.activations == 1 * 3 * h + 3 * ACTIVATION_WIDTHS * h + 2 * 2 * h
    assert lora_bytes_per_param("AdamW8bit") == 10 and lora_bytes_per_param("Prodigy", ema=True) == 28


def test_without_checkpointing_swap_saves_nothing_and_the_refusal_says_so():
    stage = _stage()
    work = dataclasses.replace(WEIGHTS_ONLY, checkpointing=False)
    assert stage_need(0, stage, work, NO_MARGIN, 19).weights == 22 * GIB
    assert plan_blocks_to_swap([stage], [_gpu(22)], work, NO_MARGIN).blocks_to_swap == 0
    refused = plan_blocks_to_swap([stage], [_gpu(12)], work, NO_MARGIN)
    assert refused.blocks_to_swap is None and "gradient_checkpointing on" in refused.problem


def test_a_longer_checkpoint_chunk_keeps_more_swapped_blocks_on_the_gpu():
    stage = _stage()
    work = dataclasses.replace(WEIGHTS_ONLY, checkpoint_interval=3)  # a chunk of 3 + the prefetched one
    assert stage_need(0, stage, work, NO_MARGIN, 19).weights == (3 + 4) * GIB
    assert plan_blocks_to_swap([stage], [_gpu(12)], work, NO_MARGIN).blocks_to_swap == 14


def test_an_fp32_run_is_told_to_use_bf16_and_activations_are_named():
    work = Workload(tokens=4096, hidden=3072, dtype_bytes=4, lora_bytes_per_param=0)
    problem = plan_blocks_to_swap([_stage()], [_gpu(4)], work, NO_MARGIN).problem
    assert "training_dtype bf16 instead of fp32" in problem and "4,096 tokens x batch 1" in problem


def test_more_free_memory_never_swaps_more():
    rng = random.Random(7)
    swapped_some = 0
    for _ in range(40):
        blocks = tuple(rng.randint(1, 4) * GIB // 4 for _ in range(rng.randint(1, 30)))
        stage = StageWeights(blocks, rng.randint(0, 3 * GIB), len(blocks) + 2, rng.randint(0, 10**7))
        work = Workload(tokens=rng.randint(0, 8192), hidden=rng.choice([0, 1024, 3072]),
                        batch_size=rng.randint(1, 4), checkpointing=rng.random() < 0.8,
                        checkpoint_interval=rng.randint(1, 3))
        previous, fitted = len(blocks) + 1, False
        for free in range(0, 48 * 4):
            n = plan_blocks_to_swap([stage], [_gpu(free / 4)], work).blocks_to_swap
            if n is None:
                assert not fitted, "a GPU with more free memory was refused after a smaller one fitted"
                continue
            fitted = True
            assert n <= previous
            previous = n
            swapped_some += n > 0
    assert swapped_some > 100  # the cases do swap: the property is not met by swapping nothing


def test_several_stages_take_the_largest_need_and_refuse_a_stage_too_short_for_it():
    big, small = _stage(blocks=10), _stage(blocks=4, rest_gib=0.5)
    plan = plan_blocks_to_swap([small, big], [_gpu(20), _gpu(8)], WEIGHTS_ONLY, NO_MARGIN)
    assert [f.swapped for f in plan.stages] == [0, 7] and plan.blocks_to_swap is None  # stage 0 has only 4
    assert "stage 1 needs 7 blocks swapped" in plan.problem and "stage 0 has 4" in plan.problem
    assert "partition_method 'uniform'" in plan.problem
    plan = plan_blocks_to_swap([big, big], [_gpu(20), _gpu(9)], WEIGHTS_ONLY, NO_MARGIN)
    assert plan.blocks_to_swap == 6 and "stage 0 needs 13.0 GiB" in plan.text() and "6 of 10" in plan.text()


def test_the_first_stage_of_a_pipeline_holds_more_micro_batches():
    work = Workload(tokens=1024, hidden=1024, grad_accum=8, stages=4, lora_bytes_per_param=0)
    stage = _stage(blocks=4)
    first, last = (stage_need(s, stage, work, NO_MARGIN, 0).activations for s in (0, 3))
    assert first > last


def test_the_parameter_split_is_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced

    rng = random.Random(3)
    for _ in range(200):
        n, m = rng.randint(1, 24), rng.randint(1, 6)
        weights = [rng.choice([0, 5, rng.randint(1, 10), rng.randint(1, 10**6)]) for _ in range(n)]
        assert balanced_boundaries(weights, m) == [int(p) for p in partition_balanced(weights, m)], (weights, m)


# ---- the spec: old specs and workflows stay valid ----------------------------------------------------
def test_old_specs_load_and_auto_never_reaches_the_ranks(fixture_paths, comfy_root, demo_cache, tmp_path):
    from pipetrainer.tests.helpers import make_spec

    spec = make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run", comfy_root)
    old = json.loads(spec.to_json())
    del old["train"]["blocks_to_swap"]  # a spec written before block swap existed
    loaded = type(spec).from_json(json.dumps(old)).validated()
    assert loaded.train.blocks_to_swap == 0 and loaded.training_hash() == spec.training_hash()
    with pytest.raises(SpecError, match=r"blocks_to_swap is auto \(-1\), which the Train node turns into a number"):
        make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run2", comfy_root,
                  blocks_to_swap=BLOCKS_TO_SWAP_AUTO)
    with pytest.raises(SpecError, match=r"blocks_to_swap must be >= 0, or -1 for auto"):
        make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run3", comfy_root, blocks_to_swap=-2)


def test_the_train_node_widget_keeps_old_workflow_values_and_offers_auto(comfy_root):
    from pipetrainer.nodes.train import PipeTrainerTrain

    widget = next(i for i in PipeTrainerTrain.define_schema().inputs if i.id == "blocks_to_swap")
    assert widget.default == 0 and widget.min == BLOCKS_TO_SWAP_AUTO == -1 and widget.max >= 1024
    assert "-1 = auto" in widget.tooltip


# ---- the node layer: auto resolved at queue time -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


SETTINGS = dict(steps=10, batch_size=1, gradient_accumulation=1, seed=0, save_every=0, training_dtype="fp32",
                gradient_checkpointing=True, pipeline_stages=1, partition_method="parameters")


def test_auto_on_a_cpu_run_becomes_0_with_a_note(tiny_model, demo_cache):
    from pipetrainer.nodes.checks.memory import CPU_NOTE
    from pipetrainer.nodes.train import PipeTrainerTrain

    notes: list[str] = []
    spec = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                       "memory_plan_test", notes=notes, **SETTINGS, blocks_to_swap=-1)
    assert spec.device == "cpu" and spec.train.blocks_to_swap == 0 and notes == [CPU_NOTE]
    assert json.loads(spec.to_json())["train"]["blocks_to_swap"] == 0
    notes.clear()
    spec = PipeTrainerTrain.build_spec(tiny_model, demo_cache, LoraSpec(rank=4, alpha=4.0), OptimizerSpec(),
                                       "memory_plan_test", notes=notes, **SETTINGS, blocks_to_swap=3)
    assert spec.train.blocks_to_swap == 3 and notes == []  # a number stays as set


def _train(**changes):
    from pipetrainer.training.spec.options import TrainSpec

    return dataclasses.replace(TrainSpec(dtype="fp32", blocks_to_swap=BLOCKS_TO_SWAP_AUTO), **changes)


def test_auto_refuses_a_gpu_whose_free_memory_is_unknown(tiny_model, demo_cache):
    from pipetrainer.nodes.checks.gpus import GpuInfo
    from pipetrainer.nodes.checks.memory import resolve_auto

    gpus = [GpuInfo(0, "Test GPU", 24 * GIB, 24 * GIB), GpuInfo(1, "Test GPU", 24 * GIB, 24 * GIB, memory_read=False)]
    swap, note, problems = resolve_auto(tiny_model, demo_cache, LoraSpec(rank=4), OptimizerSpec(),
                                        _train(pipeline_stages=2), "cuda", visible=gpus)
    assert swap == 0 and note == "" and len(problems) == 1
    assert "GPU 1 (Test GPU: 24.0 GiB; free memory not read" in problems[0]
    assert "pip install pynvml" in problems[0] and "set blocks_to_swap to a number" in problems[0]
    swap, note, problems = resolve_auto(tiny_model, demo_cache, LoraSpec(rank=4), OptimizerSpec(),
                                        _train(pipeline_stages=1), "cuda", visible=gpus)
    assert problems == [] and swap == 0 and "stage 0 needs" in note and "blocks_to_swap auto = 0" in note


def test_each_stage_counts_its_blocks_own_tensors_at_the_compute_dtype(tiny_model, demo_cache):
    from pipetrainer.nodes.checks.memory import example_tokens, hidden_width, stage_boundaries, stage_weights
    from pipetrainer.training.adapters.size import model_adapter_parameter_count
    from pipetrainer.training.pipelines.base import adapter_for

    dm = tiny_model.model.diffusion_model
    adapter = adapter_for("SD3")
    layers = [None, *adapter.stage_layers(dm)]
    joint = [sum(t.numel() for t in (*b.parameters(), *b.buffers())) for b in dm.joint_blocks]
    every = sum(t.numel() for t in {id(t): t for t in (*dm.parameters(), *dm.buffers())}.values())
    bounds = stage_boundaries(layers, 2, "uniform")
    assert bounds == [0, 4, 7]  # input prep, embed, 2 blocks | 2 blocks, final
    lora = LoraSpec(rank=4)
    regex = adapter.lora_target_regex(lora.targets)
    fp32 = stage_weights(layers, bounds, 4, regex, lora)
    assert [s.block_bytes for s in fp32] == [(4 * joint[0], 4 * joint[1]), (4 * joint[2], 4 * joint[3])]
    assert sum(s.rest_bytes + sum(s.block_bytes) for s in fp32) <= 4 * every
    assert [s.block_bytes for s in stage_weights(layers, bounds, 2, regex, lora)] == [
        (2 * joint[0], 2 * joint[1]), (2 * joint[2], 2 * joint[3])]
    assert sum(s.lora_params for s in fp32) == model_adapter_parameter_count(tiny_model.model, lora) > 0
    assert [s.layers for s in fp32] == [4, 3]
    assert hidden_width(layers) == 256  # the fixture's hidden width
    latent = demo_cache_latent_shape(demo_cache)
    assert example_tokens(adapter, dm, demo_cache) == adapter.image_tokens(dm, latent) + 77  # + CLIP-L's tokens


def demo_cache_latent_shape(cache) -> tuple[int, ...]:
    from pipetrainer.nodes.checks.preflight import read_cached_shapes

    return max(read_cached_shapes(cache.items).latents.values(), key=lambda s: math.prod(s))


def test_auto_on_stated_gpus_plans_or_refuses_with_the_numbers(tiny_model, demo_cache):
    from pipetrainer.nodes.checks.gpus import GpuInfo
    from pipetrainer.nodes.checks.memory import resolve_auto

    roomy = [GpuInfo(0, "Big", 80 * GIB, 80 * GIB)]
    swap, note, problems = resolve_auto(tiny_model, demo_cache, LoraSpec(rank=4), OptimizerSpec(), _train(), "cuda",
                                        visible=roomy)
    assert (swap, problems) == (0, []) and note.startswith("Memory plan: stage 0 needs 1.0 GiB, 80.0 GiB free on GPU 0 (Big)")
    tiny = [GpuInfo(0, "Small", GIB // 2, 8 * GIB)]  # less than a rank's CUDA context
    swap, note, problems = resolve_auto(tiny_model, demo_cache, LoraSpec(rank=4), OptimizerSpec(), _train(), "cuda",
                                        visible=tiny)
    assert swap == 0 and note == "" and len(problems) == 1
    assert "GPU 0 (Small) has 0.5 GiB free" in problems[0] and "pipeline_stages" in problems[0]


def test_the_plan_line_opens_the_run_log(fixture_paths, comfy_root, demo_cache, tmp_path):
    """The node writes the plan into events.jsonl as a ``note`` before the supervisor starts (the process
    group started here is ended at once: nothing needs to train)."""
    from pipetrainer.nodes.run import run_process
    from pipetrainer.tests.helpers import make_spec
    from pipetrainer.training.process.events import read_all

    spec = make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run", comfy_root)
    line = "Memory plan: stage 0 needs 22.0 GiB, 12.0 GiB free on GPU 0 (Test): 12 of 19 blocks swapped (12.0 GiB)."
    handle = run_process.launch(spec, notes=[line])
    try:
        first = read_all(spec.run_dir)[0]
    finally:
        run_process.kill_group(handle.proc)
    assert (first["type"], first["source"], first["message"]) == ("note", "node", line)
