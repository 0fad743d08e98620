"""Stateless collectives over flat tensors, with per-op byte accounting.

Every function takes a ``World`` and an optional ``CommStats`` and returns a handle with
``wait()``, watched by the world's deadline ([Note: deadlines] in ``comm/deadline.py``: a
wait that fails raises ``DesyncError`` naming where every rank is). A world of one skips
the collective and returns a completed handle, so callers run the same code at every world
size.

Collectives are issued through the ``ProcessGroup``'s own methods rather than
``torch.distributed``'s wrappers, whose argument checks cost 20-30 us of host time a call
(measured in a stage-3 step of the small GPT on gloo, which issues about 20): only plain
tensors of a group this rank belongs to reach them.

Bytes are recorded two ways: ``payload`` is the size of the full (unsharded) tensor the
op works on, and ``wire`` is what one rank sends under the bandwidth-optimal ring
algorithm: all-reduce ``2 (N-1)/N B``, reduce-scatter and all-gather ``(N-1)/N B``,
broadcast ``B``.

The reasoning is in the notes below ([Note: comm bytes], ...)."""

# [Note: comm bytes]
#
# Stage 0 moves one all-reduce of the whole grad buffer (padding included) per optimizer step
# and nothing under ``no_sync``; ``tests/stages/test_wrap_behavior.py`` checks both against the
# layout. Stages 1 and 2 move, per step, one reduce-scatter of every grad bucket, one all-
# gather of every param bucket and one 8-byte all-reduce (the grad norm); wire bytes follow
# the formula of the implementation that ran (``CommStats.impls``):
# ``tests/optim/test_optimizer_behavior.py``.
#
# [Note: collective choice]
#
# Each backend has the implementation of reduce-scatter and all-gather that measured fastest
# on it (``IMPLS``, looked up for the backend that carries the bucket's device: a group made
# with ``"cpu:gloo,cuda:nccl"`` has one per device type, and gloo carries CUDA tensors too;
# the environment variables ``FLATSHARD_REDUCE_SCATTER`` and ``FLATSHARD_ALL_GATHER``
# override it). Every implementation takes the backend's per-op options, so each carries the
# world's deadline. On gloo, reduce-scatter is an all-to-all of the
# bucket's shards and a local sum up to 16 MiB and the same in all-to-alls of 8 MiB blocks
# above (so a reduce-scatter sends a ring's bytes at any bucket size, not an all-reduce's
# twice that), and all-gather is a broadcast per shard. Every implementation of an op leaves
# the same values; wire bytes follow the one that ran (``CommStats.impls``). The
# measurements behind the choice:
# ``benchmarks/README.md``.
#
# A whole-param bucket's shards differ in size ([Note: whole-param buckets] in
# ``planner/layout.py``): the caller passes every rank's size (``splits``). The all-to-all
# takes split sizes, the broadcasts and reduces one part per rank (an empty part is skipped
# on every rank alike), and an all-reduce any parts; the native ops, which take equal parts
# only, hand over to the all-to-all or the broadcasts (``UNEVEN``, also on NCCL).

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from flatshard.comm.trace import span
from flatshard.comm.world import AllgatherOptions, World


class Handle(Protocol):
    """What a collective returns (a torch ``Work``, or one of the classes below): ``wait()``
    finishes it; ``wait(timeout=...)`` raises ``RuntimeError`` if it is still in flight by
    then, and leaves it valid to wait again."""

    def wait(self, timeout: timedelta = ...) -> object: ...

    def is_completed(self) -> bool: ...


