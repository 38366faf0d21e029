"""Block swap: bitwise neutral, LoRA never moves, and a swapped block is on the compute device only while it runs.

The compute device here is the CPU, so "on the compute device" is made visible with an injected transfer
that copies (a separate storage from the host copy). The stage layers are the real tiny ComfyUI MMDiT's,
with real PEFT LoRA, run forward and backward under torch's non-reentrant activation checkpoint as the
engine does; the training tests run the real DeepSpeed process tree.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint
from pipetrainer.tests.helpers import losses, make_spec, run_training
from pipetrainer.training.offload.block_swap import BlockSwapper, swap_last_blocks
from pipetrainer.training.offload.stages import blocks_to_swap_problem, swappable_per_stage, uniform_boundaries
from pipetrainer.training.pipelines.base import Batch
from safetensors.torch import load_file


def _copying_transfer(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.clone()


def _sd3():
    from pipetrainer.training.pipelines.base import adapter_for

    return adapter_for("SD3")


def _stage_layers(fixture_paths):
    """The tiny MMDiT as the engine's layer list, with LoRA injected on every block (fixed seed)."""
    import comfy.sd
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora
    from pipetrainer.training.spec.options import LoraSpec

    adapter = _sd3()
    dm = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model.diffusion_model
    layers = adapter.stage_layers(dm)
    inject_lora(list(enumerate(layers, start=1)), adapter.lora_target_regex("attention_mlp"), LoraSpec(rank=4), 0)
    for layer in layers:
        freeze_all_but_lora(layer)
        for name, p in layer.named_parameters():  # lora_B starts at zero: give the LoRA path a real effect
            if ".lora_B." in name:
                with torch.no_grad():
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return adapter, layers


