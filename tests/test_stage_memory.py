"""A rank materialises only its own stage; block swap keeps swapped blocks off the device from the start.

Oracles: ComfyUI's own full load (``load_model`` without deferral) for the weights a stage loads, the
meta device for "never allocated", and the meta device standing in for the GPU for placement.
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.training.model.fingerprint import file_fingerprint
from pipetrainer.training.model.model_source import finish_loading, load_model
from pipetrainer.training.model.stage_weights import DeferredWeights, foreign_module_paths, resident_bytes
from pipetrainer.training.spec.options import ModelRecipe
from safetensors.torch import save_file

QKV = "diffusion_model.joint_blocks.{}.x_block.attn.qkv"


def _recipe(path, loras=()) -> ModelRecipe:
    return ModelRecipe("diffusion_model", str(path), "default", file_fingerprint(path), loras=tuple(loras))


def _stacked_lora(tmp_path) -> str:
    """A LoRA on a block of each half of the tiny MMDiT, as a stacked LoRA file."""
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for block in (0, 3):
        tensors[f"{QKV.format(block)}.lora_up.weight"] = torch.randn(768, 4, generator=g) * 0.1
        tensors[f"{QKV.format(block)}.lora_down.weight"] = torch.randn(4, 256, generator=g) * 0.1
        tensors[f"{QKV.format(block)}.alpha"] = torch.tensor(4.0)
    path = tmp_path / "stacked.safetensors"
    save_file(tensors, str(path))
    return str(path)


def _stage_layers(patcher):
    from pipetrainer.training.pipelines.base import adapter_for

    return adapter_for("SD3").stage_layers(patcher.model.diffusion_model)


def test_a_stage_loads_exactly_its_weights_and_frees_the_others(fixture_paths, tmp_path):
    recipe = _recipe(fixture_paths.mmdit, [(_stacked_lora(tmp_path), 0.8)])
    full = load_model(recipe).model.diffusion_model.state_dict()  # ComfyUI's load, stacked LoRA merged

    deferred = DeferredWeights()
    patcher = load_model(recipe, deferred=deferred)
    dm = patcher.model.diffusion_model
    assert deferred.captured and len(deferred.tensors) == len(full)
    layers = _stage_layers(patcher)  # embed, 4 joint blocks, final
    foreign = foreign_module_paths(layers, {0, 1, 2})  # stage 0 = embed + blocks 0 and 1
    assert foreign == ["final_layer", "joint_blocks.2", "joint_blocks.3"]
    loaded = finish_loading(patcher, deferred, foreign)

    assert loaded and all(not any(k.startswith(p + ".") for p in foreign) for k in loaded)
    state = dm.state_dict()
    for key in loaded:  # bit-identical to ComfyUI's full load, the stacked LoRA merged in (block 0)
        assert torch.equal(state[key], full[key]), key
    for path in foreign:  # never materialised here
        module = dm.get_submodule(path)
        assert all(t.is_meta for t in (*module.parameters(), *module.buffers())), path
        assert resident_bytes(module) == 0
    assert not patcher.patches  # block 3's stacked LoRA is not merged anywhere on this rank
    assert resident_bytes(dm) < 0.75 * sum(t.numel() * t.element_size() for t in full.values())


def test_the_other_stage_gets_the_rest_and_the_two_halves_make_the_whole(fixture_paths, tmp_path):
    recipe = _recipe(fixture_paths.mmdit, [(_stacked_lora(tmp_path), 0.8)])
    full = load_model(recipe).model.diffusion_model.state_dict()
    halves = []
    for local in ({0, 1, 2}, {3, 4, 5}):
        deferred = DeferredWeights()
        patcher = load_model(recipe, deferred=deferred)
        foreign = foreign_module_paths(_stage_layers(patcher), local)
        halves.append(set(finish_loading(patcher, deferred, foreign)))
        state = patcher.model.diffusion_model.state_dict()
        assert all(torch.equal(state[k], full[k]) for k in halves[-1])
    shared = halves[0] & halves[1]  # weights outside every stage layer (none for this family)
    assert halves[0] | halves[1] == set(full) and not any(k.startswith("joint_blocks") for k in shared)


def test_swapped_blocks_never_reach_the_device_during_set_up(fixture_paths):
    """The meta device stands in for the GPU: what lands there is what would use VRAM."""
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.offload.block_swap import BlockSwapper
    from pipetrainer.training.offload.placement import last_swappable, move_trainable, place_stage
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.spec.options import LoraSpec

    patcher = load_model(_recipe(fixture_paths.mmdit))
    layers = _stage_layers(patcher)
    swapped = last_swappable(layers, 3)
    assert [layer.comfy_paths["block"] for layer in swapped] == ["joint_blocks.1", "joint_blocks.2", "joint_blocks.3"]
    place_stage(layers, swapped, "meta")
    for layer in layers:
        on_meta = {t.is_meta for t in layer.parameters()}
        assert on_meta == ({False} if layer in swapped else {True})
    regex = adapter_for("SD3").lora_target_regex("attention")
    inject_lora(list(enumerate(layers, start=1)), regex, LoraSpec(rank=4, alpha=4.0, targets="attention"), 0)
    freeze_all_but_lora(torch.nn.ModuleList(layers))
    assert move_trainable(swapped, "meta") > 0
    trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    assert trainable and all(p.is_meta for p in trainable)  # every LoRA lives on the device
    swapper = BlockSwapper(swapped, "meta", transfer=lambda t, d: torch.empty_like(t, device=d)).attach()
    assert swapper.resident() == ()
    for layer in swapped:  # frozen weights stay in host memory until a block runs
        assert all(not p.is_meta for p in layer.parameters() if not p.requires_grad)


def _record_sizes(index_file: str, keys: set[str]) -> dict[str, int]:
    from pathlib import Path

    from pipetrainer.training.cache.index import CacheIndex

    index = CacheIndex(Path(index_file).parent)
    try:
        return {k: index.entry(k).length for k in keys}
    finally:
        index.close()


@pytest.mark.slow
def test_a_middle_stage_reads_no_cached_example_and_the_last_reads_no_text(fixture_paths, comfy_root, demo_cache,
                                                                           tmp_path):
    from pipetrainer.tests.helpers import make_spec, run_training

    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=2,
                     pipeline_stages=3, partition_method="uniform")
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] == "error"]
    seen = {e["stage"]: e for e in events if e["type"] == "stage_memory"}
    assert sorted(seen) == [0, 1, 2]
    assert seen[0]["examples"] == len(demo_cache.items) and seen[0]["text"] is True
    assert seen[1]["examples"] == 0
    assert seen[2]["examples"] == len(demo_cache.items) and seen[2]["text"] is False
    assert all(e["foreign_bytes"] == 0 for e in seen.values())
    # What each rank read from the cache files (counted by the reader), against the index's record sizes.
    latents, texts = {i.latent_key for i in demo_cache.items}, {i.text_key for i in demo_cache.items}
    size = _record_sizes(demo_cache.items[0].latent_file, latents | texts)
    assert seen[0]["cache_reads"] == {"keys": len(latents | texts), "bytes": sum(size[k] for k in latents | texts)}
    assert seen[1]["cache_reads"] == {"keys": 0, "bytes": 0}
    assert seen[2]["cache_reads"] == {"keys": len(latents), "bytes": sum(size[k] for k in latents)}


@pytest.mark.slow
def test_replicas_load_frozen_weights_themselves_and_broadcast_only_the_lora(fixture_paths, comfy_root, demo_cache,
                                                                              tmp_path):
    from pipetrainer.tests.helpers import losses, make_spec, run_training

    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=2, data_parallel=2)
    code, events = run_training(spec)
    assert code == 0, [e for e in events if e["type"] == "error"]
    setup = next(e for e in events if e["type"] == "setup")
    # DeepSpeed's own start-up broadcast would send every parameter, the frozen base weights included.
    assert 0 < setup["broadcast_tensors_stage0"] == setup["trainable_tensors_stage0"]
    assert len(losses(events)) == 2


@pytest.mark.slow
def test_two_flux_stages_each_peak_at_most_0_6_of_one_stage_with_bitwise_losses(
        balanced_flux_one_stage, balanced_flux_path, demo_cache, comfy_root, tmp_path):
    """Issue #9's criterion on CPU: Flux-min in 2 stages, what the model adds to each rank's peak RSS
    (getrusage: weights, file pages, activations; over the rank's peak before the model loads, its imports)
    is at most 0.6x the 1-stage run's, no rank holds a tensor of another stage, and losses and LoRA are
    bitwise those of 1 stage. (Whole-process peaks compared while file pages were counted twice during
    loading; since a load gives them back as it goes, the fixed imports would dominate the ratio.)

    The balanced Flux-min (2 double blocks) splits (embed, double) | (double, final) 50/50; with the
    1 + 1 layout stage 0 held 69 % of the weights and rank 0 peaked at 0.75x. Measured before loads gave pages back (2026-12, CPU,
    fp32): 1 stage 4879 MB; 2 stages 2827 MB (rank 0, 0.58x) and 2796 MB (rank 1, 0.57x); whole
    machine 5623 MB (1.15x: every rank pays its imports, ~0.54 GB before the model loads).
    """
    from pipetrainer.tests.helpers import losses, train_min_flux
    from safetensors.torch import load_file

    one_spec, one_events = balanced_flux_one_stage
    spec, events = train_min_flux(balanced_flux_path, demo_cache.items, tmp_path / "run", comfy_root, 2)
    setup = next(e for e in events if e["type"] == "setup")
    assert setup["world_size"] == 2 and setup["partition"] == [0, 3, 5]  # (inputs, embed, double) | (double, final)
    assert losses(events) == losses(one_events) and len(losses(events)) == 3  # bit-identical in fp32
    one, two = load_file(one_spec.lora_output), load_file(spec.lora_output)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    stages = {e["stage"]: e for e in events if e["type"] == "stage_memory"}
    assert sorted(stages) == [0, 1] and all(e["foreign_bytes"] == 0 for e in stages.values())
    whole = sum(e["local_bytes"] for e in stages.values())
    assert all(0.45 < e["local_bytes"] / whole < 0.55 for e in stages.values())  # the split this fixture is for
    one_added = _added_by_the_model(one_events)
    added = _added_by_the_model(events)
    assert sorted(added) == [0, 1]
    for rank, mb in added.items():
        assert mb <= 0.6 * one_added[0], (rank, mb, one_added[0])


def _added_by_the_model(events: list[dict]) -> dict[int, float]:
    """Each rank's peak RSS over its peak before the model loads (its imports, the same for every rank)."""
    before = {e["rank"]: e["peak_before_load_mb"] for e in events if e["type"] == "rank_memory"}
    return {e["rank"]: e["peak_rss_mb"] - before[e["rank"]] for e in events if e["type"] == "rank_done"}

