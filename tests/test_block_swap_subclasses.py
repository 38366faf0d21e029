"""Block swap over tensor-subclass weights: a quantized weight keeps its exact type and state, in the block's one buffer.

ComfyUI-GGUF's ``GGMLTensor`` (a ``torch.Tensor`` subclass whose quantization type, logical shape and patches
are instance attributes) comes back from ``pin_memory()`` without them, and its layer then reads the
quantized bytes as plain weights; ComfyUI's ``QuantizedTensor`` (a wrapper subclass around fp8 data and a
scale) dequantizes on the ops it does not handle. The swapper must hold each such weight's host copy in the
block's single flat host buffer and hand the layer, on the host and on the compute device, a tensor of the
same type with the same state.

``Nibbles`` behaves as GGMLTensor does: two 4-bit codes per stored byte; ``tensor_type``, ``tensor_shape``
and ``patches`` on the instance; ``shape`` is the logical shape; ``detach`` and ``clone`` return the tensor
itself; everything else goes through torch's default ``__torch_function__``, whose results (``pin_memory()``
included) are new instances without the attributes. ``Nibbles.to`` carries them as GGMLTensor's does;
``DroppingNibbles`` keeps the default ``to``, which drops them. Their layer, like ComfyUI-GGUF's, reads a
weight without ``tensor_type`` as plain weights, which fails on the byte shape.

CPU cannot pin memory: pinning itself runs only where CUDA is (the ``cuda`` case, skipped elsewhere); on CPU
the subclasses' lossy methods stand for it, and the ``meta`` compute device takes the swapper's own
``.to(device)`` path. The real ComfyUI ``QuantizedTensor`` goes through the swap on the tiny MMDiT's
per-layer-quantized file, real GGMLTensors when ``COMFYUI_GGUF_PATH`` points at a ComfyUI-GGUF checkout.
"""

from __future__ import annotations

import enum
import functools
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from pipetrainer.devkit import quant_fixtures
from pipetrainer.tests.quant_helpers import bits, model_inputs, random_batch, with_lora
from pipetrainer.training.adapters.inject import freeze_all_but_lora
from pipetrainer.training.model.model_source import load_model
from pipetrainer.training.offload.block_swap import BlockSwapper
from pipetrainer.training.pipelines.base import Batch
from pipetrainer.training.spec.options import LoraSpec, ModelRecipe
from torch import nn
from torch.utils._pytree import tree_map

GGUF_PATH = os.environ.get("COMFYUI_GGUF_PATH", "")
SCALE = 0.05


class QType(enum.IntEnum):
    Q4 = 2


class Nibbles(torch.Tensor):
    """Stands for GGMLTensor (see the module docstring)."""

    keeps_to = True

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Nibbles:
        codes = (weight / SCALE).round().clamp(-8, 7).to(torch.int16) + 8
        t = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).as_subclass(cls)
        t.tensor_type, t.tensor_shape, t.patches = QType.Q4, weight.shape, []
        return t

    def to(self, *args, **kwargs):
        new = super().to(*args, **kwargs)
        if type(self).keeps_to:
            new.tensor_type = getattr(self, "tensor_type", None)
            new.tensor_shape = getattr(self, "tensor_shape", new.data.shape)
            new.patches = getattr(self, "patches", []).copy()
        return new

    def detach(self, *args, **kwargs):
        return self

    def clone(self, *args, **kwargs):
        return self

    @property
    def shape(self):
        if not hasattr(self, "tensor_shape"):
            self.tensor_shape = self.size()
        return self.tensor_shape


class DroppingNibbles(Nibbles):
    keeps_to = False


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    raw = weight.as_subclass(torch.Tensor)
    if getattr(weight, "tensor_type", None) is None:  # as ComfyUI-GGUF: no type means plain weights
        return raw.to(dtype)
    return (torch.stack([raw & 15, raw >> 4], dim=-1).reshape(weight.tensor_shape).to(dtype) - 8) * SCALE


class NibbleLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, x.dtype), self.bias)


