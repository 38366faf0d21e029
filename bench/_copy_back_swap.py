"""Block swap with H2D-only off: each block's weights are copied back to the host after every use.

PipeTrainer's ``BlockSwapper`` is host-to-device only: the pinned host copy is the master, frozen
weights never change, so releasing a block just drops its device copy. A swapper that treats the
device copy as the master (one that moves a block back with ``.to("cpu")`` after use; issue #9 cites
about 25 % of musubi-tuner's step time saved by dropping that) also copies every block device-to-host
after each use. This variant adds exactly that copy, and nothing else, so the benchmark shows what
H2D-only saves here. The copy runs on the swapper's side stream once the compute stream is done with
the block (the stream that also loads the next blocks, so both directions share it, as in a
single-stream swap), into the pinned host tensors that the next load reads. On CPU the "device copy"
is the host tensor itself, so the copy back is a no-op there.

It reaches into ``BlockSwapper``'s internals (``_blocks``, each block's ``slots`` and ``loaded``, the
``_offload`` / ``_sync`` steps): the device copies are made in ``_load`` one per distinct host tensor,
in slot order, which :func:`_hosts` follows.
"""

from __future__ import annotations

import torch
from pipetrainer.training.offload.block_swap import BlockSwapper


def _hosts(block) -> list[torch.Tensor]:
    """The block's distinct host tensors in the order ``BlockSwapper._load`` made their device copies."""
    seen: dict[int, torch.Tensor] = {}
    for slot in block.slots:
        seen.setdefault(id(slot.host), slot.host)
    return [t.detach() for t in seen.values()]


class CopyBackSwapper(BlockSwapper):
    """A :class:`BlockSwapper` that writes each block's device copies back to the host before releasing them."""

    copies_back = 0

    def detach(self) -> None:
        """Release the resident blocks and let their copies back finish before the host tensors are read."""
        for block in self._blocks:
            self._offload(block)
        self._sync()
        super().detach()

    def _offload(self, block) -> None:
        if block.resident and block.loaded:
            self._copy_back(_hosts(block), block.loaded)
        super()._offload(block)

    def _copy_back(self, hosts: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
        if len(hosts) != len(copies):
            raise RuntimeError("BlockSwapper's per-block state changed shape; update bench/_copy_back_swap.py.")
        stream = self._side_stream
        if stream is None:  # CPU (or an injected transfer): plain copies, in order
            for host, copy in zip(hosts, copies, strict=True):
                host.copy_(copy)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.compute_device))
            with torch.cuda.stream(stream):
                for host, copy in zip(hosts, copies, strict=True):
                    host.copy_(copy, non_blocking=True)
                    copy.record_stream(stream)
        self.copies_back += 1
