"""Block swap: a block's frozen weights visit the compute device only while that block runs.

Why: the frozen base weights dominate a stage's GPU memory, while only one transformer block computes
at a time. Keeping the last N blocks' frozen parameters and buffers in host memory (pinned when the
compute device is CUDA, so copies are asynchronous) and loading each block just before its forward
trades PCIe bandwidth for memory. LoRA parameters (``requires_grad`` True) never move: the optimizer
and DeepSpeed hold them, and they are small.

Host copies: each block's frozen tensors are packed into one flat host buffer, of exactly their size,
as views (host_buffer.py), and that buffer is pinned in place when the compute device is CUDA;
``Tensor.pin_memory()`` per tensor would round every allocation up to a power of two. A tensor subclass
(ComfyUI-GGUF's ``GGMLTensor``, ComfyUI's ``QuantizedTensor``) is never pinned, moved or detached through
its own ops, which may drop its quantization state: its bytes (the plain tensors under it) go into the
same buffer, and a tensor of its exact type and state is rebuilt around those views and around each
device copy of them (subclass.py). One the swapper cannot rebuild is refused at ``attach``.

How: a forward pre-hook loads the block (on a side CUDA stream; the compute stream waits on an event,
and every loaded tensor is ``record_stream``-ed on the compute stream so the caching allocator does not
reuse its memory before the compute stream is done) and starts loading the next swapped block on the
side stream (prefetch). A forward post-hook (``always_call``, so it also runs when activation
checkpointing stops a recomputation early by raising) puts the host tensors back. Loading installs a
*new* ``nn.Parameter`` around the device copy instead of assigning ``.data``; offloading re-installs the
host one. Frozen weights never change, so nothing is copied back.

Backward: the engine checkpoints activations (torch non-reentrant checkpoint), so a block's forward
runs again inside backward; the same pre-hook loads it then, and the post-hook releases it after the
recomputation. The recomputed saved tensors are detached views of the device copy, so they keep that
copy's memory alive exactly until the block's backward has consumed them; then it is freed.

Without activation checkpointing autograd saves the device Parameters a block's ops need for backward.
Because loading installs fresh Parameters, those saved references keep the device copies alive (and
correct) until the block's backward: results stay right, but block swap then saves no GPU memory, only
costs transfers. The bookkeeping here (``resident``) counts what the swapper holds, not such copies.

On a CPU compute device the host is the compute device: swaps are cheap no-ops that keep the hooks and
the bookkeeping running, and results are bitwise the same as without block swap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .host_buffer import HostBuffer, is_packable
from .subclass import Rebuild, as_parameter, is_plain, split, unsupported_message

Transfer = Callable[[torch.Tensor, torch.device], torch.Tensor]
"""Copies a host tensor to the compute device (injectable: tests use a copy that is distinguishable on CPU)."""


@dataclass
class _Slot:
    """One frozen tensor of a block: where it is attached and its host copy."""

    owner: nn.Module
    name: str
    is_parameter: bool
    host: torch.Tensor  # an nn.Parameter (requires_grad False) for parameters


@dataclass
class _Block:
    position: int  # among the swapped blocks of this swapper, in forward order
    module: nn.Module
    slots: list[_Slot]
    loaded: list[torch.Tensor] = field(default_factory=list)  # device copies while resident
    ready: object | None = None  # a CUDA event marking the end of the copies (side stream)
    resident: bool = False
    running: bool = False


def frozen_slots(module: nn.Module) -> list[_Slot]:
    """The frozen parameters (``requires_grad`` False) and the buffers of ``module``, one slot each."""
    slots = []
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and not param.requires_grad:
                slots.append(_Slot(owner, name, True, param))
        for name, buf in owner._buffers.items():
            if buf is not None:
                slots.append(_Slot(owner, name, False, buf))
    return slots


def _install(slot: _Slot, tensor: torch.Tensor) -> None:
    if slot.is_parameter:
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
        slot.owner._parameters[slot.name] = tensor
    else:
        slot.owner._buffers[slot.name] = tensor


class BlockSwapper:
    """Keeps the frozen weights of ``blocks`` off the compute device except while each block runs.

    ``attach`` moves them to the offload device and registers the hooks; ``detach`` brings them back
    and removes the hooks. ``peak_resident`` is the most blocks ever held on the compute device at once
    (1 without prefetch, 2 with: the running block and the next one).
    """

    def __init__(self, blocks: Sequence[nn.Module], compute_device: torch.device | str, *,
                 offload_device: torch.device | str = "cpu", transfer: Transfer | None = None,
                 prefetch: bool | None = None, pin_memory: bool | None = None) -> None:
        self.compute_device = torch.device(compute_device)
        self.offload_device = torch.device(offload_device)
        cuda = self.compute_device.type == "cuda"
        self._transfer = transfer
        self._side_stream = torch.cuda.Stream(self.compute_device) if cuda and transfer is None else None
        self.prefetch = cuda if prefetch is None else prefetch
        self.pin_memory = (cuda and self.offload_device.type == "cpu") if pin_memory is None else pin_memory
        self._blocks = [_Block(i, m, []) for i, m in enumerate(blocks)]
        self._by_module = {id(b.module): b for b in self._blocks}
        self._handles: list[RemovableHandle] = []
        self.host_buffers: list[HostBuffer] = []  # one per block (flat, views installed in the modules)
        self._rebuilds: dict[int, tuple[list[torch.Tensor], Rebuild]] = {}  # id(subclass host) -> its pieces
        self._last_position: int | None = None
        self.peak_resident = 0
        self.loads = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def attach(self) -> BlockSwapper:
        """Move the blocks' frozen tensors to the offload device and start swapping."""
        hosts: dict[int, torch.Tensor] = {}  # shared tensors keep one host copy
        for block in self._blocks:
            block.slots = frozen_slots(block.module)
            self._pack_block(block.slots, hosts)
            for slot in block.slots:
                if id(slot.host) not in hosts:
                    hosts[id(slot.host)] = self._to_host(slot, block)
                slot.host = hosts[id(slot.host)]
                _install(slot, slot.host)
            self._handles.append(block.module.register_forward_pre_hook(self._before_forward))
            self._handles.append(block.module.register_forward_hook(self._after_forward, always_call=True))
        return self

    def detach(self) -> None:
        """Stop swapping: remove the hooks and put every frozen tensor back on the compute device."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        back: dict[int, torch.Tensor] = {}  # shared tensors stay shared
        for block in self._blocks:
            self._offload(block)
            for slot in block.slots:
                if id(slot.host) not in back:
                    parts = self._rebuilds.get(id(slot.host))
                    if parts is not None:
                        back[id(slot.host)] = self._rebuilt(parts, [p.to(self.compute_device) for p in parts[0]], slot)
                    else:
                        copy = _plain(slot.host, slot.is_parameter).to(self.compute_device)
                        back[id(slot.host)] = as_parameter(copy) if slot.is_parameter else copy
                _install(slot, back[id(slot.host)])
        self._sync()
        for packed in self.host_buffers:
            packed.release()

    def _pack_block(self, slots: list[_Slot], hosts: dict[int, torch.Tensor]) -> None:
        """Copy the block's frozen tensors into one flat host buffer (a subclass: the plain tensors under it);
        record each host tensor in ``hosts`` (by the id of the tensor it replaces): a view, or the subclass
        rebuilt around its views. Only for host offloading: other devices use ``_to_host``."""
        if self.offload_device.type != "cpu":
            return
        todo: dict[int, tuple[_Slot, tuple[list[torch.Tensor], Rebuild] | None]] = {}
        for slot in slots:
            if id(slot.host) in hosts or id(slot.host) in todo:
                continue
            if is_packable(slot.host):
                todo[id(slot.host)] = (slot, None)
            elif not is_plain(slot.host) and (parts := split(slot.host)) is not None:
                todo[id(slot.host)] = (slot, parts)
        if not todo:
            return
        tensors = [t for slot, parts in todo.values() for t in ([slot.host] if parts is None else parts[0])]
        packed = HostBuffer(tensors, pin=self.pin_memory)
        self.host_buffers.append(packed)
        views = iter(packed.views)
        for key, (slot, parts) in todo.items():
            if parts is None:
                view = next(views)
                hosts[key] = nn.Parameter(view, requires_grad=False) if slot.is_parameter else view
            else:
                hosts[key] = self._rebuilt(parts, [next(views) for _ in parts[0]], slot, record=True)

    def host_bytes(self) -> tuple[int, int]:
        """``(pinned bytes, weight bytes)`` of the host copies in flat buffers: pinned is 0 off CUDA."""
        pinned = sum(b.nbytes for b in self.host_buffers if b.pinned)
        return pinned, sum(b.weight_bytes for b in self.host_buffers)

    def _to_host(self, slot: _Slot, block: _Block) -> torch.Tensor:
        """A host copy of its own (not in a flat buffer); a subclass is rebuilt around host copies of its pieces."""
        if not is_plain(slot.host):
            parts = split(slot.host)
            if parts is None:
                owner = next((n for n, m in block.module.named_modules() if m is slot.owner), "")
                path = ".".join(p for p in (self._block_name(block), owner, slot.name) if p)
                raise ValueError(unsupported_message(path, slot.owner, slot.host))
            return self._rebuilt(parts, [self._host_copy(p) for p in parts[0]], slot, record=True)
        host = self._host_copy(slot.host.detach())
        return nn.Parameter(host, requires_grad=False) if slot.is_parameter else host

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.to(self.offload_device)
        if self.pin_memory and not host.is_pinned():
            host = host.pin_memory()
        return host

    def _rebuilt(self, parts: tuple[list[torch.Tensor], Rebuild], pieces: list[torch.Tensor], slot: _Slot,
                 record: bool = False) -> torch.Tensor:
        """The subclass rebuilt around ``pieces`` (a Parameter for a parameter slot); ``record``: a host copy,
        whose pieces the loads copy from."""
        tensor = parts[1](pieces)
        tensor = as_parameter(tensor) if slot.is_parameter else tensor
        if record:
            self._rebuilds[id(tensor)] = (pieces, parts[1])
        return tensor

    @staticmethod
    def _block_name(block: _Block) -> str:
        from ..model.partition import layer_name

        return layer_name(block.module)

    # ---- bookkeeping ------------------------------------------------------------------------------
    def resident(self) -> tuple[int, ...]:
        """Positions of the blocks whose frozen tensors are on the compute device now."""
        return tuple(b.position for b in self._blocks if b.resident)

    def block_names(self) -> list[str]:
        """The swapped blocks as ComfyUI module paths (or class names), for the run's setup event."""
        return [self._block_name(b) for b in self._blocks]

    def running(self) -> tuple[int, ...]:
        return tuple(b.position for b in self._blocks if b.running)

    def is_on_compute_copy(self, position: int) -> bool:
        """True when every frozen tensor of the block is its compute copy, not the host one."""
        block = self._blocks[position]
        return all(_current(slot) is not slot.host for slot in block.slots)

    # ---- hooks -------------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: object) -> None:
        block = self._by_module[id(module)]
        self._load(block)
        self._wait_ready(block)
        block.running = True
        direction = 1 if self._last_position is None or block.position > self._last_position else -1
        self._last_position = block.position
        if self.prefetch:
            self._prefetch(block.position + direction)

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        block = self._by_module[id(module)]
        block.running = False
        self._offload(block)

    # ---- moves -------------------------------------------------------------------------------------
    def _prefetch(self, position: int) -> None:
        """Start loading the block at ``position``; drop an earlier prefetch that was not used."""
        for other in self._blocks:
            if other.resident and not other.running and other.position != position:
                self._offload(other)
        if 0 <= position < len(self._blocks):
            self._load(self._blocks[position])

    def _load(self, block: _Block) -> None:
        if block.resident:
            return
        copies: dict[int, torch.Tensor] = {}
        block.loaded = []  # the plain device tensors (a subclass's pieces), for record_stream
        stream = self._side_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for slot in block.slots:
                if id(slot.host) in copies:
                    continue
                parts = self._rebuilds.get(id(slot.host))
                if parts is None:
                    copies[id(slot.host)] = self._copy(_plain(slot.host, slot.is_parameter))
                    block.loaded.append(copies[id(slot.host)])
                else:
                    pieces = [self._copy(p) for p in parts[0]]
                    block.loaded += pieces
                    copies[id(slot.host)] = self._rebuilt(parts, pieces, slot)
            if stream is not None:
                block.ready = torch.cuda.Event()
                block.ready.record(stream)
        installed: dict[int, torch.Tensor] = {}
        for slot in block.slots:
            if id(slot.host) not in installed:
                copy = copies[id(slot.host)]
                installed[id(slot.host)] = as_parameter(copy) if slot.is_parameter else copy
            _install(slot, installed[id(slot.host)])
        block.resident = True
        self.loads += 1
        self.peak_resident = max(self.peak_resident, len(self.resident()))

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        if self._transfer is not None:
            return self._transfer(host, self.compute_device)
        return host.to(self.compute_device, non_blocking=self._side_stream is not None)

    def _wait_ready(self, block: _Block) -> None:
        """Make the compute stream wait for the block's copies and own their memory while it uses them."""
        if block.ready is None:
            return
        compute = torch.cuda.current_stream(self.compute_device)
        compute.wait_event(block.ready)
        for tensor in block.loaded:
            tensor.record_stream(compute)
        block.ready = None

    def _offload(self, block: _Block) -> None:
        if not block.resident:
            return
        for slot in block.slots:
            _install(slot, slot.host)
        block.loaded = []
        block.ready = None
        block.resident = False

    def _sync(self) -> None:
        if self._side_stream is not None:
            self._side_stream.synchronize()


def _plain(tensor: torch.Tensor, is_parameter: bool) -> torch.Tensor:
    return tensor.detach() if is_parameter else tensor


def _current(slot: _Slot) -> torch.Tensor:
    return slot.owner._parameters[slot.name] if slot.is_parameter else slot.owner._buffers[slot.name]


def swap_last_blocks(layers: Sequence[nn.Module], blocks_to_swap: int, compute_device: torch.device | str,
                     **options: object) -> BlockSwapper | None:
    """Attach a :class:`BlockSwapper` to the last ``blocks_to_swap`` swappable layers (None when 0).

    ``layers`` are one stage's layers in forward order; a layer is swappable when its family adapter
    marks it (``StageLayer.swappable``). Raises if the stage has fewer swappable layers than asked.
    """
    from .placement import last_swappable

    blocks = last_swappable(layers, blocks_to_swap)
    return BlockSwapper(blocks, compute_device, **options).attach() if blocks else None
