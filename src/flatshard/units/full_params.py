"""Full params of a stage-3 module on demand: summoned, as a state dict, or loaded.

The reasoning is [Note: full params] below."""

# [Note: full params]
#
# * ``summon_full_params(writeback, rank0_only, with_grads)`` gathers every unit and yields
#   with each param a view of its full bucket. On exit, with ``writeback``, each rank copies
#   its own shard of every bucket back (what a user changed in the params is kept; fp32
#   main params take a value only where the 16-bit value changed, so unchanged ones keep
#   their full precision: [Note: main-backed shards] in ``engine/buffer.py``). ``with_grads``
#   gathers the reduced grad shards into ``param.grad`` for the block. ``rank0_only`` frees
#   the units again on every other rank. Below stage 3 the params are full already, and
#   ``with_grads`` gathers the grads the same way (``summon_grads``): at stages 1-2 only this
#   rank's shard of the grad buffer holds reduced values, so a view of the buffer would not do.
# * ``full_state_dict()`` gathers one unit at a time and gives rank 0 a plain CPU state dict
#   (other ranks an empty dict): never more than one unit in full.
# * ``load_full_state_dict`` copies each rank's pieces of every param out of a full state
#   dict (on every rank): no communication.

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from flatshard.comm.collectives import all_gather
from flatshard.engine.buffer import BufferSet
from flatshard.engine.lifecycle import Grads
from flatshard.engine.tensor_parallel import as_grad_of, full_value, local, local_shape, local_values
from flatshard.engine.wrapper_tensors import copy_to
from flatshard.units.parts import Part
from flatshard.units.placeholder import loading_into
from flatshard.units.unshard import Unsharder


class Stage3State(Protocol):
    """What these functions read of a wrapped stage-3 module's state (``ShardState``)."""

    @property
    def unsharder(self) -> Unsharder | None: ...  # (set at stage 3, where these functions run)

    @property
    def sets(self) -> Mapping[str, BufferSet]: ...

    def param_dtype_shards(self) -> AbstractContextManager[None]: ...

    def param_sets(self) -> list[BufferSet]: ...


@contextmanager
def summon(
    state: Stage3State, *, writeback: bool, rank0_only: bool, with_grads: bool, grads: Grads
) -> Iterator[None]:
    """``grads``: the module's grads since ``zero_grad`` (what ``with_grads`` may show)."""
    with (  # writeback writes the 16-bit shards
        state.param_dtype_shards(),
        _summon(state, writeback=writeback, rank0_only=rank0_only, grads=grads if with_grads else None),
    ):
        yield


@contextmanager
def _summon(state: Stage3State, *, writeback: bool, rank0_only: bool, grads: Grads | None) -> Iterator[None]:
    unsharder = _unsharder(state)
    if writeback and rank0_only:
        raise ValueError(
            "summon_full_params: writeback=True with rank0_only=True would lose other ranks' writes"
        )
    if unsharder.summoned:
        raise RuntimeError("summon_full_params: params are already summoned (blocks do not nest)")
    unsharder.agree("gather full params (summon_full_params)")
    unsharder.settle()
    parts = [part for unit_parts in unsharder.parts for part in unit_parts]
    for u in range(len(unsharder.units)):
        unsharder.unshard(u, exact=True)
    for u in range(len(unsharder.units)):
        unsharder.wait(u, exact=True)
    with_grads = [p for p in parts if p.buffer.has_grads] if grads is not None else []  # (frozen: none)
    previous = _gather_grads(with_grads, grads)
    if rank0_only and _rank(parts) != 0:
        unsharder.settle()
    unsharder.summoned = True
    try:
        yield
    finally:
        unsharder.summoned = False
        _restore_grads(with_grads, previous)
        if writeback:
            _write_back(parts)
        unsharder.settle()


