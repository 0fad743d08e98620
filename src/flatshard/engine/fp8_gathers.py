"""Weights gathered as fp8 bytes, one scale a weight, for the forward that casts them to fp8
anyway.

The reasoning is [Note: fp8 gathers] below."""

# [Note: fp8 gathers]
#
# torchao's float8 training (``convert_to_float8_training``, tensorwise scaling) casts each
# ``Float8Linear`` weight to fp8 in its forward with one scale for the whole weight:
# ``s = fp8_max / max(amax(|w|), 1e-12)``, computed in float64 and stored as fp32 (rounded
# down to a power of 2 where the module's config sets ``round_scales_to_power_of_2``). Those
# bytes and ``s`` are all the matmuls read of the weight, so with
# ``enable_fsdp_float8_all_gather=True`` (the weights carry torchao's marker, made plain by
# [Note: tensor-subclass params] in ``wrap/subclass_params.py``) flatshard gathers them as
# fp8: one byte an element instead of the param dtype's two or four. Invariants:
#
# * **Layout.** A weight gathered in fp8 has ``ParamSpec.gather_dtype`` set and lies in a
#   buffer of its own kind (``BufferLayout.gather_dtype``): one bucket, one all-gather, one
#   dtype sent.
# * **Scales.** At the start of each forward (the first gather of its schedule),
#   ``Fp8Scales.refresh`` takes each weight's amax over this rank's pieces of it, read from the
#   value of record (the fp32 main params where they hold the shard), and one all-reduce (max)
#   of all of them over the gather group gives every rank every weight's scale: one small
#   collective for all fp8 weights (torchao's ``precompute_float8_dynamic_scale_for_fsdp``),
#   at the same place of the gather order on every rank (``CommStats`` counts it as
#   ``fp8_scales``). The scales are a function of the values only, so a refresh while the
#   values stand still (a second micro-batch, a recomputed forward's gathers) gives the same.
# * **Bytes.** A rank casts its shard with those scales (``clamp(x * s, -max, max)`` in fp32,
#   then to fp8: torchao's saturated cast; alignment gaps are zero bytes), gathers the bytes,
#   and decodes each weight into its full bucket as ``q / s`` in fp32, rounded to the param
#   dtype. Casting each shard with the whole weight's scale and gathering the bytes equals
#   casting the gathered weight: the cast is elementwise.
# * **The same fp8 operand.** ``Float8Linear`` casts the decoded weight again: its amax is
#   ``max|q| / s`` rounded to the param dtype, so its scale is ``s`` within that rounding, and
#   each decoded element times it lies within the same rounding of ``q``, an fp8 value eight
#   param-dtype ulps or more from its neighbours, so it rounds back to ``q``. The matmul reads
#   the bytes a one-process run casts from the fp32 weight, with ``s`` to one rounding of the
#   param dtype (exactly when ``s`` is a power of 2: ``q / s`` is then exact). FSDP2's fp8
#   all-gather sends the same bytes and ``s``, except that it ignores
#   ``round_scales_to_power_of_2``.
# * **Only for compute.** Gathers that hand values to the user or to a file
#   (``summon_full_params``, ``full_state_dict``) send the param dtype, exactly. A world of one
#   rank gathers nothing and casts nothing.
# * **Memory.** The full bucket stays in the param dtype (the forward reads the decoded
#   weight), plus the bytes while they fly (one byte an element of the bucket). FSDP2 keeps
#   only the fp8 bytes and hands ``Float8Linear`` a ``Float8TrainingTensor``; doing so here
#   needs the param itself to be one for the forward (not built).
# * **Not in fp8** (gathered in the param dtype, as before): a marked weight that another
#   module holds too (tied back to an embedding after conversion: that module reads the weight
#   itself, not its fp8 cast); stages 1-2 unless asked for (below); tensor-parallel (DTensor)
#   weights, whose amax spans the TP mesh too.

