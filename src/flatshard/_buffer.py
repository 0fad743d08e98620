"""Flat buffers: one contiguous param tensor and one grad tensor per ``BufferLayout``.

[Note: buffers own storage]
After ``FlatBuffer.bind``, each param's ``.data`` is a view into ``param_data`` and its
``.main_grad`` a view into ``grad_data`` (of the buffer's grad dtype: fp32 accumulation for
16-bit params). Nothing copies between a param and its bucket on the hot path; collectives
and optimizer updates work on bucket-sized slices of these two tensors. Alignment gaps and
end padding are zero at construction and nothing writes them as data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flatshard.layout import BucketLayout, BufferLayout


class FlatBuffer:
    """The tensors behind one ``BufferLayout``."""

    def __init__(self, layout: BufferLayout, device: torch.device) -> None:
        self.layout = layout
        self.param_data = torch.zeros(layout.numel, dtype=layout.dtype, device=device)  # 1D
        self.grad_data = torch.zeros(layout.numel, dtype=layout.grad_dtype, device=device)  # 1D

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
                grad_view = self.grad_data[slot.start : slot.end].view(param.shape)
                if param.grad is not None:
                    grad_view.copy_(param.grad)
                param.main_grad = grad_view

    def grad_range(self, first: BucketLayout, last: BucketLayout) -> torch.Tensor:
        """The grad buffer from ``first``'s start to ``last``'s end (consecutive buckets)."""
        return self.grad_data[first.start : last.end]

    def param_range(self, first: BucketLayout, last: BucketLayout) -> torch.Tensor:
        return self.param_data[first.start : last.end]
