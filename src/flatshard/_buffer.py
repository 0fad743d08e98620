"""Flat buffers: one contiguous param tensor and one grad tensor per ``BufferLayout``.

[Note: buffers own storage]
After ``FlatBuffer.bind``, each param's ``.data`` is a view into ``param_data`` and its
``.main_grad`` a view into ``grad_data`` (of the buffer's grad dtype: fp32 accumulation for
16-bit params). Nothing copies between a param and its bucket on the hot path; collectives
and optimizer updates work on bucket-sized slices of these two tensors. Alignment gaps and
end padding are zero at construction and nothing writes them as data.

With ``full_grads=False`` (stage 2) there is no ``grad_data``: grads live in per-bucket-group
scratch while a backward runs (see [Note: sharded grads]) and, between backwards, only as
this rank's shards, concatenated bucket after bucket in ``grad_shard_data``. That
concatenation is the buffer's *shard frame*: ``frame_range(bucket)`` is where a bucket's
shard sits in it, and the optimizer's fp32 main params use the same frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flatshard.layout import BucketLayout, BufferLayout, Range


class FlatBuffer:
    """The tensors behind one ``BufferLayout``, as seen from ``rank``."""

    def __init__(
        self, layout: BufferLayout, device: torch.device, *, rank: int = 0, full_grads: bool = True
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.device = torch.device(device)
        self.param_data = torch.zeros(layout.numel, dtype=layout.dtype, device=device)  # 1D
        self.grad_data: torch.Tensor | None = None  # 1D, whole buffer (stages 0 and 1)
        self.grad_shard_data: torch.Tensor | None = None  # 1D, shard frame (stage 2)
        starts, offset = [], 0
        for bucket in layout.buckets:
            starts.append(offset)
            offset += bucket.shard_range(rank).size
        self._frame_starts = starts
        self.frame_numel = offset
        if full_grads:
            self.grad_data = torch.zeros(layout.numel, dtype=layout.grad_dtype, device=device)
        else:
            self.grad_shard_data = torch.zeros(offset, dtype=layout.grad_dtype, device=device)

    def bind(self, params: Sequence[nn.Parameter]) -> None:
        """Move each param's values into the buffer and rebind it as a view.

        ``params[slot.index]`` is the param of every slot (the order given to plan_layout).
        """
        with torch.no_grad():
            for slot in self.layout.params:
                param = params[slot.index]
                if param.numel() != slot.numel or param.dtype != self.layout.dtype:
                    raise ValueError(
                        f"param {slot.name!r} ({param.numel()} elements, {param.dtype}) does not match "
                        f"its layout slot ({slot.numel} elements, {self.layout.dtype})"
                    )
                view = self.param_data[slot.start : slot.end].view(param.shape)
                view.copy_(param.data)
                param.data = view
                if self.grad_data is None:
                    param.main_grad = None
                    continue
                grad_view = self.grad_data[slot.start : slot.end].view(param.shape)
                if param.grad is not None:
                    grad_view.copy_(param.grad)
                param.main_grad = grad_view

    @property
    def full_grads(self) -> bool:
        return self.grad_data is not None

    def grad_range(self, first: BucketLayout, last: BucketLayout) -> torch.Tensor:
        """The grad buffer from ``first``'s start to ``last``'s end (consecutive buckets)."""
        if self.grad_data is None:
            raise RuntimeError("this buffer keeps only grad shards (stage 2): there is no full grad range")
        return self.grad_data[first.start : last.end]

    def param_range(self, first: BucketLayout, last: BucketLayout) -> torch.Tensor:
        return self.param_data[first.start : last.end]

    # -- this rank's shards ----------------------------------------------------------------
    def shard_range(self, bucket: BucketLayout) -> Range:
        """This rank's shard of ``bucket``, in buffer offsets."""
        return bucket.shard_range(self.rank)

    def frame_range(self, bucket: BucketLayout) -> Range:
        """Where ``bucket``'s shard sits in the shard frame."""
        start = self._frame_starts[bucket.index]
        return Range(start, start + bucket.shard_range(self.rank).size)

    def param_shard(self, bucket: BucketLayout) -> torch.Tensor:
        """This rank's shard of ``bucket``'s params (a view of ``param_data``)."""
        shard = self.shard_range(bucket)
        return self.param_data[shard.start : shard.end]

    def grad_shard(self, bucket: BucketLayout) -> torch.Tensor:
        """This rank's reduced grads of ``bucket`` once a backward has synced (a view)."""
        if self.grad_data is not None:
            shard = self.shard_range(bucket)
            return self.grad_data[shard.start : shard.end]
        frame = self.frame_range(bucket)
        return self.grad_shard_data[frame.start : frame.end]

    def grad_storage(self) -> torch.Tensor:
        """The tensor that holds this buffer's grads between backwards."""
        return self.grad_data if self.grad_data is not None else self.grad_shard_data
