"""The mixed-precision policy: what a sharded model computes in.

``MixedPrecision(param_dtype=torch.bfloat16)`` stores the model's floating params in
``param_dtype`` (trainable ones in the flat buffers, frozen ones in place), so forward and
backward run in it, while grads still accumulate in fp32 ``main_grad``. The original fp32
values are kept until a ``DistributedOptimizer`` is built (or the first forward), so the
optimizer's fp32 main params start from them rather than from their 16-bit rounding; with
``sync_module_states`` they are taken from rank 0 like everything else. Floating tensors
passed to the module's forward are cast to ``param_dtype`` unless ``cast_forward_inputs``
is False.

``grad_dtype`` is the dtype grads of 16-bit params accumulate and are kept in (None: fp32,
Megatron-Core's ``grad_reduce_in_fp32``; ``torch.bfloat16`` halves their bytes, and the
optimizer widens them to fp32 a chunk at a time, [Note: precision-aware optimizer] in
``optim/precision.py``). ``reduce_dtype`` is the dtype grads are *communicated* in (None:
the dtype they accumulate in). Each reduction in another dtype casts a copy. So that a
16-bit sum stays in range, the division by the world size is split: grads are divided by
``N / post`` before the sum and by ``post`` after it (``post``: the largest power of two
<= sqrt(N)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""16-bit float dtypes: params of these get fp32 grads and fp32 main params."""


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype params are stored and computed in (None: as they are);
    ``reduce_dtype``: the dtype grads are reduced in (None: their accumulation dtype);
    ``grad_dtype``: the dtype 16-bit params' grads accumulate in (None: fp32; or bf16);
    ``fp8_gathers``: torchao's float8 weights (converted with ``enable_fsdp_float8_all_gather=
    True``) gathered as fp8 bytes. None: at stage 3 ([Note: fp8 gathers] in
    ``engine/fp8_gathers.py``); True: after each step at stages 1-2 too, where between steps
    those params hold their fp8 values decoded and fp32 main params keep the exact ones (16-bit
    params only: [Note: fp8 gathers after the step]); False: never."""

    param_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    reduce_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    fp8_gathers: bool | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "grad_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{field} must be a floating torch.dtype, got {value!r}")
        if not (self.fp8_gathers is None or isinstance(self.fp8_gathers, bool)):
            asked = self.fp8_gathers
            raise ValueError(f"MixedPrecision.fp8_gathers must be None, True or False, got {asked!r}")
        if self.grad_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"MixedPrecision.grad_dtype must be None, torch.float32 or torch.bfloat16, got "
                f"{self.grad_dtype!r} (float16 grads would need loss scaling in every accumulation)"
            )

    def grads_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the grads of a ``dtype`` param accumulate in: fp32 for 16-bit params
        (``grad_dtype`` if set), the param's own otherwise."""
        if dtype in HALF_DTYPES:
            return self.grad_dtype or torch.float32
        return dtype


def split_scale(scale: float, reduce_dtype: torch.dtype | None) -> float:
    """``post``: the factor by which a 16-bit reduction's sum is divided after the collective
    (grads already carry ``scale``; they are multiplied by ``post`` before it)."""
    if reduce_dtype not in HALF_DTYPES or scale >= 1.0:
        return 1.0
    return float(2 ** math.floor(math.log2(math.sqrt(1.0 / scale))))


def cast_params(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast every floating param of ``module`` to ``dtype`` in place; return the original
    values of the trainable ones that changed dtype, by name (fp32 main-param seeds; a
    DTensor's local shard). A DTensor param keeps its object but swaps its contents with
    its cast (its dtype is in its metadata, which ``.data`` does not reach), as
    ``module.to(dtype)`` does."""
    from torch.distributed.tensor import DTensor

    originals = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if isinstance(p, DTensor):
                if p.requires_grad:
                    originals[name] = p.to_local()
                cast = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, cast)  # type: ignore[no-untyped-call]
                continue
            if p.requires_grad:
                originals[name] = p.data
            p.data = p.data.to(dtype)
    return originals


def input_cast_hook(dtype: torch.dtype) -> Callable[..., tuple[Any, Any]]:
    """A forward pre-hook (with kwargs) casting floating tensor inputs to ``dtype``."""

    def cast(t: object) -> object:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


LOW_STATE_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes ``OptimizerPrecision`` keeps main params and optimizer state in."""


@dataclass(frozen=True)
class OptimizerPrecision:
    """What a ``DistributedOptimizer`` keeps its main params and state in ([Note: precision-
    aware optimizer] in ``optim/precision.py``).

    ``main_dtype``: torch.float32 keeps an fp32 copy of 16-bit params (the default);
    torch.bfloat16 keeps none, and the bf16 params themselves are updated, with stochastic
    rounding (they must be bf16: ``MixedPrecision(torch.bfloat16)``). ``state_dtype``: the
    dtype of every elementwise state tensor (Adam's two moments), stored with stochastic
    rounding when bf16. ``seed``: where the rounding's random bits start (the same on every
    rank: replicated state stays replicated). bf16 main params with bf16 state hold 4 bytes
    a param of main params and Adam state together, against 12 in fp32."""

    main_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("main_dtype", "state_dtype"):
            value = getattr(self, field)
            if value not in LOW_STATE_DTYPES:
                raise ValueError(
                    f"OptimizerPrecision.{field} must be torch.float32 or torch.bfloat16, got {value!r} "
                    "(float16 lacks the range for Adam's second moment)"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"OptimizerPrecision.seed must be an int, got {self.seed!r}")

    @property
    def lowered(self) -> bool:
        """Whether anything is kept below fp32."""
        return self.main_dtype != torch.float32 or self.state_dtype != torch.float32
