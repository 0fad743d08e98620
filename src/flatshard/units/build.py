"""Building stage 3: units, the unsharder, rank 0's initial values and meta-device models.

The reasoning is in the notes below ([Note: meta init], ...)."""

# [Note: meta init]
#
# A model built on the ``meta`` device has no values. ``shard(..., stage=3)`` gives each of its
# trainable params a placeholder on ``device``, lays out and binds the buffers as usual (the
# shards hold nothing yet), then initializes the model *unit by unit*: the unit's buckets are
# allocated full, its params pointed at them, ``param_init_fn(module)`` (default: the
# module's own ``reset_parameters()``, [Note: default init] in ``wrap/init.py``) runs on
# each module that registers params or buffers in it, rank 0's values are broadcast when
# ``sync_module_states``, each rank keeps its shards and the buckets are freed. No rank ever
# holds more than one unit in full. Frozen params and buffers on ``meta`` are materialized
# (they are not sharded) and initialized the same way.
# Without ``sync_module_states`` every rank must seed its RNG alike.
#
# [Note: frozen params]
#
# At stage 3 a frozen (``requires_grad=False``) floating param is sharded like a trainable
# one, so that a LoRA-style fine-tune holds its frozen base at (frozen elements x bytes) / N
# per rank, as FSDP does. Invariants:
#
# * Frozen params get a buffer set of their own (``ShardState.frozen``), laid out by unit
#   like the trainable ones, in their own dtype (``MixedPrecision`` casts them), with no grad
#   storage and no reduction: nothing reduces them and no optimizer sees them. Their
#   buckets are parts of their unit, so they are gathered and freed with it, by the same
#   schedule; checkpoints, ``full_state_dict``, ``summon_full_params`` and ``memory_report``
#   read them through ``ShardState.param_sets()``.
# * Freeing in backward. A unit is otherwise freed once each of its params has its grad;
#   that is too early for frozen weights, whose only use in backward may be the grad of the
#   unit's input (``grad_x = grad_y @ W`` of a frozen linear), which autograd can compute
#   after the adapters' grads. So a unit holding frozen params is freed once, in addition,
#   the grads of every forward's floating inputs that require grad are computed (a
#   multi-grad hook on them, counted per forward); with no such input a frozen weight's
#   backward can only lead to the unit's own trainable params, whose grads come last. That
#   fails for a unit whose forward encloses other units (the root: its frozen final norm runs
#   after the blocks, its trainable head after that, so the head's grad comes before the
#   norm's backward; peft's ``modules_to_save`` made every grad NaN): such a unit holding
#   frozen params stays gathered until the end of backward, as FSDP2 keeps its root. A unit
#   whose forward was never followed by a backward is freed at the end of the next one.
# * A model whose params are all frozen (a DPO reference, a distillation teacher) has only
#   this buffer set: forward and ``generate`` gather it unit by unit; no optimizer takes it.
# * Frozen params of ``ignored_modules``, expert params and non-floating ones stay replicated on
#   every rank (as at stages 0-2, where frozen params are never sharded); a meta-device
#   model's sharded frozen params are materialized unit by unit like the trainable ones.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from flatshard.comm.collectives import CommStats, broadcast
from flatshard.comm.world import World, side_world
from flatshard.engine.buffer import BufferSet
from flatshard.engine.fp8_gathers import Fp8Cast, fp8_scales
from flatshard.planner.stage import Stage3
from flatshard.units.full_buckets import FullBuckets
from flatshard.units.parts import Part
from flatshard.units.unit_tree import Unit, module_units
from flatshard.units.unshard import Unsharder

COALESCE_NUMEL = 2**22
"""Elements per broadcast when rank 0's values are sent to every rank before binding."""


def build_unsharder(
    units: list[Unit],
    unit_of: dict[int, int],
    sets: Sequence[BufferSet],
    stats: CommStats,
    options: Stage3,
    fp8: Mapping[str, Fp8Cast],
) -> Unsharder:
    """The parts (buckets) of each unit and the ``Unsharder`` over them; ``fp8``: how each
    weight gathered in fp8 is cast, by name ([Note: fp8 gathers])."""
    parts: list[list[Part]] = [[] for _ in units]
    for bset in sets:
        gather_world = side_world(bset.world)
        scales = fp8_scales(bset.buffers, fp8, gather_world)
        for buffer in bset.buffers:
            full = FullBuckets(buffer, bset.params)  # (its params are placeholders from here on)
            in_fp8 = scales if buffer.layout.gather_dtype is not None else None
            for bucket in buffer.layout.buckets:
                first = bset.params[bucket.params[0].index]
                part = Part(buffer, bucket, gather_world, bset.params, full, in_fp8)
                parts[unit_of[id(first)]].append(part)
    return Unsharder(units, parts, stats, options)


