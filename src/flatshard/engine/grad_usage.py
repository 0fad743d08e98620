"""Which params got a grad, on this rank and on any rank: what decides which params have a
``.grad`` after a synced backward ([Note: params without a grad] in ``optim/held.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from flatshard.comm.collectives import all_reduce
from flatshard.engine.buffer import BufferSet


class GradUsage:
    """The params a grad reached on this rank since the last synced backward (across the
    ``no_sync`` backwards before it, as DDP's map of locally used params)."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def mark(self, param: nn.Parameter) -> None:
        self._used.add(id(param))

    def used_here(self, param: nn.Parameter) -> bool:
        return id(param) in self._used

    def clear(self) -> None:
        self._used.clear()

    def unused_everywhere(self, sets: Sequence[BufferSet], held: Callable[[nn.Parameter], bool]) -> set[int]:
        """The params that got no grad on any rank (``held``: a grad this rank holds besides
        those marked, a hand-set one): a MAX all-reduce of one flag a param over each set's
        worlds, queued behind the grad reductions, so waiting for it costs no extra stall
        (one rank: no collective; a control collective, not in ``comm_stats``)."""
        unused: set[int] = set()
        for bset in sets:
            used = [id(p) in self._used or held(p) for p in bset.params]
            worlds = [w for w in (bset.world, bset.replicate) if w.size > 1]
            if worlds:  # (every rank, whatever it used: a collective)
                flags = torch.tensor(used, dtype=torch.int32, device=bset.world.control_device)
                for world in worlds:
                    all_reduce(flags, world, op="max").wait()
                used = [bool(f) for f in flags.tolist()]
            unused.update(id(p) for p, u in zip(bset.params, used, strict=True) if not u)
        return unused
