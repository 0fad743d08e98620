"""``Offload``: which of a rank's training bytes live on the host instead of the device.

The reasoning is [Note: memory tiers] below."""

# [Note: memory tiers]
#
# Each tensor a rank keeps for training has one home, the device or the host, decided when the
# model is sharded and the optimizer built, never moved behind the user's back. ``Offload``
# (given to ``shard(..., offload=...)``, read by the ``DistributedOptimizer`` built over the
# model) says which. With ``optimizer=True`` the optimizer's tensors of this rank live on the
# host: the main params (fp32 params get a host copy the step updates), the grads, and the
# inner optimizer's state, created there by its first step. Where the grads live depends on
# the stage. At stages 2-3 a rank keeps only its grad shards between backwards, and those
# move to the host: each bucket's reduction copies its reduced shard down the host link as
# it finishes (adding it to what an earlier backward of the step left there) and frees the
# device's; the backward's end waits for the copies once; every reader of grads (the global norm, clipping, a
# ``ShardedGrad``'s pieces) reads them where they are, scalars brought to them. At stages
# 0-1 the device's grad buffer is what the collectives reduce in place, so it stays, and the
# step copies the grads into a host frame. A step is
#
# 1. the grads as the optimizer prepared them (reduced, unscaled, clipped: [Note: prepared
#    grads] in ``optim/grad_prep.py``), at stages 0-1 copied from the device into the frame;
# 2. the inner optimizer's update on the host, with torch's fused kernel for the classes that
#    have one, else ``foreach`` (never torch's default loop of ops over each tensor);
# 3. the new values copied to the device params, rounded to their dtype, before the next
#    forward reads them (stages 0-2).
#
# At stage 3 the main params are already the only copy of a rank's param shards ([Note:
# main-backed shards] in ``engine/buffer.py``), so offloading them offloads the shards: a
# unit's gather copies this rank's part from the host into the full bucket on the device, and
# the device keeps nothing per element of the rank's shard between steps: it holds the units
# in flight and what their backward needs, as FSDP2's ``CPUOffloadPolicy``. fp32 params get
# the same host frame as their only copy. Frozen params' shards (a LoRA base) have no
# optimizer: they move with their unit's home when the model is sharded (or when a device
# budget is decided), and their gathers copy them up as the others'.
#
# Invariants: the host main params are the values the optimizer steps, and any write that
# reaches the params outside a step reaches them as it reaches device main params (a load, a
# write through a param: [Note: writes through the params] watches fp32 params too when they
# are offloaded); the host copy of an fp32 param is no value of record ([Note: values of
# record] in ``wrap/record.py``): checkpoints and exports read the params, whose values it
# equals after every step.
#
# On an accelerator, host tensors are page-locked (``pin_memory``) and copies are asynchronous
# on the current stream: the grads' copies into a frame (stages 0-1) are waited for once
# before the host update, the grad shards' (stages 2-3) once at the end of the backward
# (``wait_for_host_grads``: the global norm reads them next; a shard added to an earlier
# backward's waits for its own copy), so the backward's kernels are queued meanwhile; the
# params' copies are queued ahead of the next forward's work on the same stream, and so are a
# stage-3 gather's copies of this rank's part (the host writes those shards only in the step,
# after the backward's wait, or in a load, which drops what was gathered). On a
# CPU-only machine host and device are the same memory: every copy still runs, and the homes
# are accounted by ownership (``memory_report``'s ``host`` bytes), so a CPU run tests the same
# code and counts the same bytes as a GPU run.
#
# [Note: unit homes]
#
# At stage 3 a home can be chosen unit by unit: ``Offload(units=names)`` puts the named units'
# shards, grad shards, main params and optimizer state on the host, as ``Offload()`` puts
# everything, and keeps every other unit's on the device, stepped there. The unit is the
# grain because a unit's shards are what a gather reads: a resident unit gathers from the
# device as without offload, an offloaded one copies its part over the link first (a frame
# of its own on the host; its grad shards go there too, so between steps it holds nothing on
# the device). The home is a buffer's: with ``units`` (or a device budget) at stage 3, the
# layout gives each unit buffers of its own (``plan_layout(buffer_per_unit=True)``), and
# ``build_shards`` puts a buffer on the host when its unit is named: its frame, its grad
# shards and its state. One inner optimizer steps both homes (torch's fused and ``foreach``
# kernels group tensors by device). Every other invariant of [Note: memory tiers] holds
# buffer by buffer.
#
# Why not a share at stage 3 (a ``HybridDeviceOptimizer``, as at stages 0-2): its host runs
# keep their shards and fp32 copies on the device too (only the state moves), so per element
# a unit's home frees the shard and its grads as well. A device budget at stage 3 therefore
# chooses units ([Note: device budget] in ``planner/budget.py``).

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

