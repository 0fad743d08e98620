"""What ``shard()`` decides before it builds anything: the ``WrapPlan``.

Planning checks the arguments, resolves the worlds, casts the params to the mixed-precision
dtype (a meta model gets placeholders on its device), finds the stage-3 units and splits
the params into the parts that become buffer sets, each with what the layout planner is
told of its params. It runs no collective: the ranks check that their plans agree as the
first step of building (``wrap/shard.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm.deadline import HERE, Phase, as_timeout, publish_positions
from flatshard.comm.world import ONE, World, resolve_world, resolve_worlds
from flatshard.engine.fp8_gathers import Fp8Cast
from flatshard.engine.tensor_parallel import TensorParallel, describe, is_distributed, mesh_of, refuse
from flatshard.planner.layout import ParamSpec
from flatshard.planner.mixed_precision import HALF_DTYPES, MixedPrecision, cast_params
from flatshard.planner.offload import Offload, unit_ids
from flatshard.planner.stage import SCHEDULE, Buckets, Stage3, StagePolicy
from flatshard.units.build import is_meta_model, replace_meta_params
from flatshard.units.unit_tree import Unit
from flatshard.wrap.arguments import (
    bucket_options,
    check_arguments,
    check_current_device,
    check_devices,
    check_flags,
    check_grad_scale,
)
from flatshard.wrap.specs import WholeParams, param_specs, stage3_units, tied_params, whole_param_names
from flatshard.wrap.subclass_params import frozen_wrappers, make_plain

FROZEN = "frozen"
"""The key of stage 3's frozen params' ``ParamPart`` (a buffer set without grads)."""

# [Note: expert parallelism]
#
# A mixture-of-experts model under expert parallelism holds each expert on some ranks only:
# the expert-parallel group ``ep`` holds one copy of every expert between its ranks and
# dispatches tokens among them (the model's all-to-all, not flatshard's); the
# expert-data-parallel group ``edp`` holds copies of the same experts. The dense params are
# data-parallel over the main group ``dp`` as ever. flatshard is told both groups
# (``Experts(group=edp, match, ep=ep)``) and keeps, as Megatron-Core's buffers do:
#
# * **The experts' own buffers over edp.** They are reduced, sharded (stages 1-2) and gathered
#   (stage 3) over edp only, never over dp: the ranks of a dp group hold different experts.
#   Names alike on every ep rank (``layers.0.moe.w1`` of this rank's experts) are no clash.
# * **The main params' scale, 1 / dp.** An expert's grad on a rank already sums what every
#   dispatched token contributed to the loss of the dp rank it came from, each loss a mean
#   over that rank's batch; the mean over dp of those losses -- what DDP trains on the whole
#   model -- has the sum over edp times 1 / dp as its grad. (Megatron-Core's factor is
#   edp / dp after an average over edp: the same number.) ``1 / edp``, the default before,
#   was dp / edp = ep times too large.
# * **Each expert counted once in the norm.** The experts' squares are summed over edp (each
#   shard once; a stage-0 copy divided by edp) and then over ep, apart from the dense params'
#   sum over dp. Without ``ep`` they are summed over dp with the rest, which is right when
#   dp holds every expert once over edp x ep (no tensor parallelism).
# * **In a tensor-parallel model**, sequence parallelism gives each tp rank its own tokens,
#   so ep or edp may lie along tp (Megatron-Core's "MoE parallel folding"): the experts are
#   plain params there, not DTensors, and only the parts holding DTensors are checked
#   against the tp mesh (``mesh_of``). Their squares, and any param's that is replicated over
#   tp, must come out alike on every tp rank; the sum over tp that the norm runs anyway
#   carries them with their squares, and a spread above 1e-4 of the value (rounding is 1e-7)
#   is a ``ValueError`` naming tp and ``Experts(ep=...)`` on every rank alike: experts that
#   differ over tp without ``ep`` would otherwise clip each tp rank by its own norm and
#   split the replicated params apart.
# * **Checkpoints keep each expert param whole**: the shares of the ep ranks stacked along
#   dim 0 in rank order (``expert_shares`` in ``checkpoint/state.py``), the layout of
#   torchtitan's stacked experts, so a checkpoint moves between ep sizes and one process as a
#   tp one does. Names alike on every ep rank with shapes that do not stack (a rank's own
#   experts as modules numbered from 0) load back at the same ep size; at another the
#   stacked shape is refused by name.
# * **Refused:** ``ep`` sharing a rank other than this one with ``group`` (one would count
#   twice); a checkpoint without ``ep`` (nothing says how the shares stack);
#   ``full_state_dict()`` of a model with experts (rank 0 holds only its own: the
#   checkpoint and ``export_checkpoint`` give them all).


@dataclass(frozen=True)
class Experts:
    """Params that are data-parallel over another group: mixture-of-experts experts under
    expert parallelism ([Note: expert parallelism]).

    ``match(name, param)`` selects them; they get their own buffers and reduce over ``group``,
    the expert-data-parallel group (the ranks holding the same experts). ``ep``, the
    expert-parallel group (the ranks holding the *other* experts, over which tokens are
    dispatched), is where the grad norm sums the experts' squares; None sums them over the
    main data-parallel group. ``grad_scale`` multiplies their summed grads; None: the main
    params' scale (``1 / data-parallel size``, or ``shard``'s ``grad_scale``), which is
    Megatron-Core's expert-dp size / dp size applied after an average over ``group``.
    """

    group: object
    match: Callable[[str, nn.Parameter], bool]
    grad_scale: float | None = None
    ep: object = None

    def __post_init__(self) -> None:
        if not callable(self.match):
            raise TypeError(f"Experts.match must be a predicate (name, param) -> bool, got {self.match!r}")


@dataclass(frozen=True)
class ParamPart:
    """Params that share a world and a role: they become one ``BufferSet``."""

    key: str  # "main", "expert" or FROZEN (stage 3's frozen params: no grads)
    world: World  # the shard world
    replicate: World  # replicated sharding's replicate world (ONE otherwise)
    named: list[tuple[str, nn.Parameter]]
    grad_scale: float | None  # None: 1 / (world size x replicate size)
    specs: tuple[ParamSpec, ...] = ()  # what the layout planner is told of ``named``, in order


@dataclass(frozen=True)
class WrapPlan:
    """Everything ``shard()`` builds from, decided on this rank."""

    policy: StagePolicy  # the stage, with its Stage3 options
    buckets: Buckets
    mixed_precision: MixedPrecision
    world: World  # the shard world
    replicate: World  # replicated sharding's replicate world (ONE otherwise)
    parts: tuple[ParamPart, ...]  # the trainable parts ("main", "expert"), then stage 3's FROZEN
    units: tuple[Unit, ...]  # stage 3's units in pre-order (none below stage 3)
    unit_of: dict[int, int]  # stage 3: id(param) -> its unit's index
    meta: bool  # the model was on the meta device: initialized unit by unit after building
    device: torch.device | None  # where a meta model is materialized
    originals: dict[str, torch.Tensor]  # fp32 values before a MixedPrecision cast (by name)
    agreement: tuple[str, ...]  # what every rank must agree on, one line per option
    find_unused_parameters: bool
    sync_module_states: bool
    broadcast_buffers: bool
    tensor_parallel: TensorParallel | None = None  # DTensor params' tp dimension
    expert_parallel: World | None = None  # Experts.ep ([Note: expert parallelism])
    offload: Offload | None = None  # host homes ([Note: memory tiers] in planner/offload.py)
    fp8: Mapping[str, Fp8Cast] = field(default_factory=dict)  # weights gathered in fp8, by name

    @property
    def buffer_per_unit(self) -> bool:
        """Each stage-3 unit gets buffers of its own, so each can have its home ([Note: unit
        homes] in ``planner/offload.py``): where units are named or a budget will name them."""
        offload = self.offload
        per_unit = offload is not None and (offload.units is not None or offload.device_budget is not None)
        return per_unit and self.policy.gathers_units

    @property
    def worlds(self) -> tuple[World, World]:
        return self.world, self.replicate


def plan_wrap(
    module: nn.Module,
    *,
    stage: int,
    group: object,
    buckets: Buckets | None,
    grad_scale: float | None,
    expert: Experts | None,
    find_unused_parameters: bool,
    sync_module_states: bool,
    broadcast_buffers: bool,
    mixed_precision: MixedPrecision | None,
    whole_params: WholeParams,
    timeout: float | timedelta | None,
    stage3: Stage3 | None,
    offload: Offload | None = None,
) -> WrapPlan:
    """``shard()``'s arguments checked and its decisions made (see ``shard`` for each)."""
    buckets = bucket_options(buckets)
    policy = StagePolicy.build(stage, stage3)
    if offload is not None and not isinstance(offload, Offload):
        raise TypeError(f"offload must be a flatshard.Offload or None, got {offload!r}")
    check_arguments(module, grad_scale)
    if expert is not None:
        check_grad_scale(expert.grad_scale, "Experts.grad_scale")
    check_flags(
        find_unused_parameters=find_unused_parameters,
        sync_module_states=sync_module_states,
        broadcast_buffers=broadcast_buffers,
    )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a flatshard.MixedPrecision or None, got {mixed_precision!r}"
        )
    mp = mixed_precision or MixedPrecision()
    marked = make_plain(module)  # ([Note: tensor-subclass params])
    world, replicate = _worlds(group, policy, timeout)
    s3 = policy.stage3
    replicated = _frozen_replicated(module, policy, expert, s3.ignored_modules)
    kept_whole = whole_param_names(module, whole_params)  # (names: a meta model's params are replaced)
    _check_tensor_parallel(module, policy, kept_whole)
    named, meta, device, originals = _prepare_params(module, policy, mp, s3.device, replicated)
    if named:
        check_current_device(named[0][1].device, world.backend_for(named[0][1].device))
    units, unit_of = (
        stage3_units(module, named, s3.units, s3.unit_bytes) if policy.gathers_units else ([], {})
    )
    _check_offload_units(offload, policy, units)
    fp8 = _fp8_gathered(module, marked, policy, mp.fp8_gathers)
    specs_of = partial(
        param_specs, tied=tied_params(module), unit_of=unit_of, whole=kept_whole, mixed_precision=mp, fp8=fp8
    )
    parts = _split_worlds(named, world, replicate, grad_scale, expert)
    parts += _frozen_part(module, replicated, unit_of, world, replicate) if policy.shards_params else []
    parts = [replace(part, specs=tuple(specs_of(part.named))) for part in parts]
    tp = mesh_of(named, [w for part in parts if _holds_dtensors(part) for w in (part.world, part.replicate)])
    options = {
        "bucket_size": buckets.size,
        "buckets_per_launch": buckets.per_launch,
        "grad_scale": grad_scale,
        "find_unused_parameters": find_unused_parameters,
        "sync_module_states": sync_module_states,
        "broadcast_buffers": broadcast_buffers,
        "pad_for_high_busbw": buckets.pad_for_high_busbw,
        "align": buckets.align,
        "offload": offload,
    }
    agreement = _agreement_lines(
        module, policy, mp, [u.name for u in units], replicated, meta=meta, **options
    )
    return WrapPlan(
        policy,
        buckets,
        mp,
        world,
        replicate,
        tuple(parts),
        tuple(units),
        unit_of,
        meta,
        device,
        originals,
        tuple(agreement),
        find_unused_parameters,
        sync_module_states,
        broadcast_buffers,
        tp,
        expert_parallel_world(expert, world.timeout),
        offload,
        fp8,
    )