class Block(nn.Module):
    """Quantized Linears (one weight tied to a second layer), a frozen norm, a buffer and a trainable Linear."""

    def __init__(self, cls: type[Nibbles], seed: int, lora: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = NibbleLinear(cls.quantize(torch.randn(32, 16, generator=g) * 0.2), torch.randn(32, generator=g))
        self.down = NibbleLinear(cls.quantize(torch.randn(16, 32, generator=g) * 0.2), torch.randn(16, generator=g))
        self.gate = NibbleLinear(self.up.weight, torch.randn(32, generator=g))  # the same Parameter as up's
        self.norm = nn.LayerNorm(16).requires_grad_(False)
        self.register_buffer("offset", torch.randn(16, generator=g))
        self.lora = nn.Linear(16, 16, bias=False) if lora else None
        if lora:
            nn.init.normal_(self.lora.weight, 0, 0.1, generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.offset)
        out = x + self.down(F.silu(self.up(h)) * self.gate(h))
        return out + self.lora(x) if self.lora is not None else out


def _copying_transfer(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.clone()


def _frozen(block: nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: p for n, p in block.named_parameters() if not p.requires_grad}, **dict(block.named_buffers())}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _state(block: Block) -> dict[str, tuple]:
    """``name -> (type, tensor_type, tensor_shape, patches, raw bytes)`` of the block's quantized weights."""
    return {n: (type(w), w.tensor_type, tuple(w.tensor_shape), list(w.patches), w.as_subclass(torch.Tensor).clone())
            for n, w in ((n, getattr(block, n).weight) for n in ("up", "down", "gate"))}


def _assert_state(block: Block, expected: dict[str, tuple]) -> None:
    for name, (cls, kind, shape, patches, raw) in expected.items():
        w = getattr(block, name).weight
        assert type(w) is cls and getattr(w, "tensor_type", None) == kind, (name, type(w))
        assert tuple(w.tensor_shape) == shape and w.patches == patches, name
        assert isinstance(w, nn.Parameter) and not w.requires_grad, name
        assert w.is_meta or torch.equal(w.as_subclass(torch.Tensor).cpu(), raw), name
    assert block.up.weight is block.gate.weight


def _step(blocks: list[Block]):
    """Forward and backward through the blocks under non-reentrant checkpoint (as the engine runs a stage)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    out = x
    for block in blocks:
        out = torch.utils.checkpoint.checkpoint(block, out, use_reentrant=False)
    (out ** 2).mean().backward()
    grads = [b.lora.weight.grad.clone() for b in blocks]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("cls", [Nibbles, DroppingNibbles], ids=["to-keeps-attributes", "to-drops-attributes"])
def test_subclass_weights_keep_type_and_state_and_live_in_the_blocks_one_buffer(cls):
    blocks = [Block(cls, seed) for seed in range(3)]
    ref_out, ref_grads = _step(blocks)
    swapped = blocks[1:]
    expected = [_state(b) for b in swapped]
    swapper = BlockSwapper(swapped, "cpu", transfer=_copying_transfer).attach()
    assert len(swapper.host_buffers) == len(swapped)  # one flat buffer per block, subclass weights included
    hosts = [_frozen(b) for b in swapped]
    for block, state, packed, host in zip(swapped, expected, swapper.host_buffers, hosts, strict=True):
        _assert_state(block, state)
        assert len(host) == 8 and all(_storage(t) == _storage(packed.buffer) for t in host.values())
    inside: list[int] = []

    def check(module, args, position):
        _assert_state(module, expected[position])  # the compute copy: same type and state
        assert not any(_storage(t) == _storage(swapper.host_buffers[position].buffer) for t in _frozen(module).values())
        inside.append(position)

    handles = [b.register_forward_pre_hook(functools.partial(check, position=i)) for i, b in enumerate(swapped)]
    for _ in range(2):
        out, grads = _step(blocks)
        assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
        for block, host in zip(swapped, hosts, strict=True):  # back on the host copies
            assert all(_frozen(block)[n] is t for n, t in host.items())
    assert inside.count(0) == inside.count(1) == 4  # forward and recomputation, two steps
    for h in handles:
        h.remove()
    swapper.detach()
    for block, state in zip(swapped, expected, strict=True):
        _assert_state(block, state)
    out, _ = _step(blocks)
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="pinning host memory needs CUDA"))])
@pytest.mark.parametrize("cls", [Nibbles, DroppingNibbles], ids=["to-keeps-attributes", "to-drops-attributes"])
def test_subclass_weights_reach_the_compute_device_with_their_state(cls, device):
    """The swapper's own copy path (no injected transfer): ``meta`` stands for a GPU on CPU machines; on
    CUDA the host buffer is pinned and the subclass weights are views into it, still of their type."""
    blocks = [Block(cls, seed, lora=False) for seed in range(2)]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = blocks[1](blocks[0](x))
    expected = [_state(b) for b in blocks]
    swapper = BlockSwapper(blocks, device).attach()
    seen: list[torch.device] = []

    def check(module, args, position):
        _assert_state(module, expected[position])
        seen.extend(t.device for t in _frozen(module).values())

    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(functools.partial(check, position=i))
    with torch.no_grad():
        out = blocks[1](blocks[0](x.to(device)))
    assert out.device.type == device and out.shape == ref.shape
    assert len(seen) == 16 and {d.type for d in seen} == {device}
    if device == "cuda":
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    assert len(swapper.host_buffers) == 2
    for block, packed in zip(blocks, swapper.host_buffers, strict=True):
        assert all(_storage(t) == _storage(packed.buffer) for t in _frozen(block).values())
    if device == "cuda":
        assert swapper.host_bytes()[0] == sum(b.nbytes for b in swapper.host_buffers) > 0
        assert all(t.is_pinned() for b in blocks for t in _frozen(b).values())
    for block, state in zip(blocks, expected, strict=True):
        _assert_state(block, state)
        assert all(t.device.type == "cpu" for t in _frozen(block).values())
    swapper.detach()  # back on the compute device, still of their type (and the host buffers unpinned)
    for block, state in zip(blocks, expected, strict=True):
        _assert_state(block, state)
        assert all(t.device.type == device for t in _frozen(block).values())


class Wrapped(torch.Tensor):
    """A wrapper subclass around an inner tensor without torch's ``__tensor_flatten__`` protocol: the
    swapper cannot know what it holds, so it must refuse it rather than copy it through its own ops."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(a):
            return a.inner if isinstance(a, Wrapped) else a

        if func is torch.ops.aten.detach.default:
            return Wrapped(args[0].inner.detach())
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_subclass_the_swapper_cannot_rebuild_is_refused_with_the_layer_named():
    block = nn.Sequential(nn.Linear(2, 2))
    block[0].weight = nn.Parameter(Wrapped(torch.eye(2)), requires_grad=False)
    with pytest.raises(ValueError, match=r"0\.weight.*Wrapped.*blocks_to_swap"):
        BlockSwapper([block], "cpu").attach()
    assert type(block[0].weight) is Wrapped


# ---- the real quantized tensors: ComfyUI's QuantizedTensor, ComfyUI-GGUF's GGMLTensor ------------------

LORA = LoraSpec(rank=4, alpha=4.0, targets="all_linear")


def _swap_matches_the_unswapped_stage(patcher, type_name: str, pieces, same) -> list[dict[str, torch.Tensor]]:
    """Swap the last two blocks of the tiny MMDiT's stage (copying transfer): the forward and the LoRA
    grads are bitwise those without swap; every frozen tensor's bytes (``pieces``) lie in its block's one
    buffer; each quantized weight (of ``type_name``) has its bytes and its state (``same(original, now)``)
    on the host and while its block runs."""
    adapter, layers, stage = with_lora(patcher, LORA)
    freeze_all_but_lora(stage)
    noisy, timestep, cond, pooled = model_inputs(patcher.model, *random_batch(tokens=8))
    inputs = adapter.first_stage_inputs(Batch(noisy, timestep, cond, pooled, options=adapter.options_type()))

    def step():
        out = inputs
        for _, layer in layers:
            out = layer(out)
        out = out if isinstance(out, torch.Tensor) else out[0]
        (out.float() ** 2).mean().backward()
        grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
        stage.zero_grad(set_to_none=True)
        return out.detach(), grads

    ref_out, ref_grads = step()
    blocks = [layer for _, layer in layers if layer.swappable][-2:]
    quantized = [{n: t for n, t in _frozen(b).items() if type(t).__name__ == type_name} for b in blocks]
    assert all(len(q) >= 5 for q in quantized)
    raw = [{n: bits(t).clone() for n, t in q.items()} for q in quantized]

    def check(now: dict[str, torch.Tensor], position: int) -> None:
        for n, original in quantized[position].items():
            assert type(now[n]) is type(original) and same(original, now[n]), n
            assert isinstance(now[n], nn.Parameter) and not now[n].requires_grad, n
            assert torch.equal(bits(now[n]).cpu(), raw[position][n]), n

    swapper = BlockSwapper(blocks, "cpu", transfer=_copying_transfer).attach()
    assert len(swapper.host_buffers) == 2
    hosts = [_frozen(b) for b in blocks]
    for position, (host, packed) in enumerate(zip(hosts, swapper.host_buffers, strict=True)):
        check(host, position)
        assert all(_storage(p) == _storage(packed.buffer) for t in host.values() for p in pieces(t))
    running = []

    def inside(module, args, position):
        now = _frozen(module)
        check(now, position)
        assert not any(_storage(p) == _storage(swapper.host_buffers[position].buffer)
                       for t in now.values() for p in pieces(t))
        running.append(position)

    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(functools.partial(inside, position=i))
    out, grads = step()
    assert running == [0, 1] and torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    assert all(_frozen(b)[n] is t for b, host in zip(blocks, hosts, strict=True) for n, t in host.items())
    return hosts


def test_comfyui_quantized_tensors_swap_in_the_blocks_one_buffer(fixture_paths, tmp_path):
    """ComfyUI's per-layer quantization (``QuantizedTensor``: fp8 ``_qdata`` and a float32 scale)."""
    path = quant_fixtures.write_per_layer(fixture_paths.mmdit, tmp_path / "mmdit-per-layer.safetensors")
    patcher = load_model(ModelRecipe("diffusion_model", str(path), "default"), "fp32")

    def state(t):
        """The inner tensors and the context of torch's flatten protocol, which ComfyUI's QuantizedTensor
        implements on every host (its private attributes differ: ``_layout_params`` on 0.3.75, ``_params``
        in comfy-kitchen)."""
        names, ctx = t.__tensor_flatten__()
        return {n: getattr(t, n) for n in names}, ctx

    def pieces(t):
        return list(state(t)[0].values()) if type(t).__name__ == "QuantizedTensor" else [t]

    def same(original, now):
        (a, a_ctx), (b, b_ctx) = state(original), state(now)
        return (type(now) is type(original) and a_ctx == b_ctx and a.keys() == b.keys()
                and now._qdata.dtype == torch.float8_e4m3fn and now.dtype == original.dtype
                and all(torch.equal(v, b[k].cpu()) for k, v in a.items()))

    _swap_matches_the_unswapped_stage(patcher, "QuantizedTensor", pieces, same)


@pytest.mark.skipif(not GGUF_PATH or not Path(GGUF_PATH, "ops.py").is_file(),
                    reason="set COMFYUI_GGUF_PATH to a checkout of github:city96/ComfyUI-GGUF")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_tensors_swap_in_the_blocks_one_buffer_with_their_type(fixture_paths, tmp_path, qtype):
    import gguf

    path = quant_fixtures.write_gguf(fixture_paths.mmdit, tmp_path / f"mmdit-{qtype}.gguf", qtype)
    patcher = load_model(ModelRecipe("gguf", str(path), extension_path=GGUF_PATH), "bf16")
    kind = gguf.GGMLQuantizationType[qtype]

    def same(original, now):
        return (now.tensor_type == original.tensor_type and now.tensor_shape == original.tensor_shape
                and now.patches == original.patches)

    hosts = _swap_matches_the_unswapped_stage(patcher, "GGMLTensor", lambda t: [t], same)
    assert all(sum(getattr(t, "tensor_type", None) == kind for t in host.values()) >= 5 for host in hosts)