def _step(adapter, layers, checkpointing: bool = True):
    """One forward and backward as a pipeline stage runs it; returns the output and the LoRA grads."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 8, 8, generator=g)
    t = torch.tensor([0.5])
    cond = torch.randn(1, 77, 768, generator=g)
    pooled = torch.randn(1, 768, generator=g)
    out = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in adapter.first_stage_inputs(Batch(x, t, cond, pooled, options=adapter.options_type())))
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for layer in layers:
        out = checkpoint(layer, out) if checkpointing else layer(out)
    out = out if isinstance(out, torch.Tensor) else out[0]
    (out.float() ** 2).mean().backward()
    grads = {n: p.grad.clone() for layer in layers for n, p in layer.named_parameters() if p.grad is not None}
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return out.detach(), grads


def _lora_identity(layers):
    return {(i, n): (id(p), p.data_ptr()) for i, layer in enumerate(layers)
            for n, p in layer.named_parameters() if p.requires_grad}


def _watch(swapper: BlockSwapper, blocks, lora_before, layers, record: list):
    """Test hooks around each swapped block: residency while it runs, LoRA untouched, nothing else resident."""
    handles = []
    for position, block in enumerate(blocks):
        def inside(module, *args, position=position):
            assert swapper.is_on_compute_copy(position), f"block {position} runs on its host copy"
            assert position in swapper.resident()
            others = set(swapper.resident()) - {position}
            assert len(others) <= (1 if swapper.prefetch else 0), swapper.resident()
            assert _lora_identity(layers) == lora_before, "a LoRA parameter moved"
            record.append(("start" if len(args) == 1 else "end", position))
        handles.append(block.register_forward_pre_hook(inside))  # after the swapper's: block loaded
        # Before the swapper's offload, and also when checkpoint stops a recomputation early by raising.
        handles.append(block.register_forward_hook(inside, prepend=True, always_call=True))
    return handles


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "no-checkpoint"])
def test_swapped_blocks_are_resident_exactly_while_they_run_and_results_are_bitwise(
        fixture_paths, prefetch, checkpointing):
    adapter, layers = _stage_layers(fixture_paths)
    ref_out, ref_grads = _step(adapter, layers, checkpointing)
    swappable = [layer for layer in layers if layer.swappable]
    blocks = swappable[-3:]
    lora_before = _lora_identity(layers)
    swapper = BlockSwapper(blocks, "cpu", transfer=_copying_transfer, prefetch=prefetch).attach()
    assert swapper.resident() == () and not any(swapper.is_on_compute_copy(i) for i in range(3))
    record: list = []
    handles = _watch(swapper, blocks, lora_before, layers, record)
    for _ in range(2):  # the second step reuses offloaded blocks
        out, grads = _step(adapter, layers, checkpointing)
        assert torch.equal(out, ref_out)
        assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
        assert swapper.resident() == () and swapper.running() == ()
        assert not any(swapper.is_on_compute_copy(i) for i in range(3))
    runs = 2 * (2 if checkpointing else 1)  # per step: the forward, and the recompute inside backward
    assert record.count(("start", 0)) == record.count(("end", 0)) == runs
    assert swapper.peak_resident == (2 if prefetch else 1)
    assert _lora_identity(layers) == lora_before
    for h in handles:
        h.remove()
    swapper.detach()
    out, _ = _step(adapter, layers, checkpointing)
    assert torch.equal(out, ref_out)


def test_frozen_weights_live_on_the_host_copy_between_uses(fixture_paths):
    """Loading installs a fresh Parameter around the compute copy; offloading re-installs the host one."""
    _, layers = _stage_layers(fixture_paths)
    block = [layer for layer in layers if layer.swappable][-1]
    frozen = {n for n, p in block.named_parameters() if not p.requires_grad}
    swapper = BlockSwapper([block], "cpu", transfer=_copying_transfer).attach()
    host = {n: p for n, p in block.named_parameters() if n in frozen}
    seen = {}
    handle = block.register_forward_pre_hook(lambda m, a: seen.update(dict(m.named_parameters())))
    _step(_sd3(), layers)
    handle.remove()
    assert all(seen[n] is not host[n] and not seen[n].requires_grad for n in frozen)
    assert all(dict(block.named_parameters())[n] is host[n] for n in frozen)
    assert swapper.loads == 2


def _frozen_tensors(block) -> dict[str, torch.Tensor]:
    return {**{n: p for n, p in block.named_parameters() if not p.requires_grad}, **dict(block.named_buffers())}


def test_each_block_host_copy_is_views_into_one_flat_buffer_of_its_exact_size(fixture_paths):
    """One host allocation per swapped block (pinned in place on CUDA; torch's pinned allocator would round
    each tensor up to a power of two): every frozen tensor of the block is a view into it, the views do
    not overlap, the buffer is the tensors' bytes plus alignment, and the stage computes the same."""
    from pipetrainer.training.offload.host_buffer import ALIGN

    adapter, layers = _stage_layers(fixture_paths)
    ref_out, ref_grads = _step(adapter, layers)
    blocks = [layer for layer in layers if layer.swappable][-2:]
    before = [{n: t.detach().clone() for n, t in _frozen_tensors(b).items()} for b in blocks]
    swapper = BlockSwapper(blocks, "cpu", transfer=_copying_transfer).attach()
    assert len(swapper.host_buffers) == len(blocks)
    for block, original, packed in zip(blocks, before, swapper.host_buffers, strict=True):
        hosts = _frozen_tensors(block)
        assert hosts.keys() == original.keys() and len(hosts) > 10
        base = packed.buffer.untyped_storage().data_ptr()
        spans = []
        for name, t in hosts.items():
            assert t.untyped_storage().data_ptr() == base, name  # a view into the block's one buffer
            assert t.dtype == original[name].dtype and torch.equal(t, original[name]), name
            start = t.storage_offset() * t.element_size()
            spans.append((start, start + t.numel() * t.element_size()))
            assert start % ALIGN == 0
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap
        weight = sum(t.numel() * t.element_size() for t in original.values())
        assert packed.weight_bytes == weight and spans[-1][1] == packed.nbytes
        assert weight <= packed.nbytes < weight + ALIGN * len(original)
    assert swapper.host_bytes() == (0, sum(p.weight_bytes for p in swapper.host_buffers))  # no pinning on CPU
    out, grads = _step(adapter, layers)
    assert torch.equal(out, ref_out) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_host_buffer_layout_holds_any_dtype_and_leaves_tensor_subclasses_alone():
    from pipetrainer.training.offload.host_buffer import ALIGN, HostBuffer, buffer_layout, is_packable

    g = torch.Generator().manual_seed(1)
    tensors = [torch.arange(3, dtype=torch.uint8), torch.randn(5, 7, generator=g),
               torch.randn(3, generator=g).to(torch.bfloat16), torch.tensor(2.5, dtype=torch.float64),
               torch.zeros(0, 4), torch.randn(4, 6, generator=g).t()]  # the last one is not contiguous
    offsets, total = buffer_layout(tensors)
    # 3 B at 0; 140 B at 64; 6 B at 256 (after 204); 8 B at 320; 0 B and 96 B at 384 (after 328)
    assert offsets == [0, 64, 256, 320, 384, 384] and total == 384 + 96
    packed = HostBuffer(tensors)
    assert packed.nbytes == total and not packed.pinned and all(o % ALIGN == 0 for o in offsets)
    for view, t in zip(packed.views, tensors, strict=True):
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t)
        assert view.untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr()

    class Quantized(torch.Tensor):  # stands for ComfyUI-GGUF's GGMLTensor: attributes a byte view would drop
        pass

    assert is_packable(torch.nn.Parameter(torch.ones(2))) and not is_packable(torch.ones(2).as_subclass(Quantized))