class _Done:
    """The handle of a collective that needed no communication."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE: Handle = _Done()


HOST_TO_DEVICE = "host_to_device"
DEVICE_TO_HOST = "device_to_host"
"""Copies over the host link of an offloaded rank, counted beside the collectives (their
bytes as payload; no wire bytes: [Note: memory tiers] in ``planner/offload.py``)."""


@dataclass
class CommStats:
    """Counts of collectives and the bytes they moved, per op name (and the copies over the
    host link, ``HOST_TO_DEVICE`` and ``DEVICE_TO_HOST``)."""

    calls: Counter[str] = field(default_factory=Counter)
    payload_bytes: Counter[str] = field(default_factory=Counter)
    wire_bytes: Counter[str] = field(default_factory=Counter)
    impls: dict[str, str] = field(default_factory=dict)  # op -> the implementation that ran

    def record(self, op: str, payload: int, wire: int, impl: str | None = None) -> None:
        self.calls[op] += 1
        self.payload_bytes[op] += payload
        self.wire_bytes[op] += wire
        if impl is not None:
            self.impls[op] = impl

    def reset(self) -> None:
        self.calls.clear()
        self.payload_bytes.clear()
        self.wire_bytes.clear()
        self.impls.clear()

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())

    @property
    def total_payload_bytes(self) -> int:
        return sum(self.payload_bytes.values())

    def as_dict(self) -> dict[str, dict[str, int | str]]:
        return {
            op: {
                "calls": self.calls[op],
                "payload_bytes": self.payload_bytes[op],
                "wire_bytes": self.wire_bytes[op],
                **({"impl": self.impls[op]} if op in self.impls else {}),
            }
            for op in sorted(self.calls)
        }


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(
    tensor: torch.Tensor,
    world: World,
    *,
    stats: CommStats | None = None,
    op: str = "sum",
    counted_as: str = "all_reduce",
) -> Handle:
    """Sum (or max, or min) ``tensor`` in place across ``world``; asynchronous. ``stats``
    counts it under ``counted_as`` (a purpose of its own, e.g. ``fp8_scales``)."""
    if world.group is None:
        return DONE
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    if stats is not None:
        b = _nbytes(tensor)
        stats.record(counted_as, b, 2 * (world.size - 1) * b // world.size)
    with span("all_reduce {:,} B", _nbytes(tensor)):
        return world.watch(_all_reduce(tensor, world, reduce_op), "all_reduce")


def all_reduce_max(tensor: torch.Tensor, world: World, *, stats: CommStats | None = None) -> None:
    """Max floating ``tensor`` in place across ``world``, and wait: NaN wherever any rank's is
    NaN, as ``torch.maximum`` gives. A backend's MAX alone does not: gloo's keeps a NaN only
    when it is the local operand, NCCL's (``fmax``) never, so one rank's NaN would vanish into
    the others' values. Each value rides with a NaN flag in the one all-reduce."""
    if world.group is None:
        return
    flat = tensor.reshape(-1)
    nan = flat.isnan()
    joined = torch.cat([flat.masked_fill(nan, -math.inf), nan.to(flat.dtype)])
    all_reduce(joined, world, stats=stats, op="max").wait()
    n = flat.numel()
    tensor.copy_(joined[:n].masked_fill(joined[n:] > 0, math.nan).view_as(tensor))


def broadcast(tensor: torch.Tensor, world: World, *, src: int = 0, stats: CommStats | None = None) -> Handle:
    """Copy rank ``src``'s ``tensor`` (a rank within ``world``) to every rank; asynchronous."""
    if world.group is None:
        return DONE
    if stats is not None:
        b = _nbytes(tensor)
        stats.record("broadcast", b, b if world.rank == src else 0)
    with span("broadcast {:,} B", _nbytes(tensor)):
        return world.watch(_broadcast(tensor, world, src), "broadcast")


def barrier(world: World) -> None:
    """Wait until every rank of ``world`` is here (within its deadline)."""
    if world.group is not None:
        world.watch(world.group.barrier(world.options(dist.BarrierOptions)), "barrier").wait()


def _all_reduce(tensor: torch.Tensor, world: World, op=dist.ReduceOp.SUM) -> Handle:
    opts = world.options(dist.AllreduceOptions)
    opts.reduceOp = op
    return world.pg.allreduce([tensor], opts)


def _broadcast(tensor: torch.Tensor, world: World, root: int) -> Handle:
    """From ``root``, a rank within ``world``."""
    opts = world.options(dist.BroadcastOptions)
    opts.rootRank, opts.rootTensor = root, 0
    return world.pg.broadcast([tensor], opts)


