"""The mixed-precision policy: what a sharded model computes in.

``MixedPrecision(param_dtype=torch.bfloat16)`` stores the model's floating params in
``param_dtype`` (trainable ones in the flat buffers, frozen ones in place), so forward and
backward run in it, while grads still accumulate in fp32 ``main_grad``. The original fp32
values are kept until a ``DistributedOptimizer`` is built (or the first forward), so the
optimizer's fp32 main params start from them rather than from their 16-bit rounding; with
``sync_module_states`` they are taken from rank 0 like everything else. Floating tensors
passed to the module's forward are cast to ``param_dtype`` unless ``cast_forward_inputs``
is False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype params are stored and computed in (None: as they are)."""

    param_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if self.param_dtype is not None and not (
            isinstance(self.param_dtype, torch.dtype) and self.param_dtype.is_floating_point
        ):
            raise ValueError(
                f"MixedPrecision.param_dtype must be a floating torch.dtype, got {self.param_dtype!r}"
            )


def cast_params(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast every floating param of ``module`` to ``dtype`` in place; return the original
    values of the trainable ones that changed dtype, by name (fp32 main-param seeds)."""
    originals = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if p.requires_grad:
                originals[name] = p.data
            p.data = p.data.to(dtype)
    return originals


def input_cast_hook(dtype: torch.dtype):
    """A forward pre-hook (with kwargs) casting floating tensor inputs to ``dtype``."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
