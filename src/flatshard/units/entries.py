"""Ranks agree on what they are about to gather at stage 3, before they gather it.

The reasoning is [Note: gather entries] below."""

# [Note: gather entries]
#
# At stage 3 each rank gathers unit after unit, and every rank must issue the same gathers in
# the same order: an all-gather whose sizes differ between ranks is no error on gloo but a
# SIGABRT of the rank that receives the wrong size, before any deadline fires. Ranks part
# ways only where user code does (one rank calls ``summon_full_params()`` or
# ``wait_for_params()`` while the others train on), so each *entry* into gathering starts
# with a fixed-size agreement on the gather group: an all-reduce (max) of the digest of what
# the rank is about to do and of minus that digest, two int64 on every rank whatever they do,
# so it pairs with any other rank's agreement and never with a gather. A difference is a
# ``DesyncError`` on every rank, naming this rank's entry and every rank's published position.
#
# The entries: a forward (with the state of every unit: a rank that freed the units a step
# prefetched, ``wait_for_params()``, would gather them again where the others go on), a
# backward, ``summon_full_params`` and ``full_state_dict``. Each costs one 16-byte all-reduce
# and a host sync, which at a forward's entry and a backward's falls where the root unit's
# gather is waited for anyway.

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from flatshard.comm.collectives import all_reduce
from flatshard.comm.deadline import disagreement
from flatshard.comm.world import World


def agree_on_entry(worlds: Iterable[World], what: str, detail: object = None) -> None:
    """Raise ``DesyncError`` on every rank of each gather world unless all are about to do
    ``what`` (with the same ``detail``); see the note."""
    digest = int.from_bytes(hashlib.sha256(repr((what, detail)).encode()).digest()[:7], "little")
    for world in worlds:
        if world.size == 1 or world.group is None:
            continue
        both = torch.tensor([digest, -digest], device=world.control_device)
        all_reduce(both, world, op="max").wait()
        if int(both[0]) != -int(both[1]):
            raise disagreement(
                dist.get_process_group_ranks(world.group),
                f"rank {dist.get_rank()} is about to {what} at stage 3, but not every rank of its "
                "data-parallel group is (their gathers would differ). Every rank must make the "
                "same calls that gather params (forward, backward, summon_full_params, "
                "wait_for_params, full_state_dict) in the same order",
            )
