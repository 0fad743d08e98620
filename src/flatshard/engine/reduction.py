"""Reductions: consecutive buckets of one buffer whose grads are reduced together.

The reasoning is [Note: sharded grads] below."""

# [Note: sharded grads]
#
# How a group's grads live, by stage (the buffer's layout and ``full_grads`` tell which):
#
# * **replicated** (stage 0): ``grad`` is the group's range of the grad buffer; one all-reduce
#   leaves the same sum on every rank.
# * **sharded** (stage 1): the same range, but each bucket is *reduce-scattered*: afterwards
#   only this rank's shard of each bucket is defined, and the optimizer reads only that. The
#   rest of the range is *stale*; it is zeroed lazily (``begin``) before the next backward
#   accumulates into it, so a second synced backward adds only new grads to the shard.
# * **scratch** (stage 2): there is no grad buffer. ``begin`` takes the group's range as
#   scratch from a small ``ScratchPool`` and points each param's ``main_grad`` into it; after
#   the reduction the shard is added into the bucket's grad shard (copied, into storage
#   allocated then, for the first backward after ``zero_grad``, which frees it) and the
#   scratch goes back to the pool (``main_grad``
#   becomes None), where a later group of the same backward may reuse it; the pool is
#   emptied when the backward ends. So between backwards grads exist only as shards. Reused
#   scratch is not cleared: a param's first
#   grad is copied in (not added), unused params are zeroed before the reduction, and
#   ``begin`` zeroes the alignment gaps and padding, so nothing stale is ever reduced.
#
# A group of several buckets is reduce-scattered by one collective where that measured faster
# (gloo, buckets of up to ``COALESCE_LIMIT``: ``reduce_scatter_coalesced`` packs every rank's
# parts of the buckets into one all-to-all), and by one collective a bucket otherwise.
#
# With a replicate world (replicated sharding), buckets are laid out and reduce-scattered over
# the shard world, and once a group's reduce-scatter is done its shards are all-reduced
# across the replicate world (every group's all-reduce is launched before any is waited).
# Params are gathered over the shard world only, and the grad norm is summed over it alone,
# since the replicas hold equal shards.
#
# With a ``reduce_dtype`` (``MixedPrecision.reduce_dtype``) that differs from the grad dtype,
# the collectives run on a copy in that dtype, multiplied by ``post`` ([``split_scale``]);
# the result is copied back (divided by ``post``) into the reduced part of ``grad`` before
# anything reads it, so accumulation stays in the grad dtype.
#
# In the sharded and scratch modes grads are scaled as they are accumulated
# (``main_grad += scale * grad``), so a shard that already holds a reduced sum is carried
# into the next reduction as it is, whatever the scale.

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from flatshard.comm.collectives import (
    DEVICE_TO_HOST,
    CommStats,
    Handle,
    all_reduce,
    reduce_scatter_coalesced,
    wait_until,
)
from flatshard.comm.world import ONE, World
from flatshard.engine.buffer import FlatBuffer, FlatParam
from flatshard.engine.lifecycle import ReductionState, advance
from flatshard.engine.tensor_parallel import local_shape
from flatshard.planner.layout import BucketLayout, Range
from flatshard.planner.mixed_precision import split_scale

FIRST_PAUSE = 2e-5
LONGEST_PAUSE = 2.5e-4
"""Seconds between polls of a reduction in ``wait_reduced`` on NCCL, doubling from the first
(short: the wait usually ends within a few milliseconds, and a longer pause would add to it)."""


