"""A device budget: the least offload with which a rank's model state fits in the bytes its
device may hold, decided before anything runs ([Note: device budget])."""

# [Note: device budget]
#
# Given the bytes a rank's device may hold for the model state, ``fit_budget`` decides, for
# one stage, how much of the optimizer goes to the host. Offloading costs two copies a step
# and a host update, so the least that fits is the fastest; the candidates, in order:
#
# 1. nothing on the host;
# 2. a share of the optimizer (``Offload(optimizer=s)``): the state of the first runs of the
#    rank's shards, taken by the rule the ``HybridDeviceOptimizer`` inside takes them with
#    (``offloaded_items``), one candidate a run, each share ending on a run's last element,
#    so the plan's bytes are the run's; the host copies it keeps (main params, grads) count
#    on the host;
# 3. all of it (``Offload()``): the main params, grads' frame and state on the host, and at
#    stage 3 the param shards with them.
#
# At stage 3 the candidates are units instead of shares ([Note: unit homes] in
# ``planner/offload.py``): nothing, then the first k units of ``unit_order`` on the host
# (whole: shards, grad shards, main params, state, frozen shards), for the least k that fits
# (found by bisection: each unit sent frees device bytes), then all of them. The order puts
# first the units that cost the host link least for the bytes they free: a unit gathered
# once a step (the last ones of the forward, kept for backward; the root) before one
# gathered twice.
#
# What a device holds is ``memory_report``'s count (the plan's ``device`` bytes: params,
# grads, main params and state whose home is the device) plus, at stage 3, the units in full
# at the peak: two of the largest unit's params and grads (the one running, the one
# prefetched or reducing) and the root unit's params ([Note: stage-3 memory] in
# ``units/unshard.py``). A budget below those in-flight bytes alone is refused naming the
# largest unit and what it needs (no offload lowers them: a smaller unit does); a budget
# below what the stage needs with everything offloaded is refused naming that. Activations
# are not model state: the budget is what the model state may take.
#
# With ``Offload(step="device")`` ([Note: streamed step] in ``optim/streamed_step.py``) the
# step holds two chunks of the offloaded optimizer on the device: a candidate fits when its
# device bytes plus the larger of the units in full and the step's ``staging`` do, and below
# stage 3 the candidates are nothing and all of it (a streamed step takes all of it).
#
# ``shard(..., offload=Offload(device_budget=B))`` is decided when the ``DistributedOptimizer``
# is built (the optimizer's class sets the state's bytes): every rank plans every rank's
# shard from the same specs and takes the largest share any of them needs (``least_share``),
# so all ranks decide alike without a collective.

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flatshard.planner.layout import ParamSpec
from flatshard.planner.mixed_precision import HALF_DTYPES, OptimizerPrecision
from flatshard.planner.offload import STREAM_CHUNK, offloaded_items
from flatshard.planner.plan import OPTIMIZERS, StagePlan, layout_at, plan_from_specs
from flatshard.planner.shard_map import plan_runs
from flatshard.planner.stage import StagePolicy

__all__ = ["BudgetFit", "BudgetSpecs", "fit_budget", "in_flight_bytes", "least_offload", "unit_order"]


@dataclass(frozen=True)
class BudgetSpecs:
    """What a sharded model's budget is planned from: its trainable params' specs as laid
    out, its frozen ones', the bucket size and the shard world's size."""

    specs: tuple[ParamSpec, ...]
    frozen: tuple[ParamSpec, ...]
    bucket_size: int | None
    world_size: int
    unit_names: tuple[str, ...] = ()  # stage 3: each unit's name, by index


@dataclass(frozen=True)
class BudgetFit:
    """The decision for one stage: the share of the optimizer on the host (0, a share, or
    1 for all of it), the plan with it, and the stage-3 units in full at the peak."""

    stage: int
    share: float
    plan: StagePlan
    in_flight: int
    units: frozenset[str] | None = None  # stage 3: the ids of the units on the host (None: all or none)

    @property
    def device_peak(self) -> int:
        """The model state's bytes on the device at the peak: with the units in full (forward
        and backward) or with a streamed step's chunks (the step), whichever holds more."""
        return self.plan.device + max(self.in_flight, self.plan.staging)

    def describe(self, names: Sequence[str] = ()) -> str:
        """The decision in words; ``names``: stage 3's unit names by index."""
        if self.units is not None:
            shown = [names[int(u)] if names else u for u in sorted(self.units, key=int)]
            return f"Offload(units={shown}): {len(shown)} unit(s) on the host, the others on the device"
        what = {0.0: "nothing offloaded", 1.0: "Offload(): all of the optimizer on the host"}
        return what.get(self.share, f"Offload(optimizer={self.share:.4g})")


