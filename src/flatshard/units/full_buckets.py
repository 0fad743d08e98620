"""A stage-3 buffer's full buckets, and its params pointed at them or at placeholders.

The reasoning is [Note: full buckets] below."""

# [Note: full buckets]
#
# Between uses a stage-3 ``FlatBuffer`` holds only this rank's shard of each bucket
# ([Note: buffers own storage] in ``engine/buffer.py``). ``FullBuckets`` adds what gathering
# a unit needs, per bucket: one full-size tensor, and for each of the bucket's params its view
# of that tensor and its placeholder (one NaN expanded to the param's shape: one element of
# memory, the right shape for ``named_parameters()``). Invariants:
#
# * A full bucket's storage exists only between ``allocate`` and ``free``: while its unit is
#   gathered, or while wrapping initializes it (one unit at a time, so wrapping never holds
#   more than one unit in full). The tensor object, and so every view of it, lives as long
#   as the buffer.
# * ``point(bucket, full=True)`` makes each param's ``.data`` its view and the param a plain
#   ``nn.Parameter``; ``full=False`` makes it its placeholder and the param a ``Placeholder``
#   ([Note: placeholders] in ``units/placeholder.py``). Views and placeholders are made once,
#   here: pointing runs twice per unit and pass and allocates nothing.
# * Building ``FullBuckets`` points every param at its placeholder: from then on a stage-3
#   param's values live only in the shard frame (or the full bucket while gathered).

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flatshard.engine.buffer import FlatBuffer, refill, release
from flatshard.engine.tensor_parallel import local_shape
from flatshard.planner.layout import BucketLayout
from flatshard.units.placeholder import hide, show


class FullBuckets:
    """The full buckets of one stage-3 ``FlatBuffer``, and its params' two pointers."""

    def __init__(self, buffer: FlatBuffer, params: Sequence[nn.Parameter]) -> None:
        """``params[slot.index]`` is the param of every slot of ``buffer``'s layout; each is
        pointed at its placeholder."""
        layout = buffer.layout
        if not buffer.sharded_params:
            raise ValueError("FullBuckets: only a stage-3 buffer (sharded params) has full buckets")
        nan = torch.full((1,), float("nan"), dtype=layout.dtype, device=buffer.device)
        self._full: list[torch.Tensor] = []
        # per bucket: slot index -> (param, its view of the full bucket, its placeholder)
        self._pointers: list[dict[int, tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = []
        for bucket in layout.buckets:  # (one bucket's storage at a time: views need it)
            full = torch.empty(bucket.numel, dtype=layout.dtype, device=buffer.device)
            pointers = {}
            for slot in bucket.params:
                param = params[slot.index]
                shape = local_shape(param)  # (a DTensor's local shard)
                view = full[slot.start - bucket.start : slot.end - bucket.start].view(shape)
                pointers[slot.index] = (param, view, nan.expand(shape))
            self._full.append(release(full))
            self._pointers.append(pointers)
            self.point(bucket, full=False)

    def tensor(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's full-size tensor (its storage is empty while the unit is sharded)."""
        return self._full[bucket.index]

    def allocate(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's full tensor with storage (values undefined until written)."""
        return refill(self._full[bucket.index])

    def free(self, bucket: BucketLayout) -> None:
        release(self._full[bucket.index])

    def point(self, bucket: BucketLayout, *, full: bool) -> None:
        """Point the bucket's params at their views of the full bucket, or at their
        placeholders."""
        if full:
            for param, view, placeholder in self._pointers[bucket.index].values():
                show(param, view, placeholder)
        else:
            for param, _, placeholder in self._pointers[bucket.index].values():
                hide(param, placeholder)