def _check_offload_units(offload: Offload | None, policy: StagePolicy, units: list[Unit]) -> None:
    """``Offload(units=...)`` names units of this model, at stage 3."""
    if offload is None or offload.units is None:
        return
    if not policy.gathers_units:
        raise ValueError(
            f"Offload(units=...) names stage 3's units; at stage {policy.stage} there are none: offload "
            "a share of the optimizer instead (Offload(optimizer=0.5)), or all of it (Offload())"
        )
    unit_ids(offload.units, [u.names for u in units])


def _fp8_gathered(
    module: nn.Module,
    marked: Mapping[str, Fp8Cast],
    policy: StagePolicy,
    asked: bool | None,
) -> dict[str, Fp8Cast]:
    """The weights gathered in fp8 ([Note: fp8 gathers]): those torchao marked for it, but
    tensor-parallel ones, at stage 3 unless ``asked`` is False, and after the step at
    stages 1-2 where ``asked`` ([Note: fp8 gathers after the step])."""
    if asked is True and not marked:
        raise ValueError(
            "MixedPrecision(fp8_gathers=True), but no weight is marked for fp8 gathers: convert the "
            "model with torchao.float8.convert_to_float8_training(..., config=Float8LinearConfig("
            "enable_fsdp_float8_all_gather=True)) first"
        )
    if asked is True and not policy.gathers_params:
        raise ValueError(
            f"MixedPrecision(fp8_gathers=True) at stage {policy.stage}, which gathers no params: "
            "use stages 1-3"
        )
    wide = next((n for n in marked if module.get_parameter(n).dtype not in HALF_DTYPES), None)
    if asked is True and not policy.gathers_units and wide is not None:  # (dtypes after the cast)
        dtype = module.get_parameter(wide).dtype
        raise ValueError(
            f"MixedPrecision(fp8_gathers=True) at stage {policy.stage} with {dtype} params ({wide!r} "
            "among them): between "
            "steps the params then hold their fp8 values, and only fp32 main params of 16-bit params "
            "keep the exact ones; pass mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), "
            "or use stage 3, whose fp8 gathers leave the shards exact"
        )
    if asked is False or (asked is None and not policy.gathers_units):
        return {}
    return {n: cast for n, cast in marked.items() if not is_distributed(module.get_parameter(n))}