@contextmanager
def summon_grads(sets: Iterable[BufferSet], grads: Grads) -> Iterator[None]:
    """Below stage 3: every trained param's ``.grad`` the full reduced grad of the last
    synced backward (zeros after ``zero_grad``), for the block; what it was again after it
    (stage 0 shows the grad buffer's views, as DDP does)."""
    parts = [
        Part(buffer, bucket, bset.world, bset.params)
        for bset in sets
        for buffer in bset.buffers
        if buffer.has_grads
        for bucket in buffer.layout.buckets
    ]
    previous = _gather_grads(parts, grads)
    try:
        yield
    finally:
        _restore_grads(parts, previous)


def _restore_grads(parts: list[Part], previous: list[torch.Tensor | None]) -> None:
    params = (part.params[slot.index] for part in parts for slot in part.bucket.params)
    for param, grad in zip(params, previous, strict=True):
        param.grad = grad


def _rank(parts: list[Part]) -> int:
    return parts[0].world.rank if parts else 0


def _write_back(parts: list[Part]) -> None:
    """Each rank's own part of every full bucket back into its shard; leaving
    ``param_dtype_shards`` then sets the main params where the value changed. A param whose
    ``.data`` was rebound inside the block (``vector_to_parameters``) gives its new values
    to the full bucket first (they would be lost with the view it left)."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for part in parts:
            buffer, bucket = part.buffer, part.bucket
            full = part.full_tensor()
            for slot in bucket.params:
                view, param = (
                    full[slot.start - bucket.start : slot.end - bucket.start],
                    part.params[slot.index],
                )
                if local(param).data_ptr() != view.data_ptr():
                    view.copy_(local(param).reshape(-1))
            buffer.param_shard(bucket).copy_(buffer.own_part(full, bucket))


def _gather_grads(parts: list[Part], grads: Grads | None) -> list[torch.Tensor | None]:
    """Full grads of every bucket from the reduced grad shards (zeros after ``zero_grad``,
    whatever the buffer still holds); ``param.grad`` views them (a copy in the param's dtype
    when the grads are kept in fp32). The params' ``.grad`` before, in part and slot order.
    Grads summed under ``no_sync`` and not reduced yet are refused (a ``RuntimeError``)."""
    if grads is Grads.UNREDUCED and parts:
        raise RuntimeError(
            "summon_full_params(with_grads=True): the grads were accumulated under no_sync and "
            "are not reduced yet; run the micro-batch that syncs first"
        )
    previous = [part.params[slot.index].grad for part in parts for slot in part.bucket.params]
    out, handles = [], []
    for part in parts:
        buffer, bucket = part.buffer, part.bucket
        full = torch.zeros(bucket.numel, dtype=buffer.layout.grad_dtype, device=buffer.device)
        mine = buffer.own_part(full, bucket)
        if grads is not Grads.EMPTY and buffer.has_grad_shard(bucket):  # (else zeros, gathered all the same)
            mine.copy_(buffer.grad_shard(bucket))
        if bucket.sharded and part.world.size > 1:
            handles.append(all_gather(full, mine, part.world, splits=bucket.splits))
        out.append(full)
    for h in handles:
        h.wait()
    for part, full in zip(parts, out, strict=True):
        for slot in part.bucket.params:
            param = part.params[slot.index]
            grad = full[slot.start - part.bucket.start : slot.end - part.bucket.start].view(
                local_shape(param)
            )
            param.grad = as_grad_of(param, grad.to(param.dtype))
    return previous


def full_state_dict(
    state: Stage3State,
    plain_state_dict: Callable[..., dict[str, Any]],
    skip: frozenset[int] | set[int] = frozenset(),
) -> dict[str, Any]:
    """Rank 0: every entry of the module's state dict on the CPU, the params whose ids are in
    ``skip`` (taken from elsewhere) as they are; other ranks: ``{}``."""
    unsharder = _unsharder(state)
    unsharder.agree("gather a full state dict")
    unsharder.settle()
    entries = plain_state_dict(keep_vars=True)
    unit_of = {
        id(part.params[slot.index]): u
        for u, unit_parts in enumerate(unsharder.parts)
        for part in unit_parts
        for slot in part.bucket.params
    }
    rank0 = _rank([p for ps in unsharder.parts for p in ps]) == 0 and replicate_rank(state) == 0
    out: dict[str, Any] = {}  # (None where ``skip`` leaves it to the caller)
    for u in range(len(unsharder.units)):
        keys = [k for k, t in entries.items() if unit_of.get(id(t)) == u and id(t) not in skip]
        if not keys:
            continue
        unsharder.wait(u, exact=True)
        for k in keys:  # (a tp shard is gathered full by every tp rank: [Note: tensor-parallel params])
            value = full_value(entries[k], entries[k].detach())
            if rank0:
                out[k] = value.to("cpu", copy=True)
        unsharder.reshard(u)
    if not rank0:
        return {}
    for k, t in entries.items():
        if k not in out:
            if id(t) in skip:
                out[k] = None  # (the caller fills it)
            else:
                out[k] = copy_to(t, "cpu") if isinstance(t, torch.Tensor) else t
    return {k: out[k] for k in entries}


def _unsharder(state: Stage3State) -> Unsharder:
    if state.unsharder is None:
        raise RuntimeError("full params are gathered by unit at stage 3 only")
    return state.unsharder


def replicate_rank(state: Stage3State) -> int:
    return min((bset.replicate.rank for bset in state.param_sets()), default=0)


def load_full_state_dict(
    state: Stage3State,
    state_dict: Mapping[str, Any],
    strict: bool,
    plain_state_dict: Callable[..., dict[str, Any]],
    plain_load: Callable[..., Any],
) -> tuple[list[str], list[str], dict[str, torch.Tensor]]:
    """Load ``state_dict`` through torch's own ``load_state_dict``, so the modules' load hooks
    run as they do unsharded; each sharded param's value lands in this rank's piece of it
    (``loading_into``). Returns torch's (missing_keys, unexpected_keys) and the values the
    sharded params took, by param name.

    A DTensor param's ``copy_`` goes to DTensor, not to a placeholder: its entry is taken by
    its key before torch's load, so a load hook that renames it is not seen."""
    _unsharder(state).settle()
    slots = {}
    for bset in state.param_sets():
        for buffer in bset.buffers:
            for slot in buffer.layout.params:
                slots[id(bset.params[slot.index])] = (buffer, slot)
    entries = {k: t for k, t in plain_state_dict(keep_vars=True).items() if id(t) in slots}
    names: dict[int, str] = {}
    for k, t in entries.items():
        names.setdefault(id(t), k)  # (a tied param by its first name)
    loaded: dict[str, torch.Tensor] = {}

    def load(param: torch.Tensor, value: torch.Tensor) -> None:
        buffer, slot = slots[id(param)]
        # (main params, if they hold the shard, at full precision; a DTensor's local shard)
        buffer.load_param(slot, local_values(param, value))
        loaded[names[id(param)]] = value

    dtensors = {k: t for k, t in entries.items() if isinstance(t, DTensor)}
    with torch.no_grad():
        for key, param in dtensors.items():
            if key in state_dict:
                value = state_dict[key]
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"load_state_dict: {key!r} has shape {tuple(value.shape)} in the state dict, "
                        f"{tuple(param.shape)} in the model"
                    )
                load(param, value)
        with loading_into(load):
            result = plain_load({k: v for k, v in state_dict.items() if k not in dtensors}, strict=False)
    missing = [k for k in dtensors if k not in state_dict]
    missing += [k for k in result.missing_keys if k not in dtensors]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(
            f"load_state_dict: missing keys {missing}, unexpected keys {list(result.unexpected_keys)}"
        )
    return missing, list(result.unexpected_keys), loaded