# [Note: fp8 gathers after the step]
#
# At stages 1-2 each step updates this rank's shard and gathers every bucket, so that each
# rank holds the whole stepped model between steps ([Note: param gather]). With
# ``MixedPrecision(fp8_gathers=True)`` the marked weights' buckets are gathered as fp8 bytes
# there too, and each rank decodes every shard into its param buffer, its own included
# ("decode everywhere", as Megatron's fp8 param gather keeps fp8 params):
#
# * **One model on every rank.** Every rank then holds the same ``q / s`` for every element.
#   A rank that kept its own shard exact would compute ``Float8Linear``'s scale from other
#   values than its peers and cast the elements near an fp8 rounding boundary otherwise.
# * **The values of record stay exact in the fp32 main params**, so this needs them:
#   ``MixedPrecision`` with a 16-bit param dtype and an optimizer that keeps fp32 main params
#   (fp32 params, or ``OptimizerPrecision(main_dtype=...)`` of the param dtype, are refused
#   naming why: their param buffer is their record). The step writes ``round(main)`` into the
#   own shard (``store_main_to_params``) and the gather encodes that: the scale is the amax of
#   the 16-bit weight, as a one-process run's ``Float8Linear`` computes it, so by the recast
#   argument above the matmuls read the same fp8 bytes and scale as that run's (stage 3 encodes
#   the fp32 main params instead, as FSDP2 does).
# * **Reads.** Between steps such params hold their fp8 values decoded. What reads values of
#   record reads the main params: ``full_state_dict``, ``save_pretrained``, the hosts' saves,
#   checkpoints (inside ``ShardState.param_dtype_shards`` the own shard holds ``round(main)``,
#   so ``model/`` entries are exact; the decoded values come back after). ``state_dict()``
#   returns what the params hold, and warns once.
# * **Writes.** A write in place through such a param (``p.mul_(0.9)``, seen by its version
#   counter, [Note: writes through the params] in ``wrap/changes.py``) would reach the main
#   params at fp8 precision: it is refused naming the param. Values given whole (a
#   ``load_state_dict``, a checkpoint load) reach the main params at their own precision, and
#   the weights they cover are recast on the rank (``Fp8Scales.recast``): a weight's amax is
#   the same wherever it is taken, and the cast and decode are elementwise, so the recast
#   equals what a gather of those values gives, with no collective.
# * **Bytes.** One all-reduce of all fp8 weights' amaxes a step (``fp8_scales``), then each
#   bucket's bytes, one an element, in flight until the forward pre-hook that waits for the
#   bucket decodes them. A world of one rank gathers nothing and casts nothing.

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from flatshard.comm.collectives import CommStats, all_reduce
from flatshard.comm.world import World
from flatshard.engine.buffer import FlatBuffer
from flatshard.planner.layout import BucketLayout

AMAX_FLOOR = 1e-12
"""The smallest amax a scale is computed from (torchao's ``EPS``): an all-zero weight."""
SCALES_OP = "fp8_scales"
"""What ``CommStats`` calls the all-reduce (max) of the fp8 weights' amaxes."""


@dataclass(frozen=True)
class Fp8Cast:
    """How one weight is cast for its fp8 gathers: torchao's fp8 dtype for it, and whether its
    scale is rounded down to a power of 2."""

    dtype: torch.dtype
    pow2: bool = False


Source = Callable[[FlatBuffer, BucketLayout], torch.Tensor]
"""This rank's shard of a bucket, in the precision of record (main params or the shard)."""