def _reduce(tensor: torch.Tensor, world: World, root: int) -> Handle:
    """Sum into ``root``'s ``tensor`` (a rank within ``world``)."""
    opts = world.options(dist.ReduceOptions)
    opts.rootRank, opts.rootTensor = root, 0
    return world.pg.reduce([tensor], opts)


Splits = Sequence[int] | None
"""Each rank's share of a bucket, in rank order, where the shares differ; None: equal."""


class _Group:
    """Several handles waited as one, then ``after()`` (e.g. copying a result into place)."""

    def __init__(self, handles: list[Handle], after=None) -> None:
        self.handles = handles
        self.after = after

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for h in self.handles:
            if deadline is None:
                h.wait()
            else:
                h.wait(timeout=_left(deadline))
        self.handles = []
        if self.after is not None:
            self.after()
            self.after = None
        return True


def _left(deadline: float) -> timedelta:
    """The time until ``deadline`` (``time.monotonic()``) as a ``wait()`` timeout: at least a
    millisecond, since a zero timeout would mean none."""
    return timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


def wait_until(handle: Handle, deadline: float) -> bool:
    """Block until ``handle`` completes or ``time.monotonic()`` reaches ``deadline``; whether it
    completed (``wait()`` still finishes it). For collectives the host sees complete (gloo;
    on CUDA a wait is a stream wait)."""
    if handle.is_completed():
        return True
    if deadline <= time.monotonic():
        return False
    try:
        handle.wait(timeout=_left(deadline))
    except RuntimeError:
        if handle.is_completed():  # it failed: the error is the collective's own
            raise
        return False  # it timed out, and is still in flight
    return True


SCATTER_IMPLS = ("reduce_scatter_tensor", "all_reduce", "reduce", "all_to_all", "chunked_all_to_all")
"""Ways to reduce-scatter: the native op, an all-reduce of the whole bucket (twice the wire
bytes), one reduce per shard to its owner, an all-to-all of the shards and a local sum, or
the same in all-to-alls of at most ``A2A_CHUNK`` bytes each, straight from the bucket's
rows (``benchmarks/collectives.py`` times them)."""
A2A_CHUNK = 8 * 2**20
"""Bytes one all-to-all of ``chunked_all_to_all`` moves at most (on gloo, 8 MiB blocks
measured 0.75-0.95x an all-reduce of 32-64 MiB buckets, 4 MiB ones about the same)."""
GATHER_IMPLS = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast")
"""Ways to all-gather a bucket in place from its shards."""
IMPLS: dict[str, dict[str, list[tuple[float, str]]]] = {
    # gloo, torch 2.13, 2 and 4 ranks (benchmarks/results/2026-11-22-collectives-*.json,
    # 2026-11-26-collectives-chunked-*.json): reduce_scatter_tensor takes 1.6-4x an all-reduce
    # of the same bucket; an all-to-all plus a local sum takes 0.44-0.93x up to 16 MiB and
    # 1.1-2x above, where all-to-alls of 8 MiB blocks take 0.72-0.95x (an all-reduce, which
    # sends twice the bytes, 0.9-1.1x). One broadcast per shard gathers in 0.3-0.9x an
    # all-reduce, the native all-gather in 0.7-1.9x.
    "gloo": {
        "reduce_scatter": [(16 * 2**20, "all_to_all"), (math.inf, "chunked_all_to_all")],
        "all_gather": [(math.inf, "broadcast")],
    },
    "default": {
        "reduce_scatter": [(math.inf, "reduce_scatter_tensor")],
        "all_gather": [(math.inf, "all_gather_into_tensor")],
    },
}
"""Per backend and op: (largest bucket in bytes, implementation), the first that fits."""