STEP_PLACES = ("host", "device")
STREAM_CHUNK = 1 << 25
"""Elements a chunk of a streamed step holds at most by default, whole runs ([Note: streamed
step] in ``optim/streamed_step.py``): 512 MiB of fp32 main params, grads and Adam's moments."""


@dataclass(frozen=True)
class Offload:
    """``shard(..., offload=flatshard.Offload())``: this rank's optimizer state and main
    params on the host, stepped there; with all of them there, at stage 3 its param shards
    too ([Note: memory tiers] in ``planner/offload.py``).

    optimizer: the optimizer's main params and state on the host, its update fused there
        (True or 1.0); a fraction in (0, 1): that share of each rank's elements (in param-group
        order) keeps its state and takes its update on the host, the rest on the device, by
        ``HybridDeviceOptimizer`` inside the ``DistributedOptimizer`` ([Note: host overlap] in
        ``optim/hybrid.py``), a run of a bucket's shard at a time (a run whose middle falls
        within the share goes; ``memory_report`` says what did); False or 0: none.
    pin_memory: page-locked host tensors, so that copies overlap compute (CUDA only).
    device_budget: instead of ``optimizer``, the bytes of model state each rank's device may
        hold: the ``DistributedOptimizer`` built over the model takes the least offload that
        fits on every rank ([Note: device budget] in ``planner/budget.py``), or raises naming
        what does not fit; at stage 3 it chooses units, as ``units`` would.
    units: stage 3 only: the names of the units (their modules' qualified names, as
        ``flatshard layout`` prints them) whose shards and optimizer live on the host; the
        other units' stay on the device ([Note: unit homes]). None: every unit's.
    step: where the offloaded optimizer's update runs: "host" (its fused CPU kernel), or
        "device": its tensors stay at home on the host and are streamed to the device a chunk
        at a time, stepped there and streamed back ([Note: streamed step] in
        ``optim/streamed_step.py``); not with a share (its host part steps on the host).
    stream_chunk: with ``step="device"``, the elements a chunk holds at most (whole runs; a
        longer run is a chunk of its own); the device holds two chunks at once during the step.
    """

    optimizer: bool | float = True
    pin_memory: bool = True
    device_budget: int | None = None
    units: tuple[str, ...] | None = None
    step: str = "host"
    stream_chunk: int = STREAM_CHUNK

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"Offload.pin_memory must be True or False, got {self.pin_memory!r}")
        share = self.optimizer
        if not isinstance(share, (bool, int, float)) or not 0 <= share <= 1:
            raise ValueError(f"Offload.optimizer must be True, False or a share in [0, 1], got {share!r}")
        budget = self.device_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise ValueError(f"Offload.device_budget must be a positive number of bytes, got {budget!r}")
        if budget is not None and share is not True:
            raise ValueError(
                f"Offload: give a share (optimizer={share!r}) or a device_budget, not both: the "
                "budget decides the share"
            )
        chunk = self.stream_chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ValueError(f"Offload.stream_chunk must be a positive number of elements, got {chunk!r}")
        if self.step not in STEP_PLACES:
            raise ValueError(f"Offload.step must be one of {STEP_PLACES}, got {self.step!r}")
        if self.step == "device" and 0 < float(share) < 1:
            raise ValueError(
                f"Offload(step='device') streams all of the optimizer, not a share (optimizer={share!r}): "
                "a share's host part steps on the host; give optimizer=True, or step='host'"
            )
        self._check_units()

    def _check_units(self) -> None:
        units = self.units
        if units is None:
            return
        if isinstance(units, str) or not all(isinstance(u, str) for u in units):
            raise TypeError(f"Offload.units must be a collection of unit names (str), got {units!r}")
        object.__setattr__(self, "units", tuple(units))
        if float(self.optimizer) != 1.0:
            raise ValueError(
                f"Offload: give units or a share (optimizer={self.optimizer!r}), not both: the named "
                "units' optimizer is all on the host"
            )
        if self.device_budget is not None:
            raise ValueError("Offload: give units or a device_budget, not both: the budget decides the units")

    @property
    def fraction(self) -> float:
        """The share of each rank's optimizer elements on the host."""
        return float(self.optimizer)


