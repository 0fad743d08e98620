"""All-gathering updated params after a sharded optimizer step.

The reasoning is [Note: param gather] below."""

# [Note: param gather]
#
# At stages 1 and 2 a step updates only this rank's shard of each bucket's params; the rest
# of the param buffer is stale until the bucket is all-gathered. ``ParamGather`` launches one
# all-gather per bucket, in the order the next forward needs them (the bucket holding the
# first-registered param first), and waits for a bucket only where it is needed:
#
# * in a forward pre-hook of the outermost *block* (a child of an ``nn.ModuleList``: the
#   default units of ``units/unit_tree.py``, which ``shard()`` passes in) around a module
#   that owns (``recurse=False``) one of its params, or of that module itself when no block
#   holds it. Hooking the block rather than its layers keeps the waits on its edges, outside
#   a graph that ``block.compile()`` makes ([Note: hooks and torch.compile]);
# * in ``wait_all``: before the next step writes any shard, and before the module's
#   ``state_dict`` reads params.
#
# With ``overlap=False`` the step waits for every gather itself. Either way the values are
# the same: only when they are waited for differs.
#
# Buckets of weights gathered in fp8 (``MixedPrecision(fp8_gathers=True)``) send their fp8
# bytes and are decoded when waited for ([Note: fp8 gathers after the step] in
# ``engine/fp8_gathers.py``).

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from functools import partial

import torch
from torch import nn

from flatshard.comm.collectives import CommStats, Handle, all_gather
from flatshard.comm.deadline import HERE
from flatshard.engine.buffer import BufferSet, FlatBuffer
from flatshard.engine.dynamo import eager_pre_hook, whole_outside_graphs
from flatshard.engine.fp8_gathers import Fp8Scales
from flatshard.planner.layout import BucketLayout

MainFrame = Callable[[FlatBuffer], "torch.Tensor | None"]
"""A buffer's main params (its shard frame), where an optimizer keeps them."""


class ParamGather:
    """Bucket-by-bucket param all-gathers over the sharded buffers of one module."""

    def __init__(
        self,
        module: nn.Module,
        sets: Sequence[BufferSet],
        stats: CommStats,
        blocks: Sequence[nn.Module] = (),
        scales: Sequence[Fp8Scales | None] = (),
    ) -> None:
        """``blocks``: disjoint subtrees of ``module`` whose forward pre-hooks wait for the
        params inside them (the outermost units of ``units/unit_tree.py``); ``scales``: each
        set's weights gathered in fp8, if any ([Note: fp8 gathers after the step])."""
        self.stats = stats
        self.scales = [s for s in scales if s is not None]
        self._fp8 = {id(b): s for s in self.scales for b in s.buffers}  # (buffer id -> its scales)
        self._packed: dict[int, tuple[FlatBuffer, BucketLayout, torch.Tensor]] = {}  # (fp8 bytes in flight)
        order = {id(p): i for i, p in enumerate(module.parameters())}
        units = []  # (first use, buffer, bucket, world, its params)
        unit_of: dict[int, list[int]] = {}
        for buffer, world, params in ((b, s.world, s.params) for s in sets for b in s.buffers):
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
        waiter = _waiters(module, blocks)
        needed: dict[int, set[int]] = {}
        for submodule in module.modules():
            for p in submodule.parameters(recurse=False):
                needed.setdefault(id(waiter[id(submodule)]), set()).update(unit_of.get(id(p), []))
        self._hooks = []
        for m in module.modules():
            if needed.get(id(m)):
                hook = eager_pre_hook(partial(self._pre_forward, sorted(needed[id(m)])))
                self._hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
                whole_outside_graphs(m)

    def launch(self) -> None:
        """Start every bucket's all-gather (each rank's shard must be written first; the fp8
        weights' scales are taken from the shards first, one all-reduce a set)."""
        self.wait_all()
        for each in self.scales:
            each.refresh(lambda buffer, bucket: buffer.param_shard(bucket), self.stats)
        for index, (buffer, bucket, world) in enumerate(self.units):
            tensor, mine = buffer.param_range(bucket, bucket), buffer.param_shard(bucket)
            scales = self._fp8.get(id(buffer))
            if scales is not None:  # (its bytes, decoded into the buffer when waited for)
                packed = torch.empty(bucket.numel, dtype=torch.uint8, device=tensor.device)
                scales.encode(buffer, bucket, mine, buffer.own_part(packed, bucket))
                self._packed[index] = (buffer, bucket, packed)
                tensor, mine = packed, buffer.own_part(packed, bucket)
            self._pending[index] = all_gather(tensor, mine, world, stats=self.stats, splits=bucket.splits)

    def wait(self, units: Sequence[int]) -> None:
        for index in units:
            handle = self._pending.pop(index, None)
            if handle is not None:
                handle.wait()
            if index in self._packed:
                buffer, bucket, packed = self._packed.pop(index)
                self._fp8[id(buffer)].decode(buffer, bucket, packed, buffer.param_range(bucket, bucket))

    def exact_shards(self, main_frame: MainFrame) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's shards of the fp8-gathered buckets set to their main params rounded (the
        values of record in the param dtype, for a checkpoint to read); returns each shard
        with its fp8 values, to put back ([Note: fp8 gathers after the step])."""
        if not self.scales:
            return []
        self.wait_all()
        kept = []
        for scales in self.scales:
            for buffer in scales.buffers:
                main = main_frame(buffer)
                if main is None:
                    continue
                for bucket in buffer.layout.buckets:
                    frame, shard = buffer.frame_range(bucket), buffer.param_shard(bucket)
                    kept.append((shard, shard.clone()))
                    shard.copy_(main[frame.start : frame.end])
        return kept

    def fp8_values(self) -> set[str]:
        """The params that hold their fp8 values decoded between steps."""
        return {name for scales in self.scales for name in scales.names()}

    def recast(self, names: Collection[str]) -> None:
        """The fp8-gathered weights among ``names``, written whole on this rank, recast as a
        gather would ([Note: fp8 gathers after the step])."""
        for scales in self.scales:
            for buffer in scales.buffers:
                scales.recast(buffer, names)

    def wait_all(self) -> None:
        self.wait(sorted(self._pending))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _pre_forward(self, units: Sequence[int], module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._pending:
            HERE.forward()
            self.wait(units)


def _waiters(module: nn.Module, blocks: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """``{id(submodule): the module whose pre-hook waits for its params}``: the block
    holding it, or itself."""
    waiter = {id(m): m for m in module.modules()}
    for block in blocks:
        for m in block.modules():
            waiter[id(m)] = block
    return waiter
