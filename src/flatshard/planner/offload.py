"""``Offload``: which of a rank's training bytes live on the host instead of the device.

The reasoning is [Note: memory tiers] below."""

# [Note: memory tiers]
#
# Each tensor a rank keeps for training has one home, the device or the host, decided when the
# model is sharded and the optimizer built, never moved behind the user's back. ``Offload``
# (given to ``shard(..., offload=...)``, read by the ``DistributedOptimizer`` built over the
# model) says which. With ``optimizer=True`` the optimizer's tensors of this rank live on the
# host: the main params (fp32 params get a host copy the step updates), a host frame for the
# grads, and the inner optimizer's state, created there by its first step. A step is
#
# 1. the grads as the optimizer prepared them (reduced, unscaled, clipped: [Note: prepared
#    grads] in ``optim/grad_prep.py``) copied from the device shards into the host frame;
# 2. the inner optimizer's update on the host, with torch's fused kernel for the classes that
#    have one, else ``foreach`` (never torch's default loop of ops over each tensor);
# 3. the new values copied to the device params, rounded to their dtype, before the next
#    forward reads them (stages 0-2).
#
# At stage 3 the main params are already the only copy of a rank's param shards ([Note:
# main-backed shards] in ``engine/buffer.py``), so offloading them offloads the shards: a
# unit's gather copies this rank's part from the host into the full bucket on the device, and
# the device keeps nothing per element of the rank's shard but its grads. fp32 params get the
# same host frame as their only copy.
#
# Invariants: the host main params are the values the optimizer steps, and any write that
# reaches the params outside a step reaches them as it reaches device main params (a load, a
# write through a param: [Note: writes through the params] watches fp32 params too when they
# are offloaded); the host copy of an fp32 param is no value of record ([Note: values of
# record] in ``wrap/record.py``): checkpoints and exports read the params, whose values it
# equals after every step.
#
# On an accelerator, host tensors are page-locked (``pin_memory``) and copies are asynchronous
# on the current stream: the grads' copies are waited for once before the host update; the
# params' copies are queued ahead of the next forward's work on the same stream. On a
# CPU-only machine host and device are the same memory: every copy still runs, and the homes
# are accounted by ownership (``memory_report``'s ``host`` bytes), so a CPU run tests the same
# code and counts the same bytes as a GPU run.

from __future__ import annotations

from dataclasses import dataclass


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
        what does not fit.
    """

    optimizer: bool | float = True
    pin_memory: bool = True
    device_budget: int | None = None

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

    @property
    def fraction(self) -> float:
        """The share of each rank's optimizer elements on the host."""
        return float(self.optimizer)


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
