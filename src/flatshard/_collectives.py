"""Stateless collectives over flat tensors, with per-op byte accounting.

Every function takes a ``World`` and an optional ``CommStats`` and returns a handle with
``wait()``. A world of one skips the collective and returns a completed handle, so callers
run the same code at every world size.

Bytes are recorded two ways: ``payload`` is the size of the full (unsharded) tensor the
op works on, and ``wire`` is what one rank sends under the bandwidth-optimal ring
algorithm: all-reduce ``2 (N-1)/N B``, reduce-scatter and all-gather ``(N-1)/N B``,
broadcast ``B``. [Note: comm bytes] in docs/design.md relates them to the stage formulas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from flatshard._world import World


class Handle(Protocol):
    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True


DONE: Handle = _Done()


@dataclass
class CommStats:
    """Counts of collectives and the bytes they moved, per op name."""

    calls: Counter[str] = field(default_factory=Counter)
    payload_bytes: Counter[str] = field(default_factory=Counter)
    wire_bytes: Counter[str] = field(default_factory=Counter)

    def record(self, op: str, payload: int, wire: int) -> None:
        self.calls[op] += 1
        self.payload_bytes[op] += payload
        self.wire_bytes[op] += wire

    def reset(self) -> None:
        self.calls.clear()
        self.payload_bytes.clear()
        self.wire_bytes.clear()

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())

    @property
    def total_payload_bytes(self) -> int:
        return sum(self.payload_bytes.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            op: {
                "calls": self.calls[op],
                "payload_bytes": self.payload_bytes[op],
                "wire_bytes": self.wire_bytes[op],
            }
            for op in sorted(self.calls)
        }


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(
    tensor: torch.Tensor, world: World, *, stats: CommStats | None = None, op: str = "sum"
) -> Handle:
    """Sum (or max) ``tensor`` in place across ``world``; asynchronous."""
    if world.group is None:
        return DONE
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    if stats is not None:
        b = _nbytes(tensor)
        stats.record("all_reduce", b, 2 * (world.size - 1) * b // world.size)
    return dist.all_reduce(tensor, op=reduce_op, group=world.group, async_op=True)


def broadcast(tensor: torch.Tensor, world: World, *, src: int = 0, stats: CommStats | None = None) -> Handle:
    """Copy rank ``src``'s ``tensor`` (a rank within ``world``) to every rank; asynchronous."""
    if world.group is None:
        return DONE
    if stats is not None:
        b = _nbytes(tensor)
        stats.record("broadcast", b, b if world.rank == src else 0)
    global_src = dist.get_global_rank(world.group, src)
    return dist.broadcast(tensor, src=global_src, group=world.group, async_op=True)
