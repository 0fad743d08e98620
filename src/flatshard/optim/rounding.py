"""Stochastic rounding of fp32 values into bf16, with random bits that are a function of
where they land: [Note: rounding bits].

The reasoning is [Note: rounding bits] below."""

# [Note: rounding bits]
#
# Each rounded element takes 16 random bits from a hash of its index within its run (the flat
# shard tensor it lives in) and a salt. The salt mixes the rounding seed, the step count, the
# param group, the run's place in its group and the state key (``"param"`` for the param
# itself), so:
#
# * the bits do not depend on how a step cuts a run into chunks, nor on which path stepped it
#   (the chunked path of any torch class and the fused Adam step draw the same bits, so the two
#   differ only where their fp32 arithmetic differs);
# * every rank draws the same bits for the same run (replicated state stays replicated);
# * a resume at the same layout draws what the uninterrupted run would have;
# * the hash is a handful of integer ops an element that a compiler fuses into the update's own
#   kernel: no generator state, no buffer of random numbers.
#
# The hash folds 31-bit lanes: ``x * K`` with ``x, K < 2**31`` stays below ``2**62``, so no
# int64 product overflows on any backend, and the high half folded back into the low half
# spreads every input bit over the low 16.

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

_M31 = (1 << 31) - 1
_KEYS = (0x5BD1E995, 0x27D4EB2F, 0x165667B1)  # (odd multipliers below 2**31)


def salt(seed: int, count: int, group: int, run: int, key: str) -> tuple[int, int]:
    """The two 31-bit halves of the salt for ``key``'s elements of one run in one step."""
    x = 0
    for part in (seed, count, group, run, zlib.crc32(key.encode())):
        x = (x * 0x9E3779B97F4A7C15 + (part & ((1 << 64) - 1))) % (1 << 64)
        x ^= x >> 29
    return x & _M31, (x >> 31) & _M31


def _fold_(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (31-bit values) mixed in place: ``x * k`` with its high half folded onto its low."""
    x.mul_(k)
    x.bitwise_xor_(x >> 31)
    return x.bitwise_and_(_M31)


def noise(index: torch.Tensor, halves: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in ``[0, 65536)``) for each int64 ``index`` under the salt
    ``halves`` (a pair of ints, or a 2-element int64 tensor for compiled callers). In place
    on its own temporaries: uncompiled on the CPU, 2.4x faster than out-of-place ops."""
    lo, hi = halves[0], halves[1]
    x = _fold_((index & _M31).bitwise_xor_(lo), _KEYS[0])
    x.bitwise_xor_((index >> 31).bitwise_and_(_M31).bitwise_xor_(hi))
    return _fold_(_fold_(x, _KEYS[1]), _KEYS[2]).bitwise_and_(0xFFFF)


def stochastic(value: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``value`` with its low 16 bits cleared after adding ``bits``: a bf16 value (exactly
    representable, so a later cast is exact), rounded up with probability equal to the dropped
    bits' fraction of an ulp. Infinities, zeros and bf16 values are left as they are."""
    raw = value.contiguous().view(torch.int32) + bits.to(torch.int32)
    return (raw & -65536).view(torch.float32)  # (0xFFFF0000: the bf16 bits)


def round_into(out: torch.Tensor, value: torch.Tensor, halves: tuple[int, int], start: int = 0) -> None:
    """Write fp32 ``value`` into ``out``: exactly where ``out`` is fp32, else rounded to bf16
    stochastically, with the bits of elements ``start, start + 1, ...`` of its run (one
    compiled kernel on an accelerator)."""
    if out.dtype == torch.float32:
        out.copy_(value)
        return
    if out.dtype != torch.bfloat16:
        raise TypeError(f"stochastic rounding writes fp32 or bf16, not {out.dtype}")
    ints = torch.tensor([start, *halves], dtype=torch.int64, device=value.device)
    (_round if value.device.type == "cpu" else _compiled_round())(out, value, ints)


def _round(out: torch.Tensor, value: torch.Tensor, ints: torch.Tensor) -> None:
    index = torch.arange(value.numel(), device=value.device) + ints[0]
    out.copy_(stochastic(value, noise(index, ints[1:])).view(out.shape))


@functools.cache
def _compiled_round() -> Any:
    return torch.compile(_round, dynamic=True, fullgraph=True)