class ScratchPool:
    """Stage-2/3 scratch released during a backward, for the next groups to reuse (on CPU,
    freshly mapped memory costs a page fault per 4 KiB). Holds at most ``capacity``, and
    nothing once a group needs a size it does not hold."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: list[torch.Tensor] = []
        self.alive_bytes = 0  # scratch in use or pooled
        self.peak_bytes = 0  # the most ever alive at once

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, t in enumerate(self.free):
            if t.numel() == numel and t.dtype == dtype and t.device == device:
                return self.free.pop(i)
        self.clear()  # none fits: what the pool holds would only add to the peak
        tensor = torch.empty(numel, dtype=dtype, device=device)
        self.alive_bytes += tensor.numel() * tensor.element_size()
        self.peak_bytes = max(self.peak_bytes, self.alive_bytes)
        return tensor

    def give(self, tensor: torch.Tensor) -> None:
        self.free.append(tensor)
        if len(self.free) > self.capacity:
            self._drop(self.free.pop(0))

    def clear(self) -> None:
        """Drop every pooled tensor (at the end of a backward)."""
        while self.free:
            self._drop(self.free.pop())

    def _drop(self, tensor: torch.Tensor) -> None:
        self.alive_bytes -= tensor.numel() * tensor.element_size()


class Reduction:
    """Consecutive buckets of one ``FlatBuffer``, reduced over ``world`` as one unit.

    The group is *complete* in a backward once every one of its params has had its grad
    accumulated (see [Note: grad sync]); ``start_sync`` launches its reduction.
    """

    def __init__(
        self,
        index: int,
        buffer: FlatBuffer,
        buckets: Sequence[BucketLayout],
        params: Sequence[FlatParam],
        names: Sequence[str],
        world: World,
        scale: float,
        stats: CommStats,
        pool: ScratchPool | None = None,
        replicate: World = ONE,
        reduce_dtype: torch.dtype | None = None,
        launch: int | None = None,
    ) -> None:
        self.index = index
        self.launch = index if launch is None else launch  # its launch ([Note: grad sync])
        self.buffer = buffer
        self.buckets = tuple(buckets)
        self.params = tuple(params)
        self.names = tuple(names)
        self.world = world
        self.scale = scale
        self.stats = stats
        self.sharded = buffer.layout.buckets[0].sharded
        self.start = self.buckets[0].start
        self.numel = self.buckets[-1].end - self.start
        # 1D group range; None for scratch between backwards
        self.grad: torch.Tensor | None = (
            buffer.grad_range(self.buckets[0], self.buckets[-1]) if buffer.full_grads else None
        )
        self.pool = pool or ScratchPool(0)
        self.replicate = replicate
        self.reduce_dtype = None if reduce_dtype == buffer.layout.grad_dtype else reduce_dtype
        self._post = split_scale(scale, self.reduce_dtype)
        self._low: torch.Tensor | None = None  # the reduce-dtype copy while it is reduced
        self._slots = [slot for bucket in self.buckets for slot in bucket.params]
        ends = [self.start] + [slot.end for slot in self._slots]
        starts = [slot.start for slot in self._slots] + [self.buckets[-1].end]
        # alignment gaps and padding, relative to the group's start
        self._gaps = [(e - self.start, s - self.start) for e, s in zip(ends, starts, strict=True) if s > e]
        self._shard_fresh = True  # stage 2: grad shards hold nothing since zero_grad
        self._ids = frozenset(id(p) for p in self.params)
        self._pending: set[int] = set(self._ids)
        self._handles: list[Handle] = []  # the collectives of the reduction in flight
        self._stale = False
        self.state = ReductionState.COLLECTING  # [Note: lifecycles]

    def _move(self, new: ReductionState) -> None:
        self.state = advance(self.state, new, f"reduction {self.index}")

    @property
    def complete(self) -> bool:
        return not self._pending

    @property
    def launched(self) -> bool:
        """Whether this backward's reduction has started (a grad arriving now is too late)."""
        return self.state is not ReductionState.COLLECTING

    @property
    def in_flight(self) -> bool:
        return self.state in (ReductionState.REDUCING, ReductionState.REPLICATING)

    def is_ready(self, param: nn.Parameter) -> bool:
        return id(param) not in self._pending

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Record that ``param``'s grad is final for this backward; True once all are."""
        self._pending.discard(id(param))
        return not self._pending

    @property
    def live_grad(self) -> torch.Tensor:
        """``grad`` while the group holds one (a full buffer's range, or scratch from ``begin``
        until it is released)."""
        if self.grad is None:
            raise RuntimeError("a reduction's grads were read before begin() took its scratch")
        return self.grad

    def pending_params(self) -> list[tuple[str, FlatParam]]:
        """Params that got no grad in this backward (unused in forward), in buffer order."""
        return [(n, p) for n, p in zip(self.names, self.params, strict=True) if id(p) in self._pending]

    # -- grad storage ------------------------------------------------------------------------
    def begin(self) -> bool:
        """Make ``grad`` ready to accumulate into; True if it had to allocate scratch."""
        if self.grad is None:
            buffer = self.buffer
            self.grad = self.pool.take(self.numel, buffer.layout.grad_dtype, buffer.device)
            for lo, hi in self._gaps:
                self.grad[lo:hi].zero_()
            for slot, param in zip(self._slots, self.params, strict=True):
                shape = local_shape(param)  # ([Note: tensor-parallel params])
                param.main_grad = self.grad[slot.start - self.start : slot.end - self.start].view(shape)
            return True
        if self._stale:
            for bucket in self.buckets:
                shard = self.buffer.shard_range(bucket)
                self.grad[bucket.start - self.start : shard.start - self.start].zero_()
                self.grad[shard.end - self.start : bucket.end - self.start].zero_()
            self._stale = False
        return False

    def release(self) -> None:
        """Give stage-2 scratch back to the pool; ``main_grad`` becomes None."""
        if self.buffer.full_grads or self.grad is None:
            return
        self.pool.give(self.grad)
        self.grad = None
        for param in self.params:
            param.main_grad = None

    def zero_grad(self) -> None:
        """Forget every grad: drop scratch, stale ranges, and what the shards hold."""
        self.release()
        self._stale = False
        self._shard_fresh = True

    # -- reduction ---------------------------------------------------------------------------
    def start_sync(self) -> None:
        if self.launched:
            raise RuntimeError(f"reduction {self.index} was launched twice in one backward")
        self._move(ReductionState.REDUCING)
        self.begin()
        data = self._reduced_data()
        if not self.sharded:
            self._handles = [all_reduce(data, self.world, stats=self.stats)]
            return
        buckets = []
        for bucket in self.buckets:
            shard = self.buffer.shard_range(bucket)
            tensor = data[bucket.start - self.start : bucket.end - self.start]
            own = data[shard.start - self.start : shard.end - self.start]
            buckets.append((tensor, own, bucket.splits))
        self._handles = [reduce_scatter_coalesced(buckets, self.world, stats=self.stats)]

    def _reduced_data(self) -> torch.Tensor:
        """What the collectives run on: ``grad``, or its copy in ``reduce_dtype``."""
        grad = self.live_grad
        if self.reduce_dtype is None:
            return grad
        low = grad * self._post if self._post != 1.0 else grad
        self._low = low.to(self.reduce_dtype)
        return self._low

    def _own_ranges(self) -> list[Range]:
        """Where this rank's reduced values sit, relative to the group's start."""
        if not self.sharded:
            return [Range(0, self.numel)]
        return [self.buffer.shard_range(b).shift(self.start) for b in self.buckets]

    def _copy_back(self) -> None:
        if self._low is None:
            return
        grad = self.live_grad
        for lo, hi in self._own_ranges():
            grad[lo:hi].copy_(self._low[lo:hi])
            if self._post != 1.0:
                grad[lo:hi].div_(self._post)
        self._low = None

    def replicate_shards(self) -> None:
        """Replicated sharding: once the reduce-scatter is done, all-reduce this rank's shards
        over the replicate world (launched; ``finish_sync`` waits)."""
        if self.state is not ReductionState.REDUCING or self.replicate.size == 1:
            return
        for handle in self._handles:
            handle.wait()
        data = self.live_grad if self._low is None else self._low
        self._handles = [
            all_reduce(data[lo:hi], self.replicate, stats=self.stats) for lo, hi in self._own_ranges()
        ]
        self._move(ReductionState.REPLICATING)

    def reduced(self) -> bool:
        """Whether ``finish_sync`` would return without waiting for another rank (with a
        replicate world, launches the cross-replica reduction once the shards are reduced)."""
        if not self.in_flight:
            return True
        if not all(h.is_completed() for h in self._handles):
            return False
        if self.replicate.size > 1 and self.state is ReductionState.REDUCING:
            self.replicate_shards()
            return all(h.is_completed() for h in self._handles)
        return True

    def wait_reduced(self, timeout: float) -> bool:
        """Wait on the host for ``reduced`` at most ``timeout`` seconds; whether it came true
        (a wait that can give up, where another rank might never launch its part). Where the
        backend finishes collectives on the host (gloo, on CPU or CUDA tensors) it blocks on
        them with a deadline; on NCCL, where a wait only orders streams, it polls."""
        deadline = time.monotonic() + timeout
        if self.in_flight and self.world.completes_on_host(self.buffer.device):
            return self._block_until_reduced(deadline)
        pause = FIRST_PAUSE
        while not self.reduced():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_PAUSE)
        return True

    def _block_until_reduced(self, deadline: float) -> bool:
        """Block on the reduction, then on the cross-replica one, until ``deadline``. A handle
        waited for counts as done whatever its ``is_completed()`` says (gloo's reduce-scatter
        of CUDA tensors never says so)."""
        while all(wait_until(h, deadline) for h in self._handles):
            if self.state is ReductionState.REPLICATING or self.replicate.size == 1:
                return True
            self.replicate_shards()
        return False

    def finish_sync(self) -> None:
        """Wait for the reduction; fold stage-2 shards into the grad shards."""
        if not self.in_flight:
            return
        self.replicate_shards()
        for handle in self._handles:
            handle.wait()
        self._handles = []
        self._move(ReductionState.REDUCED)
        self._copy_back()
        if not self.sharded:
            return
        if self.buffer.full_grads:
            self._stale = True
            return
        for bucket in self.buckets:
            shard = self.buffer.shard_range(bucket)
            reduced = self.live_grad[shard.start - self.start : shard.end - self.start]
            if self.buffer.grads_on_host:  # (down the host link: [Note: memory tiers])
                self.stats.record(DEVICE_TO_HOST, reduced.numel() * reduced.element_size(), 0)
            if self._shard_fresh:  # (its storage may have been freed by zero_grad)
                target = self.buffer.allocate_grad_shard(bucket)
                target.copy_(reduced, non_blocking=target.is_pinned())  # (waited for: wait_for_host_grads)
            else:
                target = self.buffer.grad_shard(bucket)
                target.add_(reduced.to(target.device))
        self._shard_fresh = False
        self.release()

    def reset(self) -> None:
        """Start a new backward: nothing ready, nothing launched."""
        self._pending = set(self._ids)
        self._handles = []
        self._move(ReductionState.COLLECTING)  # (from any state: a backward that raised is left behind)

    def __repr__(self) -> str:
        buckets = ",".join(str(b.index) for b in self.buckets)
        return (
            f"Reduction({self.index}, buffer={self.buffer.layout.index}, buckets=[{buckets}], {self.world})"
        )


def wait_for_host_grads(reductions: Sequence[Reduction]) -> None:
    """At the end of a synced backward: wait for every copy of a reduced grad shard down to
    its home on the host, queued as each reduction finished ([Note: memory tiers] in
    ``planner/offload.py``), before anything reads them. One wait a backward, not one a bucket:
    the backward's kernels are queued meanwhile."""
    devices = {
        r.buffer.device for r in reductions if r.buffer.grads_on_host and r.buffer.device.type == "cuda"
    }
    for device in devices:
        torch.cuda.synchronize(device)
