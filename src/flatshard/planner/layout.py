"""The layout planner: where every parameter lives in flat buffers, buckets and shards.

The reasoning is in the notes below ([Note: layout], ...)."""

# [Note: layout]
#
# ``plan_layout`` is pure: it takes ``ParamSpec`` metadata and returns frozen data, with no
# tensors and no process group, so it is identical on every rank and cheap to test. Every
# other module reads offsets from it and never computes its own.
#
# Rules (after Megatron-Core's ``_ParamAndGradBuffer``):
#
# * one buffer per (param dtype, grad dtype, gather dtype), in first-seen registration order
#   (the gather dtype: fp8 for params gathered in fp8, [Note: fp8 gathers] in
#   ``engine/fp8_gathers.py``; None for the others); with ``buffer_per_unit``, one per
#   (those, stage-3 unit) ([Note: unit homes] in ``planner/offload.py``);
# * inside a buffer, params are laid out in *reverse* registration order, which is the order
#   in which backward produces their grads, so the first bucket is ready first;
# * a param is never split across buckets; a bucket closes as soon as it holds at least
#   ``bucket_size`` elements (``None``: one bucket per buffer); a param with
#   ``own_bucket=True`` sits alone in its bucket; a bucket also closes where the ``unit`` of
#   consecutive params changes, so a unit's params never share a bucket with another unit's;
# * when ``shard``: every param starts at a multiple of ``PARAM_ALIGN`` (64) elements and every
#   bucket's end is padded to a multiple of ``lcm(world_size, 128)`` (``lcm(world_size, 128,
#   2**16)`` with ``pad_for_high_busbw``), so each bucket splits into ``world_size`` equal
#   shards and each shard starts on a 128-element (256-byte for 16-bit) boundary.
#
# Invariants (tested property-based in ``tests/planning/test_layout.py``):
#
# 1. params of one buffer never overlap, and each lies inside exactly one bucket;
# 2. buckets tile their buffer: ``buckets[0].start == 0``, ``buckets[j].end ==
#    buckets[j + 1].start``, ``buckets[-1].end == buffer.numel``;
# 3. when ``shard``: param starts are multiples of 64 (of ``align`` if given) and bucket sizes of
#    ``pad_multiple`` (a whole-param bucket's shards: of ``BUCKET_ALIGN``); with ``align``, every
#    shard bound is a multiple of it ([Note: aligned shards]);
# 4. when ``shard``: every param element lies in exactly one rank's shard, and the four ranges
#    of a param in a shard describe the same elements (their sizes are equal and they map
#    into each other by the bucket start, the shard start and the param start);
# 5. when ``shard`` over more than one rank: in a bucket that holds a ``whole`` param, every
#    param lies whole in one rank's shard (see [Note: whole-param buckets]).
#
# [Note: whole-param buckets]
#
# A rule that updates a param as one matrix (Muon's orthogonalization, a factored second
# moment) needs all of it on one rank. A spec with ``whole=True`` makes its bucket a *whole-
# param bucket*: each of its params (the others too: they fill in) gets an owner rank, and
# each rank's shard is exactly its params, in buffer order, each at a multiple of
# ``PARAM_ALIGN``, the shard rounded up to ``BUCKET_ALIGN``. The shards of one bucket are of
# *uneven* size (``bucket.bounds``; a rank that owns nothing there has an empty shard), so a
# whole-param bucket is padded by alignment only, whatever its params and the world size.
# Owners are chosen once for every whole-param bucket of a buffer (``plan_owners``: largest
# first to the least-loaded rank, then moves and swaps while they lower the fullest rank), so
# the ranks' loads balance over the model even where one bucket holds fewer params than there
# are ranks (a stage-3 unit of four matrices over eight ranks); the loads carry over from one
# buffer to the next. The collectives take the uneven shards as they are (``splits`` in
# ``comm/collectives.py``: an all-to-all with split sizes, a broadcast per shard), so a bucket
# moves the bytes of its params and alignment, and each rank's share of a step's traffic
# follows its share of the params. Buckets close by the same rules as flat ones. Inside the
# bucket, params are no longer in reverse registration order (a bucket is reduced once all
# its grads are in, so the order inside it does not matter); ``bucket.params`` is still in
# buffer order.
#
# [Note: aligned shards]
#
# An optimizer that keeps its state in blocks (torchao's ``AdamW8bit``: one scale for each 256
# consecutive elements of a param, flattened) steps a rank's piece of a param exactly as one
# process steps the whole param only if no block spans two ranks. ``plan_layout(align=A)``
# (``Buckets(align=A)``, A a multiple of ``PARAM_ALIGN``) makes that hold for every block size
# dividing A: every param starts at a multiple of A, flat buckets are padded to a multiple of
# ``lcm(pad_multiple, world_size * A)`` so that each rank's shard is a multiple of A and starts
# at one (bucket starts are sums of such sizes), and whole-param buckets round each param and
# each rank's shard up to A (``lcm(BUCKET_ALIGN, A)``). So a shard bound inside a param falls at
# a multiple of A from the param's start. The padding costs at most A - 1 elements a param and
# ``world_size * A`` a bucket.
#
# The four ranges of a param in one rank's shard (all half-open ``[start, end)``):
#
# * ``in_buffer``: the elements' offsets in the flat buffer;
# * ``in_bucket``: the same, relative to the bucket's start;
# * ``in_shard``: the same, relative to the rank's shard start (where they sit in a shard
#   tensor such as a main-param shard);
# * ``in_param``: the same, relative to the param's own start (offsets into ``param.view(-1)``).
#
# Without ``shard`` (stage 0), a rank's "shard" of a bucket is the whole bucket on every rank.

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

