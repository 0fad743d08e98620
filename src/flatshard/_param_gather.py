"""All-gathering updated params after a sharded optimizer step.

[Note: param gather]

At stages 1 and 2 a step updates only this rank's shard of each bucket's params; the rest
of the param buffer is stale until the bucket is all-gathered. ``ParamGather`` launches one
all-gather per bucket, in the order the next forward needs them (the bucket holding the
first-registered param first), and waits for a bucket only where it is needed:

* in a forward pre-hook of every module that owns (``recurse=False``) one of its params;
* in ``wait_all``: before the next step writes any shard, and before the module's
  ``state_dict`` reads params.

With ``overlap=False`` the step waits for every gather itself. Either way the values are
the same: only when they are waited for differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from torch import nn

from flatshard._buffer import FlatBuffer
from flatshard._collectives import CommStats, Handle, all_gather
from flatshard._world import World


class ParamGather:
    """Bucket-by-bucket param all-gathers over the sharded buffers of one module."""

    def __init__(
        self,
        module: nn.Module,
        buffers: Sequence[tuple[FlatBuffer, World, Sequence[nn.Parameter]]],
        stats: CommStats,
    ) -> None:
        self.stats = stats
        order = {id(p): i for i, p in enumerate(module.parameters())}
        units = []  # (first use, buffer, bucket, world, its params)
        unit_of: dict[int, list[int]] = {}
        for buffer, world, params in buffers:
            if world.size == 1:
                continue
            for bucket in buffer.layout.buckets:
                first = min(order[id(params[slot.index])] for slot in bucket.params)
                units.append((first, buffer, bucket, world, [params[slot.index] for slot in bucket.params]))
        units.sort(key=lambda unit: unit[0])
        self.units = [(buffer, bucket, world) for _, buffer, bucket, world, _ in units]
        for index, (*_, params) in enumerate(units):
            for p in params:
                unit_of.setdefault(id(p), []).append(index)
        self._pending: dict[int, Handle] = {}
        self._hooks = []
        for submodule in module.modules():
            needed = sorted({u for p in submodule.parameters(recurse=False) for u in unit_of.get(id(p), [])})
            if needed:
                self._hooks.append(submodule.register_forward_pre_hook(partial(self._pre_forward, needed)))

    def launch(self) -> None:
        """Start every bucket's all-gather (each rank's shard must be written first)."""
        self.wait_all()
        for index, (buffer, bucket, world) in enumerate(self.units):
            tensor = buffer.param_range(bucket, bucket)
            self._pending[index] = all_gather(tensor, buffer.param_shard(bucket), world, stats=self.stats)

    def wait(self, units: Sequence[int]) -> None:
        for index in units:
            handle = self._pending.pop(index, None)
            if handle is not None:
                handle.wait()

    def wait_all(self) -> None:
        self.wait(sorted(self._pending))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _pre_forward(self, units: Sequence[int], module: nn.Module, args: object) -> None:
        if self._pending:
            self.wait(units)
