"""``flatshard.shard``: plan, build, attach.

``shard()`` takes three steps, each handing the next what it made: ``plan_wrap`` checks the
arguments and decides everything (a ``WrapPlan``, ``wrap/plan.py``); ``build_sets`` has the
ranks agree on the plan and builds the flat buffers it describes, with rank 0's values;
``attach`` gives the module its reductions, grad sync and gathers, its ``ShardState`` and
class, and its hooks."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from flatshard.comm.collectives import CommStats
from flatshard.comm.deadline import DEFAULT_TIMEOUT
from flatshard.comm.world import check_ranks_agree
from flatshard.engine.buffer import BufferSet, FlatBuffer
from flatshard.engine.dynamo import eager
from flatshard.engine.fp8_gathers import fp8_scales
from flatshard.engine.grad_sync import GradSync, build_reductions
from flatshard.engine.grad_view import ExpertSpread
from flatshard.engine.param_gather import ParamGather
from flatshard.planner.budget import BudgetSpecs
from flatshard.planner.layout import ParamSpec, plan_layout
from flatshard.planner.mixed_precision import MixedPrecision, input_cast_hook
from flatshard.planner.offload import Offload, unit_ids
from flatshard.planner.stage import Buckets, Stage3
from flatshard.toolkit.malloc import warn_once_without_tunables
from flatshard.units.build import build_unsharder, initialize_units
from flatshard.units.unit_tree import outer_blocks
from flatshard.units.unshard import Unsharder
from flatshard.wrap.changes import LoadHooks, WrappedTree
from flatshard.wrap.init import default_init
from flatshard.wrap.module import ShardedModule, ShardState, make_sharded
from flatshard.wrap.plan import FROZEN, Experts, ParamPart, WrapPlan, agreement_lines, plan_wrap
from flatshard.wrap.specs import WholeParams
from flatshard.wrap.sync_states import (
    broadcast_before_binding,
    broadcast_originals,
    broadcast_states,
    buffer_broadcast_hooks,
)

__all__ = ["Experts", "shard"]


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
    offload: Offload | None = None,
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
        find_unused_parameters: as in DDP: some params may get no grad on some ranks (control
            flow that differs between ranks); stage 3 then never waits for a reduction during
            backward on the promise that every param of a unit that ran gets a grad. Either
            way a param no rank used keeps ``grad=None`` and the step skips it, as torch's.
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
        offload: a ``flatshard.Offload``: the ``DistributedOptimizer``'s main params and state
            on the host, stepped there, and at stage 3 the param shards too ([Note: memory
            tiers] in ``planner/offload.py``).
    """
    plan = plan_wrap(
        module,
        stage=stage,
        group=group,
        buckets=buckets,
        grad_scale=grad_scale,
        expert=expert,
        find_unused_parameters=find_unused_parameters,
        sync_module_states=sync_module_states,
        broadcast_buffers=broadcast_buffers,
        mixed_precision=mixed_precision,
        whole_params=whole_params,
        timeout=timeout,
        stage3=stage3,
        offload=offload,
    )
    sets = build_sets(module, plan)
    return attach(module, plan, sets)


def build_sets(module: nn.Module, plan: WrapPlan) -> dict[str, BufferSet]:
    """The ranks agree on ``plan`` (each part over its worlds); then each part's flat buffers,
    bound to its params, hold rank 0's values where ``sync_module_states`` asks."""
    for part in plan.parts:
        lines = agreement_lines(plan, part)
        for w in (part.world, part.replicate):
            check_ranks_agree(w, lines, f"the {part.key} params")
        if part.key == "expert":  # (each expert param's norm is summed over ep, or the main world)
            over = plan.expert_parallel or plan.world
            check_ranks_agree(
                over, lines, "the expert params (each rank's share of the same stacked experts)"
            )
    sync, sharded = plan.sync_module_states, plan.policy.shards_params
    if sync and sharded and not plan.meta:  # rank 0's full values, then each rank keeps its shards
        broadcast_before_binding(module, plan.parts, plan.originals, plan.worlds)
    sets = {part.key: _build_set(part, plan) for part in plan.parts}
    if sync and not sharded:
        for w in plan.worlds:  # shard rows first, then across them: all from rank 0
            broadcast_states(module, w, list(sets.values()), buffers_over_world=w is plan.replicate)
        broadcast_originals(plan.originals, list(sets.values()))
    return sets