class Fp8Scales:
    """The fp8-gathered buffers of one buffer set, and every weight's current scale
    ([Note: fp8 gathers])."""

    def __init__(self, buffers: Sequence[FlatBuffer], casts: Mapping[str, Fp8Cast], world: World) -> None:
        self.buffers = [b for b in buffers if b.layout.gather_dtype is not None]
        self.world = world
        self._position: dict[tuple[int, str], int] = {}  # (buffer index, param name) -> scale
        pow2: list[bool] = []
        fp8_max: list[float] = []
        for buffer in self.buffers:
            dtype = buffer.layout.gather_dtype
            assert dtype is not None
            for slot in buffer.layout.params:
                self._position[buffer.layout.index, slot.name] = len(pow2)
                pow2.append(casts[slot.name].pow2 if slot.name in casts else False)
                fp8_max.append(torch.finfo(dtype).max)
        self._pow2 = torch.tensor(pow2, dtype=torch.bool)
        self._fp8_max = torch.tensor(fp8_max, dtype=torch.float64)
        self.scales: torch.Tensor | None = None  # fp32, one a weight; None until refreshed
        self._copies: dict[torch.device, torch.Tensor] = {}  # of ``scales`` on other devices

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def refresh(self, source: Source, stats: CommStats | None = None) -> None:
        """Every weight's scale from its amax over all ranks (one all-reduce)."""
        device = self.buffers[0].device
        amax = torch.zeros(len(self._position), dtype=torch.float32, device=device)
        pieces: list[torch.Tensor] = []
        positions: list[int] = []
        for buffer in self.buffers:
            for bucket in buffer.layout.buckets:
                shard = source(buffer, bucket)
                for piece in bucket.local_ranges(buffer.rank):  # (a weight's one piece on this rank)
                    pieces.append(shard[piece.in_shard.start : piece.in_shard.end])
                    positions.append(self._position[buffer.layout.index, piece.name])
        if pieces:  # (the largest magnitudes, one kernel for all, one copy from the host)
            norms = torch.stack(torch._foreach_norm(pieces, ord=float("inf"))).to(device, torch.float32)
            amax[torch.tensor(positions, device=device)] = norms
        all_reduce(amax, self.world, op="max", stats=stats, counted_as=SCALES_OP).wait()
        self.scales = self._from_amax(amax)
        self._copies = {}

    def _from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """Each weight's scale (fp32) from its amax, as torchao computes it."""
        fp8_max = self._fp8_max.to(amax.device)
        scales = (fp8_max / amax.to(torch.float64).clamp(min=AMAX_FLOOR)).to(torch.float32)
        pow2 = self._pow2.to(amax.device)
        return torch.where(pow2, torch.exp2(torch.floor(torch.log2(scales))), scales)

    def _scales_on(self, device: torch.device) -> torch.Tensor:
        """The scales where a shard lives (the host, for an offloaded one)."""
        assert self.scales is not None
        if self.scales.device == device:
            return self.scales
        if device not in self._copies:
            self._copies[device] = self.scales.to(device)
        return self._copies[device]

    def encode(
        self, buffer: FlatBuffer, bucket: BucketLayout, shard: torch.Tensor, out: torch.Tensor
    ) -> None:
        """This rank's ``shard`` of ``bucket`` cast to fp8 bytes in ``out`` (uint8, shard-sized,
        on the shard's device)."""
        dtype = buffer.layout.gather_dtype
        assert dtype is not None
        scales, fp8_max = self._scales_on(shard.device), torch.finfo(dtype).max
        out.zero_()
        for piece in bucket.local_ranges(buffer.rank):
            lo, hi = piece.in_shard
            scale = scales[self._position[buffer.layout.index, piece.name]]
            scaled = shard[lo:hi].to(torch.float32) * scale
            out[lo:hi].copy_(scaled.clamp_(-fp8_max, fp8_max).to(dtype).view(torch.uint8))

    def decode(
        self, buffer: FlatBuffer, bucket: BucketLayout, packed: torch.Tensor, full: torch.Tensor
    ) -> None:
        """Each weight of ``bucket`` from its gathered bytes (``packed``, bucket-sized) into
        ``full`` (the full bucket, param dtype): ``q / s``."""
        dtype = buffer.layout.gather_dtype
        assert dtype is not None and self.scales is not None
        for slot in bucket.params:
            lo, hi = slot.start - bucket.start, slot.end - bucket.start
            scale = self.scales[self._position[buffer.layout.index, slot.name]]
            full[lo:hi].copy_(packed[lo:hi].view(dtype).to(torch.float32) / scale)

    def recast(self, buffer: FlatBuffer, names: Collection[str]) -> None:
        """The weights of ``buffer`` named in ``names``, whole in its param buffer (stages 1-2),
        replaced by their fp8 values decoded, with scales from their own amaxes: what a gather
        of them gives ([Note: fp8 gathers after the step])."""
        dtype = buffer.layout.gather_dtype
        assert dtype is not None and buffer.param_data is not None
        slots = [s for s in buffer.layout.params if s.name in names]
        if not slots:
            return
        values = [buffer.param_data[s.start : s.end] for s in slots]
        amax = torch.zeros(len(self._position), dtype=torch.float32, device=buffer.device)
        norms = torch.stack(torch._foreach_norm(values, ord=float("inf"))).to(torch.float32)
        amax[torch.tensor([self._position[buffer.layout.index, s.name] for s in slots])] = norms
        scales, fp8_max = self._from_amax(amax), torch.finfo(dtype).max
        for slot, value in zip(slots, values, strict=True):
            scale = scales[self._position[buffer.layout.index, slot.name]]
            scaled = value.to(torch.float32) * scale
            value.copy_(scaled.clamp_(-fp8_max, fp8_max).to(dtype).to(torch.float32) / scale)

    def names(self) -> set[str]:
        """The weights gathered in fp8."""
        return {slot.name for buffer in self.buffers for slot in buffer.layout.params}


def fp8_scales(buffers: Sequence[FlatBuffer], casts: Mapping[str, Fp8Cast], world: World) -> Fp8Scales | None:
    """The scales of ``buffers``' fp8-gathered ones over ``world``; None where none is or
    the world is one rank (nothing is gathered)."""
    scales = Fp8Scales(buffers, casts, world)
    return scales if scales and world.size > 1 else None