PARAM_ALIGN = 64
"""Elements: every param of a sharded layout starts at a multiple of this."""
BUCKET_ALIGN = 128
"""Every bucket of a sharded layout ends at a multiple of lcm(world_size, this)."""
HIGH_BUSBW_ALIGN = 2**16


class Range(NamedTuple):
    """A half-open range ``[start, end)`` of elements."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def shift(self, offset: int) -> Range:
        """The same range seen from a frame that starts at ``offset``."""
        return Range(self.start - offset, self.end - offset)

    def intersect(self, other: Range) -> Range | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know of one parameter (no tensor).

    ``unit`` names the stage-3 gather unit the param belongs to (``None``: no unit
    boundary is imposed). ``whole``: a sharded layout keeps the param whole in one rank's
    shard ([Note: whole-param buckets]). ``gather_dtype``: the dtype its gathers send (an
    fp8 dtype: [Note: fp8 gathers]; None: its own).
    """

    name: str
    numel: int
    dtype: torch.dtype
    grad_dtype: torch.dtype
    own_bucket: bool = False
    unit: str | None = None
    whole: bool = False
    gather_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.numel <= 0:
            raise ValueError(f"ParamSpec {self.name!r}: numel must be positive, got {self.numel}")
        for field, value in (("dtype", self.dtype), ("grad_dtype", self.grad_dtype)):
            if not isinstance(value, torch.dtype):
                raise TypeError(f"ParamSpec {self.name!r}: {field} must be a torch.dtype, got {value!r}")


@dataclass(frozen=True)
class ParamSlot:
    """One param's place in its buffer: ``[start, end)`` in buffer elements."""

    name: str
    index: int  # position in the ``specs`` given to plan_layout (registration order)
    start: int
    end: int
    bucket: int

    @property
    def range(self) -> Range:
        return Range(self.start, self.end)

    @property
    def numel(self) -> int:
        return self.end - self.start


class ShardRanges(NamedTuple):
    """The four ranges of the part of a param that lies in one rank's shard."""

    name: str
    in_buffer: Range
    in_bucket: Range
    in_shard: Range
    in_param: Range


