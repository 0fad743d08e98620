"""Rank 0's values on every rank (``sync_module_states``, ``broadcast_buffers``).

At stage 3 rank 0's full values are sent before each rank keeps its shards; below it each
flat buffer is sent whole after binding, over its own world, with the fp32 values a
mixed-precision cast left. The module's buffers are sent again before a forward when the one
before it synced grads, as torch DDP does."""

from __future__ import annotations

import torch
from torch import nn

from flatshard.comm.collectives import broadcast
from flatshard.comm.world import World
from flatshard.engine.buffer import BufferSet
from flatshard.engine.tensor_parallel import local
from flatshard.engine.wrapper_tensors import inner_values
from flatshard.units.build import broadcast_values, unsharded_tensors
from flatshard.wrap.module import ShardedModule
from flatshard.wrap.plan import ParamPart


def broadcast_before_binding(
    module: nn.Module,
    parts: tuple[ParamPart, ...],
    originals: dict[str, torch.Tensor],
    worlds: tuple[World, World],
) -> None:
    """Stage 3 ``sync_module_states``: rank 0's full values, before each rank keeps its shards."""
    pairs = [(local(p), w) for part in parts for _, p in part.named for w in (part.world, part.replicate)]
    in_parts = {id(p) for part in parts for _, p in part.named}
    unsharded = [v for t in unsharded_tensors(module) if id(t) not in in_parts for v in inner_values(t)]
    pairs += [(t, w) for t in unsharded for w in worlds]
    pairs += [(t, w) for t in originals.values() for w in worlds]
    broadcast_values(pairs)


def broadcast_states(
    module: nn.Module, world: World, sets: list[BufferSet], *, buffers_over_world: bool = False
) -> None:
    """Copy rank 0's values everywhere: each flat buffer (one broadcast) over its own world,
    so expert params come from their expert group's rank 0 and experts stay distinct; the
    remaining params and the module's buffers over ``world``. ``buffers_over_world``: the
    flat buffers of sets that replicate over ``world`` go over ``world`` instead."""
    in_buffers = {id(p) for s in sets for p in s.params}
    if buffers_over_world:
        pairs = [(b.param_data, world) for s in sets if s.replicate is world for b in s.buffers]
    else:
        pairs = [(b.param_data, s.world) for s in sets for b in s.buffers]
    pairs += [(v, world) for p in module.parameters() if id(p) not in in_buffers for v in inner_values(p)]
    pairs += [(v, world) for t in module.buffers() for v in inner_values(t)]  # (a DTensor's local shard)
    handles = [broadcast(t, w) for t, w in pairs if t is not None]  # (stages 0-2: every buffer has its data)
    for h in handles:
        h.wait()


def broadcast_originals(originals: dict[str, torch.Tensor], sets: list[BufferSet]) -> None:
    """Rank 0's pre-cast values, over the worlds of each param's buffer set."""
    handles = []
    for bset in sets:
        for name in bset.names:
            if name in originals:
                handles += [broadcast(originals[name], w) for w in (bset.world, bset.replicate)]
    for h in handles:
        h.wait()


def buffer_broadcast_hooks(worlds: tuple[World, World]):
    """(pre-forward, post-forward) hooks: rank 0's buffers on every rank before a forward when
    the forward before it (or none: the first) ran with grad enabled and grads to sync, DDP's
    rule, within each shard row, then across rows, coalesced. So an eval forward right after a
    training one sees rank 0's running statistics on every rank, and the training forward after
    an eval, or after a ``no_sync`` micro-batch, is not preceded by a broadcast, as under DDP.
    Forwards under ``buffers_as_unwrapped`` (a host evaluating without its DDP, as the HF
    Trainer does) take no part.
    The buffers are looked up each time, so one a module replaces is broadcast too."""
    due = [True]  # (DDP's require_forward_param_sync)

    def before(module: ShardedModule, args: tuple) -> None:
        if not due[0] or module.flatshard_state.buffers_as_unwrapped:
            return
        buffers = list(module.buffers())
        for w in worlds:  # one after the other: rank 0's row, then from it across the rows
            broadcast_values([(b, w) for b in buffers])

    def after(module: ShardedModule, args: tuple, output: object) -> None:
        if module.flatshard_state.buffers_as_unwrapped:  # (a forward the host's DDP would not see)
            return
        due[0] = torch.is_grad_enabled() and module.flatshard_state.grad_sync.sync_enabled

    return before, after