def attach(module: nn.Module, plan: WrapPlan, sets: Mapping[str, BufferSet]) -> ShardedModule:
    """The reductions, the grad-sync state machine, and the param gathers (stages 1-2) or
    the unsharder (stage 3, over the frozen params' set too); the ``ShardState`` and the
    class swap; a meta model initialized unit by unit; the root's hooks."""
    policy, trained = plan.policy, {k: s for k, s in sets.items() if k != FROZEN}
    frozen = sets.get(FROZEN)
    stats = CommStats()
    reduce_dtype = plan.mixed_precision.reduce_dtype
    reductions = build_reductions(list(trained.values()), plan.buckets.per_launch, stats, reduce_dtype)
    gather = unsharder = None
    if policy.gathers_buckets_after_step:
        scales = [fp8_scales(bset.buffers, plan.fp8, bset.world) for bset in trained.values()]
        gather = ParamGather(module, list(trained.values()), stats, outer_blocks(module), scales)
    if policy.gathers_units:
        unsharder = _unsharder(plan, [*trained.values(), *([frozen] if frozen is not None else [])], stats)
    sync = GradSync(
        list(trained.values()),
        reductions,
        policy=policy,
        find_unused_parameters=plan.find_unused_parameters,
        stats=stats,
        gathers=unsharder,
        tensor_parallel=plan.tensor_parallel,
        experts=_expert_spread(plan, trained),
    )
    originals = plan.originals or None
    state = ShardState(
        policy,
        trained,
        sync,
        stats,
        gather,
        originals=originals,
        unsharder=unsharder,
        frozen=frozen,
        offload=plan.offload,
        unit_modules=tuple(u.names for u in plan.units),
    )
    if plan.offload is not None and plan.offload.device_budget is not None:
        state.budget_specs = _budget_specs(module, plan)  # (its units' frozen shards: when decided)
    else:  # ([Note: unit homes])
        named = plan.offload.units if plan.offload is not None else None
        state.home_frozen_shards(plan.offload, None if named is None else unit_ids(named, state.unit_modules))
    sharded = make_sharded(module, state)
    sharded.register_forward_hook(eager(_backward_start_hook(sync)))
    if plan.meta:
        assert unsharder is not None and plan.device is not None  # (a meta model: stage 3, a device)
        worlds = [w for w in plan.worlds if w.size > 1] if plan.sync_module_states else None
        init_fn = policy.stage3.param_init_fn or default_init(
            module
        )  # ([Note: default init] in wrap/init.py)
        initialize_units(module, unsharder, init_fn, plan.device, worlds)
    _add_forward_pre_hooks(sharded, plan.mixed_precision, plan.worlds if plan.broadcast_buffers else None)
    return sharded


def _expert_spread(plan: WrapPlan, sets: Mapping[str, BufferSet]) -> ExpertSpread | None:
    """Where the expert params' grads lie beyond their world ([Note: expert parallelism])."""
    if "expert" not in sets:
        return None
    world = sets["expert"].world
    if plan.expert_parallel is not None:
        return ExpertSpread(world, plan.expert_parallel, in_main=False)
    return ExpertSpread(world, sets["main"].world if "main" in sets else world, in_main=True)


def _unsharder(plan: WrapPlan, sets: list[BufferSet], stats: CommStats) -> Unsharder:
    unsharder = build_unsharder(list(plan.units), plan.unit_of, sets, stats, plan.policy.stage3, plan.fp8)
    if any(b.world.size > 1 and b.params and b.params[0].device.type == "cpu" for b in sets):
        warn_once_without_tunables()  # gathers and frees fragment glibc's heap otherwise
    return unsharder