@dataclass(frozen=True)
class BucketLayout:
    index: int
    start: int
    end: int  # padded, exclusive
    numel_unpadded: int  # end of the last param minus start
    params: tuple[ParamSlot, ...]
    world_size: int
    sharded: bool
    whole: bool = False  # a whole-param bucket: each param in one rank's shard
    bounds: tuple[int, ...] | None = None
    """Where each rank's shard starts, relative to ``start``, then ``numel``: the uneven
    shards of a whole-param bucket; None: ``world_size`` equal shards (or, unsharded, the
    whole bucket on every rank)."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def range(self) -> Range:
        return Range(self.start, self.end)

    @property
    def shard_size(self) -> int:
        """The size of every rank's shard; of the largest in a whole-param bucket."""
        if self.bounds is not None:
            return max(self.splits or ())
        return self.numel // self.world_size if self.sharded else self.numel

    @property
    def splits(self) -> tuple[int, ...] | None:
        """The size of each rank's shard where they differ (a whole-param bucket), else None:
        what the collectives need to know of a bucket's shards beyond their own."""
        if self.bounds is None:
            return None
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))

    def shard_range(self, rank: int) -> Range:
        """This rank's shard of the bucket, in buffer offsets."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the layout's world of size {self.world_size}")
        if not self.sharded:
            return self.range
        if self.bounds is not None:
            return Range(self.start + self.bounds[rank], self.start + self.bounds[rank + 1])
        start = self.start + rank * self.shard_size
        return Range(start, start + self.shard_size)

    def owner(self, slot: ParamSlot) -> int | None:
        """The rank whose shard holds all of ``slot``; None where the slot is cut across
        shards, or where the bucket is not sharded (every rank holds all of it)."""
        if not self.sharded:
            return None
        if self.bounds is not None:
            first = bisect.bisect_right(self.bounds, slot.start - self.start) - 1
            return first if slot.end - self.start <= self.bounds[first + 1] else None
        first = (slot.start - self.start) // self.shard_size
        return first if (slot.end - 1 - self.start) // self.shard_size == first else None

    def local_ranges(self, rank: int) -> list[ShardRanges]:
        """The four ranges of every param with elements in ``rank``'s shard, in buffer order."""
        shard = self.shard_range(rank)
        out = []
        for slot in self.params:
            part = slot.range.intersect(shard)
            if part is None:
                continue
            out.append(
                ShardRanges(
                    slot.name,
                    in_buffer=part,
                    in_bucket=part.shift(self.start),
                    in_shard=part.shift(shard.start),
                    in_param=part.shift(slot.start),
                )
            )
        return out


@dataclass(frozen=True)
class BufferLayout:
    index: int
    dtype: torch.dtype
    grad_dtype: torch.dtype
    numel: int  # padded total
    buckets: tuple[BucketLayout, ...]
    gather_dtype: torch.dtype | None = None  # what its gathers send (None: ``dtype``)
    unit: str | None = None  # its params' one stage-3 unit, where each unit has buffers of its own

    @property
    def params(self) -> Iterator[ParamSlot]:
        for bucket in self.buckets:
            yield from bucket.params

    @property
    def numel_unpadded(self) -> int:
        """Elements that belong to params (alignment gaps and end padding excluded)."""
        return sum(slot.numel for slot in self.params)

    def shard_numel(self, rank: int = 0) -> int:
        """Elements of this buffer held in ``rank``'s shards (padding included)."""
        return sum(b.shard_range(rank).size for b in self.buckets)


@dataclass(frozen=True)
class Layout:
    world_size: int
    sharded: bool
    bucket_size: int | None
    pad_multiple: int
    buffers: tuple[BufferLayout, ...]

    def slot(self, name: str) -> tuple[BufferLayout, ParamSlot]:
        """The buffer and slot of the param called ``name``."""
        for buffer in self.buffers:
            for slot in buffer.params:
                if slot.name == name:
                    return buffer, slot
        raise KeyError(f"no param named {name!r} in this layout")

    def param_ranges(self, name: str, rank: int) -> ShardRanges | None:
        """The four ranges of ``name`` in ``rank``'s shard, or None if none of it is there."""
        buffer, slot = self.slot(name)
        for ranges in buffer.buckets[slot.bucket].local_ranges(rank):
            if ranges.name == name:
                return ranges
        return None

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    def __str__(self) -> str:
        return format_layout(self)


