"""``flatshard.shard``: the public entry point, and its small policies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from flatshard.comm.collectives import CommStats, broadcast
from flatshard.comm.deadline import DEFAULT_TIMEOUT, HERE, Phase, as_timeout, publish_positions
from flatshard.comm.world import ONE, World, check_ranks_agree, resolve_world, resolve_worlds
from flatshard.engine.buffer import BufferSet, FlatBuffer
from flatshard.engine.dynamo import eager
from flatshard.engine.grad_sync import (
    GradSync,
    build_reductions,
)
from flatshard.engine.param_gather import ParamGather
from flatshard.planner.layout import plan_layout
from flatshard.planner.mixed_precision import MixedPrecision, cast_params, input_cast_hook
from flatshard.planner.stage import SCHEDULE, Buckets, Stage3, StagePolicy
from flatshard.toolkit.malloc import warn_once_without_tunables
from flatshard.units.build import (
    broadcast_values,
    build_unsharder,
    initialize_units,
    is_meta_model,
    replace_meta_params,
    unsharded_tensors,
)
from flatshard.units.unit_tree import outer_blocks
from flatshard.wrap.arguments import (
    bucket_options,
    check_arguments,
    check_devices,
    check_flags,
)
from flatshard.wrap.changes import WrappedTree
from flatshard.wrap.init import default_init
from flatshard.wrap.module import ShardedModule, ShardState, make_sharded
from flatshard.wrap.specs import WholeParams, param_specs, stage3_units, tied_params, whole_param_names

FROZEN = "frozen"
"""The key of stage 3's frozen params' ``ParamPart`` (a buffer set without grads)."""


@dataclass(frozen=True)
class Experts:
    """Params that are data-parallel over another group (e.g. mixture-of-experts experts).

    ``match(name, param)`` selects them; they get their own buffers, reduce over ``group``
    and scale their grads by ``grad_scale`` (None: ``1 / size of group``).
    """

    group: object
    match: Callable[[str, nn.Parameter], bool]
    grad_scale: float | None = None

    def __post_init__(self) -> None:
        if not callable(self.match):
            raise TypeError(f"Experts.match must be a predicate (name, param) -> bool, got {self.match!r}")


def shard(
    module: nn.Module,
    *,
    stage: int = 0,
    group: object = None,
    buckets: Buckets | None = None,
    grad_scale: float | None = None,
    expert: Experts | None = None,
    find_unused_parameters: bool = False,
    sync_module_states: bool = True,
    broadcast_buffers: bool = True,
    mixed_precision: MixedPrecision | None = None,
    whole_params: WholeParams = None,
    timeout: float | timedelta | None = DEFAULT_TIMEOUT,
    stage3: Stage3 | None = None,
) -> ShardedModule:
    """Make ``module`` data-parallel over ``group`` with ZeRO stage ``stage``; returns it.

    The module keeps its class's behaviour, parameter names and state-dict keys; its
    trainable params become views into flat buffers (``param.main_grad`` too), and each
    backward reduces their grads bucket by bucket while backward is still running.

    Args:
        stage: ZeRO stage. 0 is DDP: every rank keeps full params, grads and optimizer state.
            1 shards the optimizer state (use ``flatshard.DistributedOptimizer``); 2 also
            keeps grads only as this rank's shards between backwards.
        group: a ProcessGroup or a 1-D DeviceMesh (default: the default group, or a world of
            one when torch.distributed is not initialized); at stages >= 1 also a 2-D
            DeviceMesh (replicate, shard): replicated sharding, where buckets are sharded over
            the inner dimension and each shard's grads are all-reduced over the outer one.
        buckets: how the flat buffers are cut into buckets and reduced: a
            ``flatshard.Buckets`` (``size``, default 2**22 elements; ``per_launch``;
            ``pad_for_high_busbw``).
        grad_scale: factor applied to grads before the sum over ranks; None averages
            (``1 / world size``, all ranks of a 2-D mesh); e.g. 1.0 for a loss already
            summed over tokens.
        expert: params that reduce over another group (see ``Experts``).
        find_unused_parameters: as in DDP: a param that got no grad on any rank keeps
            ``grad=None`` (one extra small all-reduce per step); otherwise its grad is zero.
        sync_module_states: start from rank 0's params and buffers (the default, as torch
            DDP does at every stage: ranks built from different seeds would otherwise train
            apart); False keeps each rank's own, which must then be equal.
        broadcast_buffers: before each forward that will sync grads (grad enabled, outside
            ``no_sync``), copy rank 0's buffers (BatchNorm's running statistics, ...) to every
            rank in one coalesced broadcast per dtype, as torch DDP does by default; False
            leaves each rank's buffers its own.
        mixed_precision: store and compute params in ``param_dtype`` (see ``MixedPrecision``).
        whole_params: params (or a predicate ``(name, param) -> bool``) that a sharded layout
            keeps whole in one rank's shard, so that ``DistributedOptimizer`` can step them
            with a rule that needs the whole matrix (Muon); their buckets pad each shard to
            the fullest one ([Note: whole-param buckets] in ``layout.py``).
        timeout: the deadline of each collective flatshard issues (seconds or a timedelta;
            default 10 minutes; None: the process group's own). One that has not completed
            by then raises ``flatshard.DesyncError`` on every rank, naming each rank's step,
            phase and collective ([Note: deadlines] in ``comm/deadline.py``).

        stage3: at stage 3, which modules are units and how they are gathered, materialized
            and freed: a ``flatshard.Stage3`` (``units``, ``reshard_after_forward``,
            ``forward_prefetch``, ``backward_prefetch``, ``limit_all_gathers``,
            ``unit_bytes``, ``device``, ``param_init_fn``, ``ignored_modules``; [Note:
            unsharding] in ``units/unshard.py``). Refused at stages 0-2.
    """
    buckets = bucket_options(buckets)
    bucket_size, buckets_per_launch = buckets.size, buckets.per_launch
    policy = StagePolicy.build(stage, stage3)
    s3 = stage3 or Stage3()
    units, ignored_modules, unit_bytes = s3.units, s3.ignored_modules, s3.unit_bytes
    check_arguments(module, grad_scale)
    check_flags(
        find_unused_parameters=find_unused_parameters,
        sync_module_states=sync_module_states,
        broadcast_buffers=broadcast_buffers,
    )
    world, replicate = _worlds(group, policy, timeout)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a flatshard.MixedPrecision or None, got {mixed_precision!r}"
        )
    mp = mixed_precision or MixedPrecision()
    replicated = _frozen_replicated(module, policy, expert, ignored_modules)
    kept_whole = whole_param_names(module, whole_params)  # (names: a meta model's params are replaced)
    named, meta, device, originals = _prepare_params(module, policy, mp, s3.device, replicated)
    unit_list, unit_of = stage3_units(module, named, units, unit_bytes) if policy.gathers_units else ([], {})
    specs_of = partial(
        param_specs, tied=tied_params(module), unit_of=unit_of, whole=kept_whole, mixed_precision=mp
    )
    parts = _split_worlds(named, world, replicate, grad_scale, expert)
    parts += _frozen_part(module, replicated, unit_of, world, replicate) if policy.shards_params else []
    config = _agreement_lines(
        module,
        policy,
        mp,
        [u.name for u in unit_list],
        replicated,
        meta=meta,
        bucket_size=bucket_size,
        buckets_per_launch=buckets_per_launch,
        grad_scale=grad_scale,
        find_unused_parameters=find_unused_parameters,
        sync_module_states=sync_module_states,
        broadcast_buffers=broadcast_buffers,
        pad_for_high_busbw=buckets.pad_for_high_busbw,
    )
    _check_agreement(parts, config, specs_of)
    if sync_module_states and policy.shards_params and not meta:  # rank 0's values, then bind
        _broadcast_before_binding(module, parts, originals, (world, replicate))
    sets = {}
    for part in parts:
        sets[part.key] = _build_set(part, specs_of, policy, bucket_size, buckets.pad_for_high_busbw)
    if sync_module_states and not policy.shards_params:
        for w in (world, replicate):  # shard rows first, then across them: all from rank 0
            _broadcast_states(module, w, list(sets.values()), buffers_over_world=w is replicate)
        _broadcast_originals(originals, list(sets.values()))
    sharded = _assemble(
        module,
        policy,
        sets,
        buckets_per_launch,
        find_unused_parameters,
        mp.reduce_dtype,
        (unit_list, unit_of),
        originals=originals or None,
    )
    if meta:
        worlds = [w for w in (world, replicate) if w.size > 1] if sync_module_states else None
        init_fn = s3.param_init_fn or default_init(module)  # ([Note: default init] in wrap/init.py)
        unsharder = sharded.flatshard_state.unsharder
        assert unsharder is not None  # (a meta model is sharded at stage 3 only)
        initialize_units(module, unsharder, init_fn, device, worlds)
    _add_forward_pre_hooks(sharded, mp, (world, replicate) if broadcast_buffers else None)
    return sharded


def _add_forward_pre_hooks(sharded: ShardedModule, mp: MixedPrecision, buffer_worlds) -> None:
    """The root's own: the check that nothing was replaced since wrapping (first), rank 0's
    buffers (``broadcast_buffers``: ``buffer_worlds``), the mixed-precision input cast."""
    state = sharded.flatshard_state
    tree = WrappedTree(sharded, None if state.policy.shards_params else state.take_values)
    state.tree = tree
    sharded.register_forward_pre_hook(eager(tree.hook), prepend=True)
    if buffer_worlds and any(w.size > 1 for w in buffer_worlds) and any(True for _ in sharded.buffers()):
        sharded.register_forward_pre_hook(eager(_buffer_broadcast_hook(buffer_worlds)))
    if mp.param_dtype is not None:
        sharded.register_forward_pre_hook(
            eager(_mixed_precision_hook(sharded.flatshard_state, mp)), with_kwargs=True
        )


def _agreement_lines(
    module: nn.Module,
    policy: StagePolicy,
    mp: MixedPrecision,
    units: list[str],
    replicated: set[int],
    **options,
):
    """What every rank must agree on before wrapping, one option per line so that a
    difference is named: everything that changes the sequence of collectives (the stage, the
    unit schedule, bucketing, syncing, padding, mixed precision, units) and the frozen params,
    with which of them stay replicated at stage 3 (``ignored_modules``)."""
    kept = " replicated" if policy.shards_params else ""
    return [
        f"stage={policy.stage}",
        *(f"{k}={getattr(policy.stage3, k)}" for k in SCHEDULE),
        *(f"{k}={v}" for k, v in options.items()),
        f"mixed_precision={mp}",
        f"units={units}",
        *(
            f"frozen {n} {tuple(p.shape)} {p.dtype}{kept if id(p) in replicated else ''}"
            for n, p in module.named_parameters()
            if not p.requires_grad
        ),
    ]


def _frozen_replicated(module: nn.Module, policy: StagePolicy, expert, ignored_modules) -> set[int]:
    """Ids of the frozen params replicated on every rank (not sharded): all of them below stage 3;
    at stage 3 those of ``ignored_modules``, expert params and non-floating ones."""
    frozen = {id(p): (n, p) for n, p in module.named_parameters() if not p.requires_grad}
    if not policy.shards_params:
        return set(frozen)
    ignored = {id(p) for m in (ignored_modules or ()) for p in _checked_ignored(module, m).parameters()}
    return {
        key
        for key, (n, p) in frozen.items()
        if key in ignored
        or not p.is_floating_point()
        or p.numel() == 0  # (nothing to shard)
        or (expert is not None and expert.match(n, p))
    }


def _checked_ignored(module: nn.Module, sub: object) -> nn.Module:
    if not isinstance(sub, nn.Module) or not any(sub is m for m in module.modules()):
        raise ValueError(f"ignored_modules: {_short_repr(sub)} is not a submodule of the model")
    return sub


def _short_repr(value: object) -> str:
    text = repr(value).splitlines()[0]
    return text if len(text) <= 60 else text[:57] + "..."


def _frozen_part(
    module: nn.Module, replicated: set[int], unit_of, world: World, replicate: World
) -> list[ParamPart]:
    """Stage 3: the frozen params not ``replicated``, sorted by unit as the trainable ones."""
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and id(p) not in replicated]
    frozen.sort(key=lambda item: unit_of[id(item[1])])
    return [ParamPart(FROZEN, world, replicate, frozen, None)] if frozen else []


def _check_agreement(parts: list[ParamPart], config: list[str], specs_of) -> None:
    """Every rank passed the same options and params (each part over its worlds)."""
    for part in parts:
        lines = [
            *config,
            *(_describe(part.key, p, s) for (_, p), s in zip(part.named, specs_of(part.named), strict=True)),
        ]
        for w in (part.world, part.replicate):
            check_ranks_agree(w, lines, f"the {part.key} params")


def _prepare_params(module: nn.Module, policy: StagePolicy, mp: MixedPrecision, device, replicated: set[int]):
    """(trainable named params, whether the model is on meta, the device, fp32 originals):
    a meta model gets placeholders on ``device`` (its frozen params too, unless
    ``replicated``); params are cast to ``mp.param_dtype``."""
    named = _trainable(module)
    if not named and not policy.shards_params:
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires grad: below stage 3 frozen params "
            "stay replicated on every rank, so there is nothing to shard (stage 3 shards them: a reference "
            "model or a teacher)"
        )
    meta = is_meta_model(named)
    if meta and not policy.gathers_units:
        raise ValueError(f"a model on the meta device is materialized unit by unit at stage 3; got {policy}")
    originals = cast_params(module, mp.param_dtype) if mp.param_dtype is not None else {}
    if meta:  # placeholders on the device (cast first: meta tensors cost nothing)
        originals = {}  # the main params start from the initialized values
        device = _default_device() if device is None else torch.device(device)
        replace_meta_params(module, device, replicated)
    named = _trainable(module)
    check_devices(named)
    return named, meta, device, originals


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The params the flat buffers hold. A param of no elements has nothing to reduce, shard
    or step: it stays a plain param on every rank, as under DDP and FSDP2."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and p.numel() > 0]


def _broadcast_before_binding(module: nn.Module, parts, originals, worlds) -> None:
    """Stage 3 ``sync_module_states``: rank 0's full values, before each rank keeps its shards."""
    pairs = [(p.data, w) for part in parts for _, p in part.named for w in (part.world, part.replicate)]
    in_parts = {id(p) for part in parts for _, p in part.named}
    pairs += [(t, w) for t in unsharded_tensors(module) if id(t) not in in_parts for w in worlds]
    pairs += [(t, w) for t in originals.values() for w in worlds]
    broadcast_values(pairs)


def _buffer_broadcast_hook(worlds: tuple[World, World]):
    """Rank 0's buffers on every rank before each forward that will sync grads (grad enabled,
    not under ``no_sync``: when DDP syncs them), within each shard row, then across rows,
    coalesced. The buffers are looked up each time, so one a module replaces is broadcast too."""

    def hook(module: ShardedModule, args: tuple) -> None:
        if not (torch.is_grad_enabled() and module.flatshard_state.grad_sync.sync_enabled):
            return  # (an eval forward, generate(), a no_sync micro-batch: as DDP, no broadcast)
        buffers = list(module.buffers())
        for w in worlds:  # one after the other: rank 0's row, then from it across the rows
            broadcast_values([(b, w) for b in buffers])

    return hook


def _mixed_precision_hook(state: ShardState, mp: MixedPrecision):
    """Cast floating inputs; drop the fp32 originals once the model runs (an optimizer built
    later starts from the 16-bit values)."""
    cast = input_cast_hook(mp.param_dtype) if mp.cast_forward_inputs and mp.param_dtype else None

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        state.originals = None
        return cast(module, args, kwargs) if cast is not None else None

    return hook


def _broadcast_originals(originals: dict[str, torch.Tensor], sets: list[BufferSet]) -> None:
    """Rank 0's pre-cast values, over the worlds of each param's buffer set."""
    handles = []
    for bset in sets:
        for name in bset.names:
            if name in originals:
                handles += [broadcast(originals[name], w) for w in (bset.world, bset.replicate)]
    for h in handles:
        h.wait()


def _assemble(
    module,
    policy: StagePolicy,
    sets,
    buckets_per_launch,
    find_unused_parameters,
    reduce_dtype,
    units,
    *,
    originals,
) -> ShardedModule:
    """Reductions, the grad-sync state machine, and the param gathers (stages 1-2) or
    the unsharder (stage 3, over the frozen params' set too). ``originals``: the fp32 values
    before a MixedPrecision cast, or None."""
    frozen = sets.pop(FROZEN, None)
    stats = CommStats()
    groups = build_reductions(list(sets.values()), buckets_per_launch, stats, reduce_dtype)
    gather = unsharder = None
    if policy.gathers_buckets_after_step:
        gather = ParamGather(module, list(sets.values()), stats, outer_blocks(module))
    if policy.gathers_units:
        unit_list, unit_of = units
        every = [*sets.values(), *([frozen] if frozen is not None else [])]
        unsharder = build_unsharder(unit_list, unit_of, every, stats, policy.stage3)
        if any(b.world.size > 1 and b.params and b.params[0].device.type == "cpu" for b in every):
            warn_once_without_tunables()  # gathers and frees fragment glibc's heap otherwise
    sync = GradSync(
        list(sets.values()),
        groups,
        policy=policy,
        find_unused_parameters=find_unused_parameters,
        stats=stats,
        gathers=unsharder,
    )
    state = ShardState(
        policy, sets, sync, stats, gather, originals=originals, unsharder=unsharder, frozen=frozen
    )
    sharded = make_sharded(module, state)
    sharded.register_forward_hook(eager(_backward_start_hook(sync)))
    return sharded


@dataclass(frozen=True)
class ParamPart:
    """Trainable params that share a world: they become one ``BufferSet``."""

    key: str  # "main" or "expert"
    world: World  # the shard world
    replicate: World  # replicated sharding's replicate world (ONE otherwise)
    named: list[tuple[str, nn.Parameter]]
    grad_scale: float | None  # None: 1 / (world size x replicate size)


def _split_worlds(
    named, world: World, replicate: World, grad_scale, expert: Experts | None
) -> list[ParamPart]:
    """The main params and the expert params, each with its worlds and grad scale."""
    parts: list[ParamPart] = []
    if expert is not None:
        is_expert = [bool(expert.match(n, p)) for n, p in named]
        chosen = [np for np, e in zip(named, is_expert, strict=True) if e]
        named = [np for np, e in zip(named, is_expert, strict=True) if not e]
        if chosen:
            parts.append(
                ParamPart(
                    "expert", resolve_world(expert.group, world.timeout), ONE, chosen, expert.grad_scale
                )
            )
    if named:
        parts.insert(0, ParamPart("main", world, replicate, named, grad_scale))
    return parts


def _worlds(group: object, policy: StagePolicy, timeout: float | timedelta | None) -> tuple[World, World]:
    """(shard world, replicate world) of ``group`` with the collectives' deadline; this rank
    starts publishing its position ([Note: deadlines])."""
    world, replicate = resolve_worlds(group, as_timeout(timeout))
    if replicate.size > 1 and not policy.allows_replicated_mesh:
        raise ValueError(
            f"group: a 2-D (replicate x shard) mesh is replicated sharding, which needs stage >= 1; "
            f"got {policy} (pass the flattened group for plain data parallelism)"
        )
    if world.group is not None:
        publish_positions()
        HERE.enter(Phase.WRAP)
    return world, replicate


def _describe(key: str, param: nn.Parameter, spec) -> str:
    whole = " whole" if spec.whole else ""
    return f"{key} {spec.name} {tuple(param.shape)} {param.dtype} unit={spec.unit}{whole}"


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _build_set(part: ParamPart, specs_of, policy: StagePolicy, bucket_size, pad_for_high_busbw) -> BufferSet:
    world, named = part.world, part.named
    specs = specs_of(named)
    layout = plan_layout(
        specs,
        world_size=world.size,
        bucket_size=bucket_size,
        shard=policy.pads_for_shards,
        pad_for_high_busbw=pad_for_high_busbw,
    )
    params = [p for _, p in named]
    buffers = []
    for buffer_layout in layout.buffers:
        buffer = FlatBuffer(
            buffer_layout,
            params[0].device,
            rank=world.rank,
            full_grads=not policy.shards_grads,
            sharded_params=policy.shards_params,
            grads=part.key != FROZEN,
        )
        buffer.bind(params)
        buffers.append(buffer)
    return BufferSet(
        world,
        layout,
        buffers,
        params,
        [n for n, _ in named],
        1.0 / (world.size * part.replicate.size) if part.grad_scale is None else part.grad_scale,
        part.replicate,
    )


def _broadcast_states(
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
    pairs += [(p.data, world) for p in module.parameters() if id(p) not in in_buffers]
    pairs += [(t, world) for t in module.buffers()]
    handles = [broadcast(t, w) for t, w in pairs if t is not None]  # (stages 0-2: every buffer has its data)
    for h in handles:
        h.wait()


def _backward_start_hook(sync: GradSync):
    """A forward hook that queues the end-of-backward callback when backward reaches the
    module's output, so a rank whose params get no grad still joins the reductions."""

    def hook(module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grad: sync.on_backward_start(), mode="any")

    return hook