def _holds_dtensors(part: ParamPart) -> bool:
    return any(is_distributed(p) for _, p in part.named)


def agreement_lines(plan: WrapPlan, part: ParamPart) -> list[str]:
    """What every rank of ``part``'s worlds must have planned alike: the options and each
    param of the part with its spec."""
    described = (_describe(part.key, p, s) for (_, p), s in zip(part.named, part.specs, strict=True))
    return [*plan.agreement, *described]


def _check_tensor_parallel(module: nn.Module, policy: StagePolicy, kept_whole: frozenset[str]) -> None:
    """What does not yet compose with a DTensor param, refused naming it
    ([Note: tensor-parallel params])."""
    name = next((n for n, p in module.named_parameters() if is_distributed(p)), None)
    if name is None:
        return
    meta = next((n for n, p in module.named_parameters() if is_distributed(p) and p.is_meta), None)
    if meta is not None:
        raise refuse("a meta-device model", meta, "build the model on a device before parallelize_module")
    whole = [n for n, p in module.named_parameters() if n in kept_whole and is_distributed(p)]
    if whole:
        raise refuse("whole_params", whole[0], "leave tensor-parallel params out of whole_params")


def _worlds(group: object, policy: StagePolicy, timeout: float | timedelta | None) -> tuple[World, World]:
    """(shard world, replicate world) of ``group`` with the collectives' deadline; this rank
    starts publishing its position ([Note: deadlines])."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if group is None and launched > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"group=None with WORLD_SIZE={launched} in the environment but no process group: each "
            "rank would train alone, as a world of one. Call torch.distributed.init_process_group() "
            "before shard (the HF Trainer, accelerate and Lightning make it before they shard)"
        )
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


def _frozen_replicated(module: nn.Module, policy: StagePolicy, expert, ignored_modules) -> set[int]:
    """Ids of the frozen params replicated on every rank (not sharded): all of them below stage 3;
    at stage 3 those of ``ignored_modules``, expert params, non-floating ones and those of a
    wrapper tensor class."""
    frozen = {id(p): (n, p) for n, p in module.named_parameters() if not p.requires_grad}
    if not policy.shards_params:
        return set(frozen)
    kept_whole = frozen_wrappers(module)  # ([Note: tensor-subclass params])
    ignored = {id(p) for m in (ignored_modules or ()) for p in _checked_ignored(module, m).parameters()}
    return {
        key
        for key, (n, p) in frozen.items()
        if key in ignored
        or key in kept_whole
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


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_worlds(
    named, world: World, replicate: World, grad_scale, expert: Experts | None
) -> list[ParamPart]:
    """The main params and the expert params, each with its worlds and grad scale (the
    experts' default is the main params' scale, [Note: expert parallelism])."""
    parts: list[ParamPart] = []
    if expert is not None:
        is_expert = [bool(expert.match(n, p)) for n, p in named]
        chosen = [np for np, e in zip(named, is_expert, strict=True) if e]
        named = [np for np, e in zip(named, is_expert, strict=True) if not e]
        if chosen:
            main_scale = 1.0 / (world.size * replicate.size) if grad_scale is None else grad_scale
            scale = main_scale if expert.grad_scale is None else expert.grad_scale
            parts.append(ParamPart("expert", resolve_world(expert.group, world.timeout), ONE, chosen, scale))
    if named:
        parts.insert(0, ParamPart("main", world, replicate, named, grad_scale))
    return parts


def expert_parallel_world(expert: Experts | None, timeout) -> World | None:
    """``expert.ep`` as a world (None when not given), checked to share no rank but this one
    with ``expert.group``: a rank holding the same experts is not one holding others."""
    if expert is None or expert.ep is None:
        return None
    ep = resolve_world(expert.ep, timeout)
    edp = resolve_world(expert.group, timeout)
    if ep.group is not None and edp.group is not None:
        shared = set(dist.get_process_group_ranks(ep.group)) & set(dist.get_process_group_ranks(edp.group))
        if shared - {dist.get_rank()}:
            raise ValueError(
                f"Experts: the expert-parallel group ep and the expert-data-parallel group share ranks "
                f"{sorted(shared)}: ep holds the other experts and group the same ones, two dimensions "
                "of the mesh (e.g. ep=mesh['ep'], group=mesh['edp'])"
            )
    return ep


def _frozen_part(
    module: nn.Module, replicated: set[int], unit_of, world: World, replicate: World
) -> list[ParamPart]:
    """Stage 3: the frozen params not ``replicated``, sorted by unit as the trainable ones."""
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and id(p) not in replicated]
    frozen.sort(key=lambda item: unit_of[id(item[1])])
    return [ParamPart(FROZEN, world, replicate, frozen, None)] if frozen else []


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


def _describe(key: str, param: nn.Parameter, spec) -> str:
    whole = " whole" if spec.whole else ""
    shape = f"{tuple(param.shape)}{describe(param)}"
    return f"{key} {spec.name} {shape} {param.dtype} unit={spec.unit}{whole}"