def pad_multiple(world_size: int, *, pad_for_high_busbw: bool = False) -> int:
    """The multiple every sharded bucket's size is padded to."""
    multiple = math.lcm(world_size, BUCKET_ALIGN)
    return math.lcm(multiple, HIGH_BUSBW_ALIGN) if pad_for_high_busbw else multiple


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_layout(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    bucket_size: int | None = None,
    shard: bool = True,
    pad_for_high_busbw: bool = False,
    align: int | None = None,
    buffer_per_unit: bool = False,
) -> Layout:
    """Plan buffers, buckets and shards for ``specs`` (given in module registration order).
    ``align``: a multiple of ``PARAM_ALIGN`` at which params start and shards are cut
    ([Note: aligned shards]); None: the default alignment. ``buffer_per_unit``: each stage-3
    unit's params get buffers of their own, so that each unit's shards can have their own
    home ([Note: unit homes] in ``planner/offload.py``).

    See [Note: layout] at the top of this module for the rules and invariants.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements or None, got {bucket_size}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"param name {dup!r} appears more than once in specs")
    if align is not None and (align < 1 or align % PARAM_ALIGN):
        raise ValueError(f"align must be a positive multiple of {PARAM_ALIGN} elements, got {align}")
    multiple = pad_multiple(world_size, pad_for_high_busbw=pad_for_high_busbw)
    if align is not None:
        multiple = math.lcm(multiple, world_size * align)
    step = align or PARAM_ALIGN
    groups: dict[tuple[torch.dtype, torch.dtype, torch.dtype | None, str | None], list[int]] = {}
    for i, spec in enumerate(specs):
        unit = spec.unit if buffer_per_unit else None
        groups.setdefault((spec.dtype, spec.grad_dtype, spec.gather_dtype, unit), []).append(i)
    buffers = []
    loads = [0] * world_size  # of whole-param buckets, carried from buffer to buffer
    for b, ((dtype, grad_dtype, gather_dtype, unit), indices) in enumerate(groups.items()):
        ordered = [specs[i] for i in reversed(indices)]
        grouped = _group_buckets(ordered, list(reversed(indices)), bucket_size, shard, step)
        buckets = _place_buckets(grouped, shard, multiple, world_size, loads, step)
        end = buckets[-1].end
        buffers.append(BufferLayout(b, dtype, grad_dtype, end, tuple(buckets), gather_dtype, unit))
    return Layout(world_size, shard, bucket_size, multiple if shard else 1, tuple(buffers))


def balance(sizes: Sequence[int], ranks: int, loads: list[int] | None = None) -> list[int]:
    """An owner rank for each of ``sizes``: the largest first, each to the rank whose load is
    smallest (the lowest rank on a tie). ``loads`` (one per rank, default zeros) is the
    load each rank starts with, and is updated in place. The same on every rank: the
    ownership planner of ``OwnerShardedOptimizer``, and the first pass of ``plan_owners``."""
    loads = [0] * ranks if loads is None else loads
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (loads[r], r))
        loads[owners[i]] += sizes[i]
    return owners


def plan_owners(sizes: Sequence[int], ranks: int, loads: list[int] | None = None) -> list[int]:
    """``balance``, then while one exists the move of a param off the fullest rank, or swap
    of a param there for a smaller one elsewhere, that leaves both ranks below the fullest
    load (the one that leaves the lower pair; the first on a tie). Every step lowers the
    fullest load or the number of ranks at it, so it ends; the same on every rank. ``loads`` as in
    ``balance``, updated in place."""
    loads = [0] * ranks if loads is None else loads
    owners = balance(sizes, ranks, loads)
    while (step := _best_step(sizes, owners, loads)) is not None:
        top, rank, i, j = step
        moved = sizes[i] - (0 if j is None else sizes[j])
        owners[i], loads[top], loads[rank] = rank, loads[top] - moved, loads[rank] + moved
        if j is not None:
            owners[j] = top
    return owners


def _best_step(
    sizes: Sequence[int], owners: list[int], loads: list[int]
) -> tuple[int, int, int, int | None] | None:
    """The move or swap of ``plan_owners`` that leaves the lowest pair of loads: (the
    fullest rank, the other rank, the param it gives, the param it takes or None)."""
    ranks, top_load = len(loads), max(loads)
    by_size: list[dict[int, int]] = [{} for _ in range(ranks)]  # rank -> size -> a param
    for i, (size, owner) in enumerate(zip(sizes, owners, strict=True)):
        by_size[owner].setdefault(size, i)
    best, step = top_load, None
    for top in (r for r in range(ranks) if loads[r] == top_load):
        for rank in (r for r in range(ranks) if r != top):
            for a, i in by_size[top].items():
                for b, j in [(0, None), *by_size[rank].items()]:
                    pair = max(loads[top] - a + b, loads[rank] + a - b)
                    if b < a and pair < best:
                        best, step = pair, (top, rank, i, j)
    return step


class _Pending(NamedTuple):
    spec: ParamSpec
    position: int  # (in registration order)


def _group_buckets(
    specs: list[ParamSpec], indices: list[int], bucket_size: int | None, shard: bool, step: int
) -> list[list[_Pending]]:
    """Cut ``specs`` (already in buffer order) into the params of consecutive buckets."""
    buckets: list[list[_Pending]] = []
    pending: list[_Pending] = []
    cursor = 0  # elements of the open bucket, laid out in order with alignment gaps
    for spec, index in zip(specs, indices, strict=True):
        if pending and (spec.own_bucket or spec.unit != pending[-1].spec.unit):
            buckets.append(pending)
            pending, cursor = [], 0
        pending.append(_Pending(spec, index))
        cursor = (_round_up(cursor, step) if shard else cursor) + spec.numel
        if spec.own_bucket or (bucket_size is not None and cursor >= bucket_size):
            buckets.append(pending)
            pending, cursor = [], 0
    if pending:
        buckets.append(pending)
    return buckets


def _place_buckets(
    grouped: list[list[_Pending]], shard: bool, multiple: int, world_size: int, loads: list[int], step: int
) -> list[BucketLayout]:
    """Place the buckets one after another: whole-param buckets by owner, with owners
    planned over all of them at once ([Note: whole-param buckets]), the rest flat."""
    by_owner = [shard and world_size > 1 and any(p.spec.whole for p in params) for params in grouped]
    owned = [p for params, w in zip(grouped, by_owner, strict=True) if w for p in params]
    owners = iter(plan_owners([_round_up(p.spec.numel, step) for p in owned], world_size, loads))
    buckets: list[BucketLayout] = []
    for params, whole in zip(grouped, by_owner, strict=True):
        start = buckets[-1].end if buckets else 0
        if whole:
            ranks = [next(owners) for _ in params]
            buckets.append(_place_by_owner(params, ranks, len(buckets), start, world_size, step))
        else:
            buckets.append(_place(params, len(buckets), start, shard, multiple, world_size, step))
    return buckets


def _place(
    pending: list[_Pending], index: int, start: int, shard: bool, multiple: int, world_size: int, step: int
) -> BucketLayout:
    """A bucket of ``pending`` params one after another, as flat shards cut it."""
    slots, cursor = [], start
    for p in pending:
        param_start = _round_up(cursor, step) if shard else cursor
        slots.append(ParamSlot(p.spec.name, p.position, param_start, param_start + p.spec.numel, index))
        cursor = param_start + p.spec.numel
    # (a size, not an offset, is padded: after a whole-param bucket a start is a multiple of
    # BUCKET_ALIGN only)
    end = start + _round_up(cursor - start, multiple) if shard else cursor
    return BucketLayout(index, start, end, cursor - start, tuple(slots), world_size, shard)


def _place_by_owner(
    pending: list[_Pending], owners: list[int], index: int, start: int, world_size: int, step: int
) -> BucketLayout:
    """A whole-param bucket: each rank's shard its params ([Note: whole-param buckets])."""
    slots, cursor, bounds = [], start, [0]
    for rank in range(world_size):
        for p in (p for p, owner in zip(pending, owners, strict=True) if owner == rank):
            slots.append(ParamSlot(p.spec.name, p.position, cursor, cursor + p.spec.numel, index))
            cursor = _round_up(cursor + p.spec.numel, step)
        cursor = _round_up(cursor, math.lcm(BUCKET_ALIGN, step))
        bounds.append(cursor - start)
    unpadded = max(slot.end for slot in slots) - start
    return BucketLayout(
        index, start, cursor, unpadded, tuple(slots), world_size, True, whole=True, bounds=tuple(bounds)
    )