def choose_impl(world: World, op: str, nbytes: int, device: torch.device | None = None) -> str:
    """The implementation of ``op`` on a bucket of ``nbytes`` of ``device`` tensors, for the
    backend of ``world`` that carries them (a ``"cpu:gloo,cuda:nccl"`` group has one per
    device type; None: the host's); the environment variable ``FLATSHARD_REDUCE_SCATTER`` or
    ``FLATSHARD_ALL_GATHER`` overrides it."""
    override = os.environ.get(f"FLATSHARD_{op.upper()}")
    if override:
        return override
    backend = world.backend_for(device or torch.device("cpu"))
    return next(impl for limit, impl in IMPLS.get(backend, IMPLS["default"])[op] if nbytes <= limit)


def _own(tensor: torch.Tensor, shard: torch.Tensor, world: World, splits: Splits) -> tuple[int, ...]:
    """Check that ``shard`` is this rank's part of ``tensor``; the shards' sizes."""
    n = world.size
    sizes = tuple(splits) if splits is not None else (tensor.numel() // n,) * n
    if len(sizes) != n or sum(sizes) != tensor.numel() or shard.numel() != sizes[world.rank]:
        raise ValueError(
            f"a bucket of {tensor.numel()} elements does not split into {n} shards of "
            f"{list(sizes) if splits is not None else sizes[0]} with {shard.numel()} on rank {world.rank}"
        )
    offset = sum(sizes[: world.rank]) * tensor.element_size()
    if shard.numel() and shard.data_ptr() != tensor.data_ptr() + offset:
        raise ValueError(f"the shard of rank {world.rank} is not its own part of the bucket")
    return sizes


UNEVEN = {
    "reduce_scatter_tensor": "all_to_all",
    "all_gather_into_tensor": "broadcast",
    "all_gather": "broadcast",
}
"""What stands in for an implementation that takes only equal shards, on uneven ones."""


def _prepare(
    op: str, tensor: torch.Tensor, shard: torch.Tensor, world: World, impl: str | None, splits: Splits
) -> tuple[str, tuple[int, ...]]:
    sizes = _own(tensor, shard, world, splits)
    impl = impl or choose_impl(world, op, _nbytes(tensor), tensor.device)
    return (UNEVEN.get(impl, impl) if len(set(sizes)) > 1 else impl), sizes


def _record(stats: CommStats | None, op: str, tensor: torch.Tensor, world: World, impl: str) -> None:
    """Ring-formula wire bytes of the implementation that ran: ``(N-1)/N B``, twice that for
    an all-reduce standing in for a reduce-scatter or all-gather (on uneven shards, the mean
    over the ranks)."""
    if stats is not None:
        b, n = _nbytes(tensor), world.size
        stats.record(op, b, (2 if impl == "all_reduce" else 1) * (n - 1) * b // n, impl)


def reduce_scatter(
    tensor: torch.Tensor,
    shard: torch.Tensor,
    world: World,
    *,
    stats: CommStats | None = None,
    impl: str | None = None,
    splits: Splits = None,
) -> Handle:
    """Sum ``tensor`` (a bucket, 1-D) across ``world`` so that ``shard`` (this rank's part
    of it, a view) holds the sum; the rest of ``tensor`` is left unspecified. ``splits``:
    the size of each rank's part, in rank order, where they differ (None: equal parts)."""
    if world.group is None:
        return DONE
    impl, sizes = _prepare("reduce_scatter", tensor, shard, world, impl, splits)
    with span("reduce_scatter {:,} B ({})", _nbytes(tensor), impl):
        handle = _issue_reduce_scatter(tensor, shard, world, impl, sizes)
    _record(stats, "reduce_scatter", tensor, world, impl)
    return world.watch(handle, "reduce_scatter")


COALESCE_LIMIT = {"gloo": 512 * 2**10}
"""Per backend, the largest bucket (bytes) of a group ``reduce_scatter_coalesced`` packs
into one all-to-all; a group with a larger one runs one collective a bucket. On gloo (torch
2.13, 2 and 4 ranks; ``benchmarks/coalesced.py``, ``benchmarks/results/2026-11-26-
coalesced-*.json``) one all-to-all of 4 or 16 packed buckets of 16-256 KiB took 0.09-0.73x
the time of one collective a bucket, and of 1 MiB buckets 1.06-1.23x (gloo runs separate
collectives side by side, and the packing copies the group)."""


def reduce_scatter_coalesced(
    buckets: Sequence[tuple[torch.Tensor, torch.Tensor, Splits]],
    world: World,
    *,
    stats: CommStats | None = None,
    limit: float | None = None,
) -> Handle:
    """``reduce_scatter`` of several buckets (each ``(tensor, shard, splits)``) as one
    collective where the implementation is an all-to-all and no bucket is over the
    backend's ``COALESCE_LIMIT``: every rank's parts of all the buckets are packed into one
    segment per rank (a copy of the buckets), and what comes back is summed and unpacked
    into each ``shard``. Otherwise one collective a bucket, each chosen by its own size.
    ``limit``: bytes, instead of ``COALESCE_LIMIT`` (``benchmarks/coalesced.py``)."""
    if world.group is None:
        return DONE
    if len(buckets) == 1:
        return reduce_scatter(*buckets[0][:2], world, stats=stats, splits=buckets[0][2])
    sizes = [_own(tensor, shard, world, splits) for tensor, shard, splits in buckets]
    nbytes = sum(_nbytes(tensor) for tensor, _, _ in buckets)
    device = buckets[0][0].device
    impl = choose_impl(world, "reduce_scatter", nbytes, device)
    largest = max(_nbytes(tensor) for tensor, _, _ in buckets)
    limit = COALESCE_LIMIT.get(world.backend_for(device), 0) if limit is None else limit
    if impl not in ("all_to_all", "chunked_all_to_all") or largest > limit:
        handles = [reduce_scatter(t, s, world, stats=stats, splits=sp) for t, s, sp in buckets]
        return _Group(handles)
    n, rank = world.size, world.rank
    totals = tuple(sum(part[r] for part in sizes) for r in range(n))
    with span("reduce_scatter {:,} B in {} buckets ({})", nbytes, len(buckets), impl):
        pieces = [tensor.split(part) for (tensor, _, _), part in zip(buckets, sizes, strict=True)]
        packed = torch.cat([piece[r] for r in range(n) for piece in pieces])
        own = torch.empty(totals[rank], dtype=packed.dtype, device=packed.device)
        block = A2A_CHUNK if impl == "chunked_all_to_all" else _nbytes(packed)
        handle = _all_to_all(packed, own, world, totals, block)
    _record(stats, "reduce_scatter", packed, world, impl)

    def unpack() -> None:
        received = own.split([part[rank] for part in sizes])
        for (_, shard, _), values in zip(buckets, received, strict=True):
            shard.copy_(values)

    return world.watch(_Group([handle], unpack), "reduce_scatter")


def _issue_reduce_scatter(
    tensor: torch.Tensor, shard: torch.Tensor, world: World, impl: str, sizes: tuple[int, ...]
) -> Handle:
    group = world.pg
    if impl == "all_reduce":
        handle = _all_reduce(tensor, world)  # (the shard is a view: it holds its sum)
    elif impl == "reduce":
        handle = _Group([_reduce(c, world, r) for r, c in enumerate(tensor.split(sizes)) if c.numel()])
    elif impl == "all_to_all":
        handle = _all_to_all(tensor, shard, world, sizes, _nbytes(tensor))
    elif impl == "chunked_all_to_all":
        handle = _all_to_all(tensor, shard, world, sizes, A2A_CHUNK)
    elif impl == "reduce_scatter_tensor":
        out = torch.empty_like(shard)  # gloo does not take an output that aliases the input
        work = group._reduce_scatter_base(out, tensor, world.options(dist.ReduceScatterOptions))
        handle = _Group([work], lambda: shard.copy_(out))
    else:
        raise ValueError(f"unknown reduce-scatter implementation {impl!r}; known: {SCATTER_IMPLS}")
    return handle


def _all_to_all(
    tensor: torch.Tensor, shard: torch.Tensor, world: World, sizes: tuple[int, ...], block_bytes: int
) -> Handle:
    """All-to-alls of column blocks of the bucket's shards (each block: the same columns of
    every rank's shard, those a shorter shard has), each of at most ``block_bytes``; the
    blocks received (row r: rank r's part of this rank's shard) are summed into ``shard``
    once all have arrived. A block narrower than the bucket is copied out of it (the list
    form of all-to-all, which sends from the shards as they are, measured slower), so several
    blocks hold two bucket-sized temporaries in flight (sent and received), one block (the
    whole bucket, sent as it is) one. Every rank issues the same number of all-to-alls: the
    blocks are cut from the longest shard, which every rank knows."""
    n = world.size
    starts = [sum(sizes[:r]) for r in range(n)]
    width = max(1, block_bytes // (n * tensor.element_size()))
    works: list[Handle] = []
    blocks: list[tuple[torch.Tensor, int, int]] = []
    for lo in range(0, max(sizes), width):
        cut = [max(0, min(lo + width, size) - lo) for size in sizes]  # each shard's columns
        if lo == 0 and cut == list(sizes):
            sent = tensor  # one block: the bucket as it is
        else:
            sent = torch.cat([tensor[s + lo : s + lo + c] for s, c in zip(starts, cut, strict=True)])
        received = torch.empty(n * cut[world.rank], dtype=tensor.dtype, device=tensor.device)
        even = len(set(cut)) == 1
        splits_out, splits_in = ([], []) if even else ([cut[world.rank]] * n, cut)
        opts = world.options(dist.AllToAllOptions)
        works.append(world.pg.alltoall_base(received, sent, splits_out, splits_in, opts))
        blocks.append((received.view(n, cut[world.rank]), lo, lo + cut[world.rank]))

    def sum_blocks() -> None:
        for received, lo, hi in blocks:
            if hi > lo:
                sum_rows(received, shard[lo:hi])

    return _Group(works, sum_blocks)


def sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the sum of the rows of ``rows`` (2-D). Up to four rows as chained adds, which
    on CPU take a quarter (2 rows) to two thirds (4 rows) of ``torch.sum(dim=0)``'s time."""
    if len(rows) == 1 or len(rows) > 4:
        torch.sum(rows, dim=0, out=out)
        return
    torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)


def all_gather(
    tensor: torch.Tensor,
    shard: torch.Tensor,
    world: World,
    *,
    stats: CommStats | None = None,
    impl: str | None = None,
    splits: Splits = None,
) -> Handle:
    """Fill ``tensor`` (a bucket, 1-D) from every rank's ``shard`` (its own part of
    ``tensor``, a view; ``splits`` as in ``reduce_scatter``); in place. A gather by
    broadcasts is pipelined: each rank forwards n - 1 chunks, the wire bytes of a ring
    all-gather."""
    if world.group is None:
        return DONE
    impl, sizes = _prepare("all_gather", tensor, shard, world, impl, splits)
    with span("all_gather {:,} B ({})", _nbytes(tensor), impl):
        works = _issue_all_gather(tensor, shard, world, impl, sizes)
    _record(stats, "all_gather", tensor, world, impl)
    return world.watch(_Group(works), "all_gather")


def _issue_all_gather(
    tensor: torch.Tensor, shard: torch.Tensor, world: World, impl: str, sizes: tuple[int, ...]
) -> list[Handle]:
    group, n = world.pg, world.size
    works: list[Handle]
    if impl == "all_gather_into_tensor":
        works = [group._allgather_base(tensor, shard.clone(), world.options(AllgatherOptions))]
    elif impl == "all_gather":
        works = [group.allgather([list(tensor.chunk(n))], [shard.clone()], world.options(AllgatherOptions))]
    elif impl == "all_reduce":
        start = sum(sizes[: world.rank])
        tensor[:start].zero_()
        tensor[start + shard.numel() :].zero_()
        works = [_all_reduce(tensor, world)]
    elif impl == "broadcast":
        works = [_broadcast(part, world, r) for r, part in enumerate(tensor.split(sizes)) if part.numel()]
    else:
        raise ValueError(f"unknown all-gather implementation {impl!r}; known: {GATHER_IMPLS}")
    return works
