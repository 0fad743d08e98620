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
# The hash is murmur3's 32-bit finalizer (two multiplies, three xor-shifts) over the index's
# low 32 bits xor the salt's low half, a second round folding in the high 32 bits only for
# elements past 2**32 of a run, and the salt's high half xored over the result: a handful of
# 32-bit operations, which a CPU runs 8 elements to an AVX2 instruction, 16 at AVX-512
# ([Note: native CPU Adam] in ``cpu_adam.py`` spells the same function in C). One hash gives
# 32 bits, two draws: a key takes its low 16 bits, and a key paired with another (``PAIRED``:
# Adam's ``exp_avg_sq`` with ``exp_avg``) takes the high 16 bits of that key's hash, so an
# element's two moments cost one hash (the finalizer mixes every input bit into every output
# bit, so the halves are as independent as two hashes'). Torch's integer tensors have no
# unsigned 32-bit multiply, so ``_mul32`` multiplies 16-bit halves in int64, which never
# overflows and gives the same low 32 bits on every backend. The bits changed from the 31-bit
# hash of earlier versions, and again when the moments came to share a hash (their halves
# were xored together before): a resume from a checkpoint of one rounds, from then on, with
# other (equally random) bits.

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

_M32 = (1 << 32) - 1
_FMIX = (0x85EBCA6B, 0xC2B2AE35)  # (murmur3's finalizer constants)


PAIRED = {"exp_avg_sq": "exp_avg"}
"""State keys that draw the high half of another key's hash ([Note: rounding bits])."""


def shift_of(key: str) -> int:
    """Where ``key``'s 16 bits lie in its hash: 16 for a paired key, else 0."""
    return 16 if key in PAIRED else 0


def salt(seed: int, count: int, group: int, run: int, key: str) -> tuple[int, int]:
    """The two 32-bit halves of the salt for ``key``'s elements of one run in one step (a
    paired key's: its partner's)."""
    x = 0
    for part in (seed, count, group, run, zlib.crc32(PAIRED.get(key, key).encode())):
        x = (x * 0x9E3779B97F4A7C15 + (part & ((1 << 64) - 1))) % (1 << 64)
        x ^= x >> 29
    return x & _M32, x >> 32


def _mul32(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * k`` modulo 2**32 for int64 ``x`` in ``[0, 2**32)``: the products of 16-bit halves
    stay below 2**49."""
    return (x & 0xFFFF).mul_(k).add_(((x >> 16).mul_(k & 0xFFFF) & 0xFFFF) << 16).bitwise_and_(_M32)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer of 32-bit values held in int64: every input bit reaches every output bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX[0])
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX[1])
    return h ^ (h >> 16)


def noise(
    index: torch.Tensor, halves: tuple[int, int] | torch.Tensor, far: bool = True, shift: Any = 0
) -> torch.Tensor:
    """16 random bits (int64 in ``[0, 65536)``) for each int64 ``index`` (at most 2**63) under
    the salt ``halves`` (a pair of ints, or a 2-element int64 tensor for compiled callers):
    the hash's bits from ``shift`` up (``shift_of(key)``). ``far=False`` promises every index
    is below 2**32 and skips the second round's work."""
    lo, hi = halves[0], halves[1]
    h = _fmix((index & _M32) ^ lo)
    if far:  # (the second round, for elements past 2**32 of a run)
        top = index >> 32
        h = torch.where(top == 0, h, _fmix(h ^ top))
    return ((h ^ hi) >> shift) & 0xFFFF


def stochastic(value: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``value`` with its low 16 bits cleared after adding ``bits``: a bf16 value (exactly
    representable, so a later cast is exact), rounded up with probability equal to the dropped
    bits' fraction of an ulp. Infinities, zeros and bf16 values are left as they are, and a NaN
    stays a NaN whatever its bits: added to, a NaN's low bits would carry into its exponent and
    sign (0x7FFFFFFF, the NaN a GPU's arithmetic writes, would become -0.0) or leave only an
    infinity's bits (0x7F800001)."""
    raw = value.contiguous().view(torch.int32) + bits.to(torch.int32)
    rounded = (raw & -65536).view(torch.float32)  # (0xFFFF0000: the bf16 bits)
    return torch.where(value.isnan(), value, rounded)


def round_into(
    out: torch.Tensor, value: torch.Tensor, halves: tuple[int, int], start: int = 0, shift: int = 0
) -> None:
    """Write fp32 ``value`` into ``out``: exactly where ``out`` is fp32, else rounded to bf16
    stochastically, with the bits of elements ``start, start + 1, ...`` of its run from
    ``shift`` up in their hash (one compiled kernel on an accelerator)."""
    if out.dtype == torch.float32:
        out.copy_(value)
        return
    if out.dtype != torch.bfloat16:
        raise TypeError(f"stochastic rounding writes fp32 or bf16, not {out.dtype}")
    ints = torch.tensor([start, *halves, shift], dtype=torch.int64, device=value.device)
    far = start + value.numel() > 1 << 32
    (_round if value.device.type == "cpu" else _compiled_round())(out, value, ints, far)


def _round(out: torch.Tensor, value: torch.Tensor, ints: torch.Tensor, far: bool) -> None:
    index = torch.arange(value.numel(), device=value.device) + ints[0]
    out.copy_(stochastic(value, noise(index, ints[1:3], far, ints[3])).view(out.shape))


@functools.cache
def _compiled_round() -> Any:
    return torch.compile(_round, dynamic=True, fullgraph=True)