def format_layout(layout: Layout) -> str:
    """A readable table of buffers, buckets, params and padding."""
    kind = f"sharded over {layout.world_size} ranks" if layout.sharded else "replicated (unsharded)"
    lines = [f"Layout: {len(layout.buffers)} buffer(s), {layout.numel:,} elements, {kind}"]
    for buf in layout.buffers:
        pad = buf.numel - buf.numel_unpadded
        gathered = "" if buf.gather_dtype is None else f", gathered in {_dtype_name(buf.gather_dtype)}"
        lines.append(
            f"buffer {buf.index}: param {_dtype_name(buf.dtype)}, grad {_dtype_name(buf.grad_dtype)}"
            f"{gathered}, {buf.numel:,} elements ({pad:,} padding)"
        )
        lines.append(f"  {'bucket':>6} {'start':>12} {'end':>12} {'unpadded':>12} {'shard':>10}  params")
        for bucket in buf.buckets:
            whole = "  (whole params)" if bucket.whole else ""
            lines.append(
                f"  {bucket.index:>6} {bucket.start:>12,} {bucket.end:>12,} {bucket.numel_unpadded:>12,}"
                f" {bucket.shard_size:>10,}  {len(bucket.params)}{whole}"
            )
            for slot in bucket.params:
                owner = f"  (rank {bucket.owner(slot)})" if bucket.whole else ""
                where = f"{slot.start:>12,} {slot.end:>12,} {slot.numel:>12,}"
                lines.append(f"  {'':>6} {where} {'':>10}  {slot.name}{owner}")
    return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
