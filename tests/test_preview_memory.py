"""Previews on ComfyUI's GPU: what a preview needs next to what the memory plan leaves free there.

The verdict and the advice (training/offload/preview_memory.py) are pure arithmetic, so their cases state
the preview's need and what is left and check the line. The node-layer part (nodes/checks/memory.py) runs
on the real tiny MMDiT, its real VAE and the demo cache, with stated GPUs (no GPU is needed to plan for one):
a preview's need must be ComfyUI's own sizes, and what is left must be the GPU's free memory minus the
plan's estimate for the stage training there.
"""

from __future__ import annotations

import dataclasses

import pytest
from pipetrainer.training.offload.memory_plan import GIB, GpuBudget, Margin, StageWeights, Workload, plan_blocks_to_swap
from pipetrainer.training.offload.preview_memory import (
    FITS,
    IN_PART,
    SHORT,
    UNKNOWN,
    PreviewFit,
    PreviewNeed,
    gpu_advice,
)
from pipetrainer.training.spec.options import BLOCKS_TO_SWAP_AUTO, LoraSpec, OptimizerSpec

NEED = PreviewNeed(weights=12 * GIB, sampling=2 * GIB, decode=GIB, lowvram_weights=GIB // 4,
                   lowvram_sampling=GIB + GIB // 4, size="1024x1024")  # whole 14 GiB, in part 1.5 GiB


# ---- the verdict against stated capacities --------------------------------------------------------------
def test_a_preview_beside_a_24_gib_stage_fits_loads_in_part_or_runs_short():
    assert (NEED.whole, NEED.minimum) == (14 * GIB, GIB + GIB // 2)
    roomy = PreviewFit("GPU 0 (Test)", NEED, 20 * GIB, rank=0, stage=0, swap=0)
    assert roomy.verdict == FITS
    text = roomy.text()
    assert text.startswith("Previews render on GPU 0 (Test), ComfyUI's device, where rank 0 (stage 0) trains: a "
                           "1024x1024 preview needs 14.0 GiB loaded whole (model 12.0 GiB + sampling 2.0 GiB), "
                           "at least 1.5 GiB loaded in part (lowvram)")
    assert text.endswith("the memory plan (blocks_to_swap 0) leaves 20.0 GiB free there beside training: it fits.")

    # What the plan leaves: a 19-block stage (3 + 19 x 1 GiB) on 24 GiB with 12 blocks swapped needs 12 GiB.
    stage = StageWeights(tuple([GIB] * 19), 3 * GIB, 21, 0)
    plan = plan_blocks_to_swap([stage], [GpuBudget("GPU 0", 12 * GIB)], Workload(0, 0, lora_bytes_per_param=0),
                               Margin(0, 0.0))
    left = 24 * GIB - plan.stages[0].need.total
    assert plan.blocks_to_swap == 12 and left == 12 * GIB
    partial = PreviewFit("GPU 0 (Test)", NEED, left, rank=0, stage=0, swap=12, advice="ADVICE")
    assert partial.verdict == IN_PART
    assert "(blocks_to_swap 12) leaves 12.0 GiB free there beside training: ComfyUI will load the model in part " \
           "(lowvram): previews render slower, and a rank at its peak may run out of memory" in partial.text()
    assert partial.text().endswith(" ADVICE")

    short = PreviewFit("GPU 0 (Test)", NEED, GIB, rank=0, stage=0, swap=19, advice="ADVICE")
    assert short.verdict == SHORT
    assert "leaves 1.0 GiB free there beside training: less than a preview needs even loaded in part" in short.text()
    assert "may push the rank out of memory" in short.text() and short.text().endswith(" ADVICE")
    assert "leaves 0.0 GiB free" in PreviewFit("GPU 0", NEED, -3 * GIB, 0, 0).text()  # an overcommitted plan


def test_the_verdict_boundaries_are_the_whole_and_the_least_need():
    at = {left: PreviewFit("GPU 0", NEED, left, 0, 0).verdict
          for left in (NEED.whole, NEED.whole - 1, NEED.minimum, NEED.minimum - 1)}
    assert list(at.values()) == [FITS, IN_PART, IN_PART, SHORT]
    unread = PreviewFit("GPU 0", NEED, None, 0, 0)
    assert unread.verdict == UNKNOWN and "free memory was not read" in unread.text()
    # A VAE decode larger than the sampling sets the whole need, and is named.
    big_decode = dataclasses.replace(NEED, decode=20 * GIB)
    assert big_decode.whole == 20 * GIB and "VAE decode 20.0 GiB" in PreviewFit("GPU 0", big_decode, 0, 0, 0).text()
    assert "VAE decode" not in PreviewFit("GPU 0", NEED, 0, 0, 0).text()
    # No rank on ComfyUI's GPU: what is free there, and no talk of a rank.
    alone = PreviewFit("GPU 2 (Test)", NEED, 5 * GIB)
    assert "which no rank uses" in alone.text() and "; 5.0 GiB free there: ComfyUI will load" in alone.text()
    assert "rank at its peak" not in alone.text()


def test_the_advice_leaves_comfyuis_gpu_out_and_never_says_cuda_device_is_the_fix():
    one_spare = gpu_advice(0, (0,), [0, 1])
    assert "set gpus to '1' (it leaves out GPU 0, ComfyUI's device, where previews render)" in one_spare
    assert "--default-device N" in one_spare and "--cuda-device is not the fix" in one_spare
    assert "set gpus to '1,2'" in gpu_advice(0, (0, 1), [0, 1, 2])
    assert "set gpus to '0,2'" in gpu_advice(1, (1, 2), [0, 1, 2])  # ComfyUI on its GPU 1
    full = gpu_advice(0, (0, 1), [0, 1])
    assert "Every GPU ComfyUI sees trains (2 ranks on 2 GPUs): with fewer pipeline_stages" in full
    assert "set gpus" not in full and "--cuda-device is not the fix" in full
    alone = gpu_advice(0, (0,), [0])
    assert alone.startswith("ComfyUI sees one GPU, so previews share it with training") and "gpus" not in alone
    assert gpu_advice(0, (1,), [0, 1]).startswith("To make it fit, use a smaller preview")


# ---- the node layer: ComfyUI's own sizes, the plan's estimate ------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(fixture_paths):
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    return PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]


def _settings(vae, **changes):
    from pipetrainer.nodes.preview_settings import PreviewSettings

    return dataclasses.replace(PreviewSettings(clip=None, vae=vae, prompts=("a photo",), width=64, height=64), **changes)


def _train(**changes):
    from pipetrainer.training.spec.options import TrainSpec

    return dataclasses.replace(TrainSpec(dtype="fp32", blocks_to_swap=0), **changes)


def test_a_previews_need_is_comfyuis_own_sizes(tiny_model, encoders):
    import comfy.model_management as mm
    from pipetrainer.nodes.checks.memory import preview_latent_shape, preview_need
    from pipetrainer.nodes.run.previews import empty_latent

    vae = encoders[0]
    base = tiny_model.model
    settings = _settings(vae, width=2048, height=1024)
    shape = preview_latent_shape(vae, 2048, 1024, 1)
    assert shape == tuple(empty_latent(vae, 2048, 1024, 1).shape) == (1, 16, 128, 256)
    reserve, floor = mm.extra_reserved_memory(), mm.minimum_inference_memory()
    need = preview_need(tiny_model, settings, lora_file_bytes=1000)
    assert need.weights == tiny_model.model_size() + 1000
    one = base.memory_required(list(shape))
    assert one + reserve > floor  # the preview is large enough for the formula, not the floor, to count
    assert need.sampling == int(max(floor, int(one) + reserve)) and need.lowvram_sampling == need.sampling  # cfg 1
    with_cfg = preview_need(tiny_model, dataclasses.replace(settings, cfg=4.0), 0)
    assert with_cfg.sampling == int(base.memory_required([2, *shape[1:]])) + reserve  # cond and uncond together
    assert with_cfg.lowvram_sampling == need.lowvram_sampling  # ComfyUI's minimum: one batch
    compute = mm.dtype_size(base.manual_cast_dtype or base.get_dtype())
    largest = max(sum(t.numel() for t in (m.weight, getattr(m, "bias", None)) if t is not None)
                  for m in base.diffusion_model.modules() if getattr(m, "weight", None) is not None)
    assert need.lowvram_weights == largest * compute > 0
    assert need.decode == vae.patcher.model_size() + int(vae.memory_used_decode(shape, vae.vae_dtype))
    assert need.size == "2048x1024"


def test_what_is_left_is_the_gpus_free_memory_minus_the_plan_for_the_stage_there(tiny_model, demo_cache, encoders):
    from pipetrainer.nodes.checks.gpus import GpuInfo
    from pipetrainer.nodes.checks.memory import plan_for_model, preview_fit, stage_budgets

    lora, optimizer = LoraSpec(rank=4), OptimizerSpec()
    settings = _settings(encoders[0])
    visible = [GpuInfo(0, "Big", 80 * GIB, 80 * GIB), GpuInfo(1, "Big", 80 * GIB, 80 * GIB)]
    fit = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(), (0,), settings, visible, comfy_gpu=0)
    plan = plan_for_model(tiny_model, demo_cache, lora, optimizer, _train(), stage_budgets((0,), visible, 1, 1))
    assert (fit.rank, fit.stage, fit.swap) == (0, 0, 0)
    assert fit.left == 80 * GIB - plan.stages[0].unswapped.total and fit.verdict == FITS
    assert "where rank 0 (stage 0) trains" in fit.text() and fit.text().endswith(": it fits.")

    # ComfyUI's models that the Train node unloads count as free; swapped blocks leave more.
    freed = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(), (0,), settings, visible, 0, {0: 2 * GIB})
    assert freed.left == fit.left + 2 * GIB
    swapped = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(blocks_to_swap=3), (0,), settings, visible, 0)
    assert swapped.swap == 3 and swapped.left > fit.left
    auto = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(blocks_to_swap=BLOCKS_TO_SWAP_AUTO), (0,),
                       settings, visible, 0)
    assert auto.swap == plan.blocks_to_swap == 0 and auto.left == fit.left

    # A GPU whose free memory leaves less than the preview's least need beside the stage.
    tight = [GpuInfo(0, "Small", plan.stages[0].unswapped.total + GIB // 2, 8 * GIB), visible[1]]
    short = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(), (0,), settings, tight, 0)
    assert short.left == GIB // 2 and short.verdict == SHORT
    assert "set gpus to '1' (it leaves out GPU 0" in short.text() and "--cuda-device is not the fix" in short.text()

    # The ranks on GPU 1 (gpus '1'): the preview has GPU 0 to itself.
    apart = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(), (1,), settings, tight, 0)
    assert apart.rank is None and apart.left == tight[0].free_bytes and "which no rank uses" in apart.text()
    # Two stages on GPUs 1 and 0: the rank on ComfyUI's GPU is rank 1, stage 1, with its own stage's need.
    two = preview_fit(tiny_model, demo_cache, lora, optimizer, _train(pipeline_stages=2), (1, 0), settings, visible, 0)
    plan2 = plan_for_model(tiny_model, demo_cache, lora, optimizer, _train(pipeline_stages=2),
                           stage_budgets((1, 0), visible, 2, 1))
    assert (two.rank, two.stage) == (1, 1) and two.left == 80 * GIB - plan2.stages[1].unswapped.total
    assert plan2.stages[0].unswapped.total != plan2.stages[1].unswapped.total  # the stage does matter


def test_the_train_node_gets_a_line_only_with_previews_on_a_gpu(tiny_model, demo_cache, encoders, fixture_paths,
                                                                  comfy_root, tmp_path):
    from pipetrainer.nodes.checks.gpus import GpuInfo
    from pipetrainer.nodes.checks.memory import preview_notes
    from pipetrainer.tests.helpers import make_spec

    spec = make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run", comfy_root)
    settings = _settings(encoders[0])
    visible = [GpuInfo(0, "Big", 80 * GIB, 80 * GIB)]
    assert preview_notes(tiny_model, demo_cache, spec, settings) == []  # CPU: previews use no GPU
    on_gpu = dataclasses.replace(spec, device="cuda", launch=dataclasses.replace(spec.launch, gpus=(0,)))
    assert preview_notes(tiny_model, demo_cache, on_gpu, None, visible, 0, {}) == []  # no previews
    (line,) = preview_notes(tiny_model, demo_cache, on_gpu, settings, visible, 0, {})
    assert line.startswith("Previews render on GPU 0 (Big), ComfyUI's device, where rank 0 (stage 0) trains")
