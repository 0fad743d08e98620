"""The values of record: what a full state dict and an export give for each param.

The reasoning is [Note: values of record] below."""

# [Note: values of record]
#
# With ``MixedPrecision(param_dtype=bf16)`` (or a 16-bit model) the model computes with 16-bit
# params while its ``DistributedOptimizer`` updates fp32 *main params*; the 16-bit params are
# those rounded. The fp32 values are the model's values of record: they are what training
# produced, what a resumed run continues from, and what FSDP2 (``reshard`` of fp32 sharded
# params) and DeepSpeed (``zero_to_fp32``) export. So ``full_state_dict()`` gives, for every
# param the optimizer keeps main params for, the main params (fp32), gathered a bucket at a
# time; every other param (fp32 params, which are their own record; params outside every
# param group; buffers) as the model holds it. ``dtype=`` casts the floating-point entries
# (e.g. ``torch.bfloat16`` to ship a half-size export). Invariants:
#
# * an entry is never rounded unless the caller asked for a dtype: a bf16-trained param
#   exported without ``dtype`` equals the optimizer's fp32 value exactly;
# * every rank takes part in the same gathers in the same order (bucket order of each
#   buffer); only rank 0 keeps what it gathers, on the CPU, one bucket in fp32 at a time
#   on the device.

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from flatshard.comm.collectives import all_gather
from flatshard.engine.buffer import BufferSet, FlatBuffer
from flatshard.engine.tensor_parallel import full_value, local_shape


class MainParams(Protocol):
    """What this module reads of the optimizer attached to a wrapped module."""

    @property
    def group_of(self) -> Mapping[str, int]: ...

    def main_frame(self, buffer: FlatBuffer) -> torch.Tensor | None: ...


def main_values(
    sets: list[BufferSet], optimizer: MainParams | None, keep: bool
) -> tuple[set[int], dict[int, torch.Tensor]]:
    """The ids of every optimized param of a 16-bit buffer (the same on every rank) and
    ``{id(param): its fp32 main params, full, on the CPU}`` for them (``keep``: this rank
    keeps them; the others only take part in the gathers and get ``{}``)."""
    covered: set[int] = set()
    out: dict[int, torch.Tensor] = {}
    if optimizer is None:
        return covered, out
    optimized = optimizer.group_of
    for bset in sets:
        for buffer in bset.buffers:
            main = optimizer.main_frame(buffer)
            if main is None:
                continue
            for bucket in buffer.layout.buckets:
                frame = buffer.frame_range(bucket)
                full = torch.zeros(
                    bucket.numel, dtype=main.dtype, device=buffer.device
                )  # (main: maybe the host's)
                mine = buffer.own_part(full, bucket) if bucket.sharded else full
                mine.copy_(main[frame.start : frame.end])
                if bucket.sharded and bset.world.size > 1:
                    all_gather(full, mine, bset.world, splits=bucket.splits).wait()
                for slot in (s for s in bucket.params if s.name in optimized):
                    param = bset.params[slot.index]
                    covered.add(id(param))
                    value = full[slot.start - bucket.start : slot.end - bucket.start].view(local_shape(param))
                    value = full_value(param, value)  # (a tp shard: gathered on every rank)
                    if keep:
                        out[id(param)] = value.to("cpu", copy=True)
    return covered, out


def check_dtype(dtype: object) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")


def cast(entries: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``entries`` with every floating-point tensor in ``dtype`` (None: as they are)."""
    check_dtype(dtype)
    if dtype is None:
        return entries
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in entries.items()}