def stream_chunks(numels: Sequence[int], chunk: int) -> list[list[int]]:
    """The runs (their indices, in order) of each chunk a streamed step moves: whole runs, at
    most ``chunk`` elements a chunk, a longer run alone."""
    chunks: list[list[int]] = []
    room = 0
    for i, n in enumerate(numels):
        if not chunks or room < n:
            chunks.append([])
            room = chunk
        chunks[-1].append(i)
        room -= n
    return chunks


def staging_bytes(chunk_bytes: Sequence[int]) -> int:
    """The most bytes a streamed step holds on the device at once, each chunk's given: two
    chunks in a row (the one stepping and the next uploading), or the one."""
    pairs = (a + b for a, b in itertools.pairwise(chunk_bytes))
    return max(pairs, default=sum(chunk_bytes))


def offloaded_items(numels: list[int], fraction: float, smallest: int = 0) -> list[bool]:
    """Whether each item (a param, or a run of a shard) goes to the host under a share
    ``fraction``: the middle of its elements, counted in order, lies in the first
    ``fraction`` of all elements, and it has at least ``smallest`` of them ([Note: host
    overlap] in ``optim/hybrid.py``; the budget planner counts with the same rule)."""
    limit = fraction * sum(numels)
    out, before = [], 0
    for n in numels:
        out.append(before + n / 2 < limit and n >= smallest)
        before += n
    return out


def unit_label(modules: Sequence[str]) -> str:
    """A stage-3 unit's name: its module's, or the first and last of merged siblings'
    ("blocks.0..blocks.5", [Note: merged units]); ``Unit.name`` is this."""
    return modules[0] if len(modules) == 1 else f"{modules[0]}..{modules[-1]}"


def unit_ids(names: Collection[str], units: Sequence[Sequence[str]]) -> frozenset[str]:
    """The layout's ids (``ParamSpec.unit``: the index as a string) of the stage-3 units
    ``names`` name (a unit's name, or any of its modules'); ``units`` are each unit's
    modules' names by index (the root's is ""). A ``ValueError`` names a name that is no
    unit's, with the units there are."""
    by_name = {name: str(i) for i, unit in enumerate(units) for name in unit}
    by_name.update({unit_label(u): str(i) for i, u in enumerate(units)})
    unknown = [n for n in names if n not in by_name]
    if unknown:
        shown = [unit_label(u) for u in units]
        raise ValueError(
            f"Offload(units=...): {unknown[0]!r} is not a stage-3 unit of this model; its units are "
            f'{shown} (the root, "", holds the params of no unit module)'
        )
    return frozenset(by_name[n] for n in names)


def host_homed(offload: Offload | None, unit: str | None, ids: frozenset[str] | None) -> bool:
    """Whether a buffer of ``unit`` (None: a buffer of several) lives on the host: all of the
    optimizer offloaded and, where units were named (``ids``), its unit among them."""
    if offload is None or offload.fraction != 1.0:
        return False
    return ids is None or unit in ids
