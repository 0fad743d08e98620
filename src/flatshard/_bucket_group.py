"""Bucket groups: consecutive buckets of one buffer whose grads are reduced together."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from flatshard._buffer import FlatBuffer
from flatshard._collectives import CommStats, Handle, all_reduce
from flatshard._world import World
from flatshard.layout import BucketLayout


class BucketGroup:
    """Consecutive buckets of one ``FlatBuffer``, reduced by one collective over ``world``.

    The group is *complete* in a backward once every one of its params has had its grad
    accumulated (already multiplied by ``scale``, see [Note: grad sync]); ``start_sync``
    launches the all-reduce on the group's grad range (one contiguous tensor: the buckets
    are adjacent in the buffer).
    """

    def __init__(
        self,
        index: int,
        buffer: FlatBuffer,
        buckets: Sequence[BucketLayout],
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        world: World,
        scale: float,
        stats: CommStats,
    ) -> None:
        self.index = index
        self.buffer = buffer
        self.buckets = tuple(buckets)
        self.params = tuple(params)
        self.names = tuple(names)
        self.world = world
        self.scale = scale
        self.stats = stats
        self.grad = buffer.grad_range(self.buckets[0], self.buckets[-1])  # 1D, contiguous
        self._ids = frozenset(id(p) for p in self.params)
        self._pending: set[int] = set(self._ids)
        self._handle: Handle | None = None
        self.launched = False

    @property
    def complete(self) -> bool:
        return not self._pending

    def is_ready(self, param: nn.Parameter) -> bool:
        return id(param) not in self._pending

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Record that ``param``'s grad is final for this backward; True once all are."""
        self._pending.discard(id(param))
        return not self._pending

    def pending_params(self) -> list[tuple[str, nn.Parameter]]:
        """Params that got no grad in this backward (unused in forward), in buffer order."""
        return [(n, p) for n, p in zip(self.names, self.params, strict=True) if id(p) in self._pending]

    def start_sync(self) -> None:
        if self.launched:
            raise RuntimeError(f"bucket group {self.index} was launched twice in one backward")
        self.launched = True
        self._handle = all_reduce(self.grad, self.world, stats=self.stats)

    def finish_sync(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None

    def reset(self) -> None:
        """Start a new backward: nothing ready, nothing launched."""
        self._pending = set(self._ids)
        self.launched = False

    def __repr__(self) -> str:
        buckets = ",".join(str(b.index) for b in self.buckets)
        return (
            f"BucketGroup({self.index}, buffer={self.buffer.layout.index}, buckets=[{buckets}], {self.world})"
        )