def _build_set(part: ParamPart, plan: WrapPlan) -> BufferSet:
    """The part's layout, its flat buffers (each bound to its params) and their set."""
    world, named, policy = part.world, part.named, plan.policy
    layout = plan_layout(
        list(part.specs),
        world_size=world.size,
        bucket_size=plan.buckets.size,
        shard=policy.pads_for_shards,
        pad_for_high_busbw=plan.buckets.pad_for_high_busbw,
        align=plan.buckets.align,
        buffer_per_unit=plan.buffer_per_unit,
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


def _add_forward_pre_hooks(sharded: ShardedModule, mp: MixedPrecision, buffer_worlds) -> None:
    """The root's own: the checks that grads were cleared whole and that nothing was replaced
    since wrapping (first), rank 0's buffers (``broadcast_buffers``: ``buffer_worlds``), the
    mixed-precision input cast."""
    state = sharded.flatshard_state
    offloaded = state.offload is not None and state.offload.fraction == 1.0
    rebound = None if state.policy.shards_params else state.take_values
    tree = WrappedTree(sharded, rebound, offloaded, frozenset(state.fp8_values()))
    state.tree = tree
    if not state.policy.shards_params:
        LoadHooks(tree, state.wait_for_params).register(sharded)
    sharded.register_forward_pre_hook(eager(tree.hook), prepend=True)
    sharded.register_forward_pre_hook(eager(state.take_dropped_grads), prepend=True)
    sharded.register_forward_pre_hook(eager(state.forward_began), prepend=True)
    sharded.register_forward_pre_hook(eager(state.check_resident_hook), prepend=True)  # (first)
    sharded.register_forward_hook(eager(state.forward_ended), always_call=True)
    if buffer_worlds and any(w.size > 1 for w in buffer_worlds) and any(True for _ in sharded.buffers()):
        before, after = buffer_broadcast_hooks(buffer_worlds)
        sharded.register_forward_pre_hook(eager(before))
        sharded.register_forward_hook(eager(after))
    if mp.param_dtype is not None:
        sharded.register_forward_pre_hook(
            eager(_mixed_precision_hook(sharded.flatshard_state, mp)), with_kwargs=True
        )


def _mixed_precision_hook(state: ShardState, mp: MixedPrecision):
    """Cast floating inputs; drop the fp32 originals once the model runs (an optimizer built
    later starts from the 16-bit values)."""
    cast = input_cast_hook(mp.param_dtype) if mp.cast_forward_inputs and mp.param_dtype else None

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        state.originals = None
        return cast(module, args, kwargs) if cast is not None else None

    return hook


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


def _budget_specs(module: nn.Module, plan: WrapPlan) -> BudgetSpecs:
    """What the optimizer's device-budget decision plans from ([Note: device budget] in
    ``planner/budget.py``): the trainable params' specs and the frozen ones' (sharded at
    stage 3, else replicated on every rank)."""
    parts = {part.key: part for part in plan.parts}
    if "expert" in parts:
        raise ValueError(
            "Offload(device_budget=...) with experts: the budget plans one set of buffers; give "
            "the share instead (Offload(optimizer=...)), e.g. from flatshard plan --device-budget"
        )
    main = parts["main"]
    if FROZEN in parts:
        frozen = parts[FROZEN].specs
    else:  # (the replicated ones: whole on each rank, in no unit)
        in_parts = {id(p) for part in plan.parts for _, p in part.named}
        frozen = tuple(
            ParamSpec(n, p.numel(), p.dtype, p.dtype)
            for n, p in module.named_parameters()
            if not p.requires_grad and p.numel() and p.is_floating_point() and id(p) not in in_parts
        )
    names = tuple(u.name for u in plan.units)
    return BudgetSpecs(main.specs, frozen, plan.buckets.size, main.world.size, names)