def test_blocks_to_swap_limits_per_stage():
    assert uniform_boundaries(6, 2) == [0, 3, 6] and uniform_boundaries(7, 3) == [0, 3, 5, 7]
    assert uniform_boundaries(2, 3) == [0, 1, 2, 2]
    assert blocks_to_swap_problem(0, [0]) is None and blocks_to_swap_problem(4, [4]) is None
    msg = blocks_to_swap_problem(5, [4])
    assert "maximum is 4" in msg and "Set blocks_to_swap to 4 or less" in msg
    msg = blocks_to_swap_problem(3, [2, 4])
    assert "smallest stage has 2" in msg and "fewer pipeline stages" in msg

    from pipetrainer.nodes.checks.preflight import blocks_to_swap_problems

    layout = [False, False, True, True, True, True, False]  # the MMDiT's: input prep, embed, 4 blocks, final
    assert blocks_to_swap_problems(4, layout, 1, "parameters") == []
    assert blocks_to_swap_problems(2, layout, 2, "uniform") == []  # [0, 4, 7]: 2 blocks on each stage
    assert "smallest stage has 2" in blocks_to_swap_problems(3, layout, 2, "uniform")[0]
    # A parameter-balanced split is only known inside DeepSpeed: preflight refuses what no split allows.
    assert blocks_to_swap_problems(2, layout, 2, "parameters") == []
    assert "has at most 2 swappable" in blocks_to_swap_problems(3, layout, 2, "parameters")[0]


def test_a_negative_blocks_to_swap_is_refused_by_the_spec(fixture_paths, comfy_root, demo_cache, tmp_path):
    from pipetrainer.training.spec.choices import SpecError

    with pytest.raises(SpecError, match="blocks_to_swap must be >= 0"):  # -1 is auto (tests/test_memory_plan.py)
        make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run", comfy_root, blocks_to_swap=-2)


def test_swap_last_blocks_takes_the_last_swappable_layers_and_refuses_too_many(fixture_paths):
    _, layers = _stage_layers(fixture_paths)
    assert swappable_per_stage(layers, [0, len(layers)]) == [4]
    assert swap_last_blocks(layers, 0, "cpu") is None
    swapper = swap_last_blocks(layers, 2, "cpu", transfer=_copying_transfer)
    assert [b.module for b in swapper._blocks] == layers[3:5]
    swapper.detach()
    with pytest.raises(ValueError, match="maximum is 4"):
        swap_last_blocks(layers, 5, "cpu")


def _swap_run(fixture_paths, comfy_root, demo_cache, tmp_path, name, **train):
    spec = make_spec(fixture_paths.mmdit, demo_cache.items[:2], tmp_path / name, comfy_root, steps=3, **train)
    code, events = run_training(spec)
    assert code == 0, events[-3:]
    setup = next(e for e in events if e["type"] == "setup")
    return losses(events), load_file(spec.lora_output), setup["swapped_blocks_stage0"]


def test_one_stage_training_with_block_swap_is_bitwise_the_same(fixture_paths, comfy_root, demo_cache, tmp_path):
    base_losses, base_lora, none = _swap_run(fixture_paths, comfy_root, demo_cache, tmp_path, "noswap")
    swap_losses, swap_lora, swapped = _swap_run(fixture_paths, comfy_root, demo_cache, tmp_path, "swap",
                                                blocks_to_swap=2)
    assert none == [] and swapped == ["joint_blocks.2", "joint_blocks.3"]
    assert swap_losses == base_losses and len(base_losses) == 3
    assert swap_lora.keys() == base_lora.keys()
    assert all(torch.equal(swap_lora[k], base_lora[k]) for k in base_lora)


@pytest.mark.slow
def test_two_stages_with_block_swap_on_each_stage_are_bitwise_the_same(fixture_paths, comfy_root, demo_cache,
                                                                       tmp_path):
    base_losses, base_lora, _ = _swap_run(fixture_paths, comfy_root, demo_cache, tmp_path, "noswap2",
                                          pipeline_stages=2, partition_method="uniform")
    swap_losses, swap_lora, swapped = _swap_run(fixture_paths, comfy_root, demo_cache, tmp_path, "swap2",
                                                pipeline_stages=2, partition_method="uniform", blocks_to_swap=2)
    assert swapped == ["joint_blocks.0", "joint_blocks.1"]  # stage 0's share; stage 1 swaps blocks 2 and 3
    assert swap_losses == base_losses
    assert all(torch.equal(swap_lora[k], base_lora[k]) for k in base_lora)


def test_runs_with_and_without_block_swap_continue_each_other(fixture_paths, comfy_root, demo_cache, tmp_path):
    """blocks_to_swap only moves weights: it stays out of the training hash that resume matches on."""
    import dataclasses

    spec = make_spec(fixture_paths.mmdit, demo_cache.items[:1], tmp_path / "run", comfy_root)
    swapped = dataclasses.replace(spec, train=dataclasses.replace(spec.train, blocks_to_swap=3))
    assert swapped.training_hash() == spec.training_hash()
    assert type(spec).from_json(swapped.to_json()).train.blocks_to_swap == 3
