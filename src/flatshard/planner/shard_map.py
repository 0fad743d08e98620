"""Which flat tensors the inner optimizer of ``DistributedOptimizer`` steps.

The reasoning is [Note: optimizer runs] below."""

# [Note: optimizer runs]
#
# The inner torch optimizer does not see one tensor per model param. It sees *runs*: maximal
# stretches of one bucket's shard (for this rank) whose params all belong to the same param
# group. A run also covers the alignment gaps and padding next to its params, so with one
# param group every bucket shard that holds any param is exactly one run, and the optimizer
# does one pass per bucket shard instead of a Python loop over params.
#
# This is exact for *elementwise* update rules (SGD, Adam, AdamW, Adagrad, RMSprop, ...):
# each element's update depends only on that element's param, grad and state. Padding and
# gaps hold zero params and zero grads, which these rules keep at zero, and nothing reads
# them as data. Rules that look at a whole tensor (Adafactor's factored moments, Muon's
# orthogonalization) would see flat pieces of params: their params are *whole-param runs*
# instead, one per param, shaped as the param (it must lie whole in the shard: [Note:
# whole-param buckets] in ``layout.py``), so the inner optimizer sees real matrices.
#
# Rules (``plan_runs``, tested in ``tests/planning/test_shard_map.py``):
#
# 1. runs of one bucket are disjoint, in order, and inside the bucket's shard;
# 2. every element of an optimized param in the shard lies in exactly one run, the run of
#    its param's group; no element of a param outside every group lies in a run;
# 3. a run starts at the shard's start or at the start of its first param's piece (or where
#    the previous piece of an unoptimized param ended), and ends at the start of the next
#    run, at the start of an unoptimized piece, or at the shard's end;
# 4. a param given a shape is a run of its own, exactly its elements (no gap or padding),
#    with that shape; the flat runs stop at its start and go on after its end;
# 5. a param named in ``pieces`` is a run of its own in every shard that holds part of it,
#    exactly that part, flat (shape ``(size,)``): an optimizer whose state is kept in blocks
#    of a param's consecutive elements ([Note: blockwise state] in ``optim/blockwise.py``)
#    sees each rank's part of the param alone, never glued to its neighbours.

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import NamedTuple

from flatshard.planner.layout import BufferLayout, Range, ShardRanges


class Run(NamedTuple):
    """One tensor of the inner optimizer: a range of one bucket's shard."""

    bucket: int
    group: int  # index of the param group
    in_shard: Range  # offsets relative to the start of the bucket's shard
    shape: tuple[int, ...] | None = None  # a whole-param run's param shape; None: a flat run

    def __repr__(self) -> str:  # a flat run's as before whole-param runs (state-dict digests)
        shape = "" if self.shape is None else f", shape={self.shape}"
        return f"Run(bucket={self.bucket}, group={self.group}, in_shard={self.in_shard!r}{shape})"


def plan_runs(
    buffer: BufferLayout,
    rank: int,
    group_of: Mapping[str, int],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    pieces: Collection[str] = (),
) -> list[Run]:
    """The runs of ``rank``'s shards of ``buffer``; ``group_of`` maps an optimized param's
    name to its param group (a param not in it is not optimized); a param in ``shapes`` is
    a whole-param run of that shape (a ``ValueError`` if the shard holds only part of it), a
    param in ``pieces`` a flat run of its part of each shard."""
    shapes = shapes or {}
    runs: list[Run] = []
    for bucket in buffer.buckets:
        shard_size = bucket.shard_range(rank).size
        cursor = 0  # start of the part of the shard not yet given to a run or a skipped piece
        current: tuple[int, int] | None = None  # (group, start) of the open run
        for piece in bucket.local_ranges(rank):
            group = group_of.get(piece.name)
            shape: tuple[int, ...] | None = shapes.get(piece.name) if group is not None else None
            if piece.name in pieces and group is not None:
                shape = (piece.in_shard.size,)
            if current is not None and group == current[0] and shape is None:
                continue
            if current is not None:  # close it where this piece starts
                runs.append(Run(bucket.index, current[0], Range(current[1], piece.in_shard.start)))
                cursor = piece.in_shard.start
                current = None
            if shape is not None and group is not None and piece.name in pieces:
                runs.append(Run(bucket.index, group, piece.in_shard, shape))
                cursor = piece.in_shard.end
            elif shape is not None and group is not None:
                runs.append(_whole_run(bucket.index, group, piece, shape))
                cursor = piece.in_shard.end
            elif group is None:
                cursor = piece.in_shard.end
            else:
                current = (group, cursor)
        if current is not None:
            runs.append(Run(bucket.index, current[0], Range(current[1], shard_size)))
    return runs


def _whole_run(bucket: int, group: int, piece: ShardRanges, shape: tuple[int, ...]) -> Run:
    if piece.in_param != (0, math.prod(shape)):
        raise ValueError(
            f"param {piece.name!r} of shape {shape} is not whole in this shard (it holds elements "
            f"{piece.in_param.start}-{piece.in_param.end}): its bucket is not a whole-param bucket"
        )
    return Run(bucket, group, piece.in_shard, tuple(shape))