def broadcast_values(pairs: Sequence[tuple[torch.Tensor, World]]) -> None:
    """Copy rank 0's values of every tensor to every rank of its world, coalesced into
    flat broadcasts of at most ``COALESCE_NUMEL`` elements per (world, dtype)."""
    chunks: dict[tuple[int, torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    worlds: dict[int, World] = {}
    for tensor, world in pairs:
        if world.size == 1:
            continue
        worlds[id(world)] = world
        lists = chunks.setdefault((id(world), tensor.dtype, tensor.device), [[]])
        if sum(t.numel() for t in lists[-1]) + tensor.numel() > COALESCE_NUMEL and lists[-1]:
            lists.append([])
        lists[-1].append(tensor)
    pending = []
    for (key, _, _), lists in chunks.items():
        for tensors in lists:
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            pending.append((broadcast(flat, worlds[key]), flat, tensors))
    with torch.no_grad():
        for handle, flat, tensors in pending:
            handle.wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def is_meta_model(named: Sequence[tuple[str, nn.Parameter]]) -> bool:
    """Whether the trainable params are on the meta device (all or none of them)."""
    meta = [n for n, p in named if p.is_meta]
    if meta and len(meta) != len(named):
        real = next(n for n, p in named if not p.is_meta)
        raise ValueError(f"param {meta[0]!r} is on the meta device but {real!r} is not: all or none")
    return bool(meta)


def replace_meta_params(module: nn.Module, device: torch.device, replicated: set[int]) -> None:
    """Give every meta param that is sharded (trainable, or frozen and not ``replicated``)
    a placeholder on ``device`` (a new Parameter in each module that registers it, so tied
    params stay tied)."""
    new: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta or (not p.requires_grad and id(p) in replicated):
                continue
            if id(p) not in new:
                nan = torch.full((1,), float("nan"), dtype=p.dtype, device=device)
                new[id(p)] = nn.Parameter(nan.expand(p.shape), requires_grad=p.requires_grad)
            sub._parameters[name] = new[id(p)]


def initialize_units(
    module: nn.Module,
    unsharder: Unsharder,
    init_fn: Callable[[nn.Module], None],
    device: torch.device,
    sync_worlds: Sequence[World] | None,
) -> None:
    """[Note: meta init]: initialize ``module`` one unit at a time."""
    owner = module_units(unsharder.units)
    for unit in unsharder.units:
        modules = [m for top in unit.modules for m in top.modules() if owner.get(id(m)) == unit.index]
        with torch.no_grad():
            for m in modules:
                _materialize_locals(m, device)
            for part in unsharder.parts[unit.index]:
                unsharder.allocate(part).zero_()
                part.point(full=True)
            for m in modules:
                if _holds_state(m):
                    init_fn(m)  # (shard()'s default: [Note: default init] in wrap/init.py)
            if sync_worlds:
                pairs = [(part.full_tensor(), w) for part in unsharder.parts[unit.index] for w in sync_worlds]
                pairs += [
                    (t, w) for m in modules for t in unsharded_tensors(m, recurse=False) for w in sync_worlds
                ]
                broadcast_values(pairs)
            for part in unsharder.parts[unit.index]:
                buffer, bucket = part.buffer, part.bucket
                buffer.param_shard(bucket).copy_(buffer.own_part(part.full_tensor(), bucket))
                part.point(full=False)
                unsharder.free(part)


def _materialize_locals(module: nn.Module, device: torch.device) -> None:
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta:
            module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def unsharded_tensors(module: nn.Module, *, recurse: bool = True) -> list[torch.Tensor]:
    """The module's frozen params and buffers (``recurse=False``: its own only): the
    tensors no flat buffer holds."""
    frozen = [p for p in module.parameters(recurse=recurse) if not p.requires_grad]
    return frozen + list(module.buffers(recurse=recurse))