def in_flight_bytes(
    specs: Sequence[ParamSpec], frozen: Sequence[ParamSpec] = ()
) -> tuple[int, str | None, int]:
    """Stage 3's units in full at the peak (two of the largest unit's params and grads, and
    the root unit's params; ``frozen`` params count without grads), the largest unit's name
    and its bytes in full."""
    units: dict[str, int] = {}
    for spec, grads in [*((s, True) for s in specs), *((s, False) for s in frozen)]:
        if spec.unit is not None:
            full = spec.numel * (spec.dtype.itemsize + (spec.grad_dtype.itemsize if grads else 0))
            units[spec.unit] = units.get(spec.unit, 0) + full
    root = sum(s.numel * s.dtype.itemsize for s in [*specs, *frozen] if s.unit == "0")
    others = {u: n for u, n in units.items() if u != "0"}
    if not others:
        return root, None, 0
    largest = max(others, key=lambda u: others[u])
    return 2 * others[largest] + root, largest, others[largest]


def fit_budget(
    budget: int,
    specs: Sequence[ParamSpec],
    *,
    stage: int,
    world_size: int,
    bucket_size: int | None,
    optimizer: str = "adamw",
    rank: int = 0,
    stage3_specs: Sequence[ParamSpec] | None = None,
    frozen_specs: Sequence[ParamSpec] = (),
    stage3_frozen_specs: Sequence[ParamSpec] | None = None,
    precision: OptimizerPrecision | None = None,
    unit_names: Sequence[str] = (),
    streamed: bool = False,
    stream_chunk: int = STREAM_CHUNK,
) -> BudgetFit:
    """The least offload with which ``rank``'s model state at ``stage`` fits in ``budget``
    bytes of its device (arguments as ``plan_from_specs``; ``unit_names``: stage 3's units'
    names by index, for the errors); a ``ValueError`` naming what does not fit when nothing
    does ([Note: device budget]). ``streamed``: the offloaded optimizer steps on the device,
    whose chunks count at the step's peak; below stage 3 it takes all of the optimizer or none."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"the device budget must be a positive number of bytes, got {budget!r}")
    common: dict[str, Any] = {
        "world_size": world_size,
        "bucket_size": bucket_size,
        "optimizer": optimizer,
        "rank": rank,
        "stage3_specs": stage3_specs,
        "frozen_specs": frozen_specs,
        "stage3_frozen_specs": stage3_frozen_specs,
        "precision": precision,
        "streamed": streamed,
        "stream_chunk": stream_chunk,
    }
    policy = StagePolicy(stage)
    staged = stage3_specs if policy.gathers_units and stage3_specs is not None else specs
    in_flight, unit, unit_bytes = (0, None, 0)
    if policy.gathers_units:
        in_flight, unit, unit_bytes = in_flight_bytes(staged, stage3_frozen_specs or frozen_specs)
    if unit is not None and in_flight > budget:
        raise ValueError(
            f"device budget {budget} bytes: stage 3's unit {_named(unit, unit_names)} needs {unit_bytes} "
            "bytes in full "
            f"(params and grads), twice at the peak with the root unit's params: {in_flight} bytes "
            "before any model state; no offload lowers that. Give more bytes, or split the unit "
            "(Stage3(units=...), a smaller Stage3(unit_bytes=...))"
        )
    if policy.gathers_units:
        fit = _fit_units(budget, in_flight, specs, stage, common)
        full = fit.plan if fit.share == 1.0 else None
    else:
        base = plan_from_specs(specs, **common)[stage]
        shares = _shares(base, staged, policy, rank, world_size, bucket_size, optimizer, precision)
        candidates = [(0.0, base)] if streamed else shares  # (streamed: all of it or none)
        fits = (BudgetFit(stage, s, plan, 0) for s, plan in candidates if plan.device <= budget)
        full = plan_from_specs(specs, offload=True, **common)[stage]
        fit = next(fits, BudgetFit(stage, 1.0, full, 0))
    if fit.plan.device + max(in_flight, fit.plan.staging) <= budget:
        return replace(fit, in_flight=in_flight)
    assert full is not None  # (what does not fit is all of it offloaded)
    peak = max(in_flight, full.staging)
    raise ValueError(
        f"device budget {budget} bytes: stage {stage} needs {full.device + peak} bytes on "
        f"rank {rank}'s device with all of the optimizer on the host ({full.params} of params, "
        f"{full.device - full.params} of grads"
        + (f", {in_flight} of units in full" if in_flight >= full.staging and in_flight else "")
        + (f", {full.staging} of a streamed step's chunks" if full.staging > in_flight else "")
        + "). Give more bytes, or a stage that shards more"
        + (", or a smaller Offload(stream_chunk=...)" if full.staging > in_flight else "")
    )


def _fit_units(
    budget: int, in_flight: int, specs: Sequence[ParamSpec], stage: int, common: dict[str, Any]
) -> BudgetFit:
    """Stage 3: the fewest units on the host with which the rank's model state fits
    ``budget`` bytes at its peak (``in_flight``: the units in full), the units taken in
    ``unit_order``; all of them (share 1) if none fits."""
    order = unit_order(specs, stage, common)

    def plan(k: int) -> StagePlan:
        return plan_from_specs(specs, offload=frozenset(order[:k]), **common)[stage]

    def fits(p: StagePlan) -> bool:
        return p.device + max(in_flight, p.staging) <= budget

    lo, hi = 0, len(order)  # (device bytes fall as units leave: search the least k that fits)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(plan(mid)) else (mid + 1, hi)
    units = None if lo == len(order) else frozenset(order[:lo])
    return BudgetFit(stage, 0.0 if lo == 0 else 1.0, plan(lo), 0, units if lo else None)


def unit_order(specs: Sequence[ParamSpec], stage: int, common: dict[str, Any]) -> list[str]:
    """Stage 3's units (their ids) in the order a budget sends them to the host: least host
    link traffic a step for the device bytes each frees first (a unit gathered once a step
    before one regathered for backward), then the larger, then the earlier; planned on rank 0,
    so that every rank orders them alike."""
    staged = common.get("stage3_specs") or specs
    ids = sorted({s.unit for s in staged if s.unit is not None}, key=int)
    at0 = {**common, "rank": 0}
    base = plan_from_specs(specs, offload=frozenset(), **at0)[stage].device

    def cost(unit: str) -> tuple[float, int, int]:
        alone = plan_from_specs(specs, offload=frozenset({unit}), **at0)[stage]
        freed = base - alone.device
        return (alone.link_bytes_per_step / freed if freed > 0 else float("inf"), -freed, int(unit))

    return sorted(ids, key=cost)


def _shares(
    base: StagePlan,
    specs: Sequence[ParamSpec],
    policy: StagePolicy,
    rank: int,
    world_size: int,
    bucket_size: int | None,
    optimizer: str,
    precision: OptimizerPrecision | None,
) -> Iterator[tuple[float, StagePlan]]:
    """(share, plan) for nothing offloaded, then each share ending on a run, ascending."""
    yield 0.0, base
    state_bytes, scalar_bytes = OPTIMIZERS[optimizer]
    precision = precision or OptimizerPrecision()
    state_bytes = state_bytes * precision.state_dtype.itemsize // 4
    fp32_main = precision.main_dtype.itemsize == 4
    runs = []  # (elements, state bytes, host grads' bytes, host main params' bytes, width)
    for buffer in layout_at(policy, specs, world_size, bucket_size).buffers:
        half = buffer.dtype in HALF_DTYPES
        width = 4 if half and fp32_main else buffer.dtype.itemsize  # (the run's dtype)
        wide = width == 4 or not half
        for r in plan_runs(buffer, rank, {spec.name: 0 for spec in specs}):
            n = r.in_shard.size
            grads = n * width + (0 if wide else 4 * n)  # (a 16-bit run: an fp32 grad beside)
            mains = n * width if wide else 4 * n + n * width  # (a 16-bit run: fp32 master, upload)
            runs.append((n, state_bytes * n + scalar_bytes, grads, mains, width))
    numels = [r[0] for r in runs]
    total = sum(numels)
    end = 0
    for j in range(len(runs) - 1):
        end += numels[j]
        share = end / total
        chosen = [r for r, off in zip(runs, offloaded_items(numels, share), strict=True) if off]
        state = sum(r[1] for r in chosen)
        grads, mains = sum(r[2] for r in chosen), sum(r[3] for r in chosen)
        yield (
            share,
            replace(
                base,
                grads=base.grads + grads,
                main_params=base.main_params + mains,
                host=state + grads + mains,
                link_bytes_per_step=sum(2 * r[0] * r[4] for r in chosen),  # (grads down, values up)
            ),
        )


def least_offload(
    budget: int,
    planned: BudgetSpecs,
    *,
    stage: int,
    optimizer: str,
    precision: OptimizerPrecision | None,
    streamed: bool = False,
    stream_chunk: int = STREAM_CHUNK,
) -> tuple[float, frozenset[str] | None]:
    """The share of the optimizer to offload, and at stage 3 the units, so that every rank
    fits ``budget``: the most any rank needs (ranks' shards differ by padding; units are
    taken in one order, so the most is the longest list), the same on every rank without a
    word between them; a ``ValueError`` naming the first rank that cannot fit. ``streamed``
    and ``stream_chunk``: as ``fit_budget``'s."""
    stage3 = StagePolicy(stage).gathers_units
    fits = [
        fit_budget(
            budget,
            planned.specs,
            stage=stage,
            world_size=planned.world_size,
            bucket_size=planned.bucket_size,
            optimizer=optimizer,
            rank=rank,
            frozen_specs=() if stage3 else planned.frozen,
            stage3_frozen_specs=planned.frozen if stage3 else None,
            precision=precision,
            unit_names=planned.unit_names,
            streamed=streamed,
            stream_chunk=stream_chunk,
        )
        for rank in range(planned.world_size)
    ]
    most = max(fits, key=_extent)
    return most.share, most.units


def _named(unit: str, names: Sequence[str]) -> str:
    """A unit's name where its names are known ("(the root)" for the root's), else its index."""
    if not names:
        return unit
    name = names[int(unit)]
    return "(the root)" if name == "" else repr(name)


def _extent(fit: BudgetFit) -> tuple[float, float]:
    """How much a decision offloads, to compare two ranks' (all units beyond any list)."""
    if fit.share == 1.0 and fit.units is None:
        return 1.0, float("inf")
    return fit.share, len(fit.units or ())
