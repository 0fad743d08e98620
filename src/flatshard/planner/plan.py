"""Model-state memory and communication per rank, before running anything.

``plan_from_count`` evaluates the DESIGN.md formulas for Ψ params (the ZeRO paper's
accounting: with fp16 params and grads and Adam, 7.5B params on 64 ranks need 120, 31.4,
16.6 and 1.88 GB per rank at stages 0-3; flatshard's stage 3 needs 1.64, keeping no 16-bit
param shard next to the fp32 main params). ``plan_from_specs`` evaluates them on the real
layout flatshard would build (alignment and padding included), for one rank, counting what
``memory_report`` counts: fp32 main params only for 16-bit params (none, and bf16 state,
as an ``OptimizerPrecision`` asks), and the inner optimizer's per-tensor scalars (one per
run, [Note: optimizer runs]). Communication is the wire bytes one rank sends per optimizer
step under the ring formulas ([Note: comm bytes]), leaving out the 8-byte grad-norm
all-reduce.

Stage 3 is planned from the same sharded layout (params sharded too, unit scratch not
counted) ahead of its implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from flatshard.planner.layout import BucketLayout, BufferLayout, Layout, ParamSpec, plan_layout
from flatshard.planner.mixed_precision import HALF_DTYPES, OptimizerPrecision
from flatshard.planner.offload import STREAM_CHUNK, staging_bytes, stream_chunks
from flatshard.planner.shard_map import plan_runs
from flatshard.planner.stage import STAGES, StagePolicy
from flatshard.planner.state_blocks import FORMATS, BlockFormat, run_state_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS: dict[str, tuple[int, int]] = {
    # name: (bytes of state per element, bytes of scalars per optimizer tensor: the step count)
    "adam": (8, 4),
    "adamw": (8, 4),
    "adagrad": (4, 4),
    "sgd-momentum": (4, 0),
    "sgd": (0, 0),
}


@dataclass(frozen=True)
class StagePlan:
    """Bytes one rank keeps (by role) and sends per optimizer step at one stage."""

    params: int
    grads: int
    main_params: int
    optimizer_state: int
    comm_bytes_per_step: int
    host: int = 0  # of bytes_per_rank, those whose home is the host (``Offload``)
    link_bytes_per_step: int = 0  # copied between host and device in a step, both ways
    staging: int = 0  # on the device during a streamed step, at most (not in ``device``)

    @property
    def bytes_per_rank(self) -> int:
        return self.params + self.grads + self.main_params + self.optimizer_state

    @property
    def device(self) -> int:
        return self.bytes_per_rank - self.host

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "bytes_per_rank": self.bytes_per_rank, "device": self.device}


def _check(world_size: int, optimizer: str, precision: OptimizerPrecision | None) -> tuple[float, int, bool]:
    """(state bytes an element, scalar bytes a run, whether 16-bit params get fp32 main
    params) of ``optimizer`` kept at ``precision``; a blockwise format's: two moments'
    codes and scales, every param taken as quantized."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if optimizer not in OPTIMIZERS and optimizer not in FORMATS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted([*OPTIMIZERS, *FORMATS])}")
    precision = precision or OptimizerPrecision()
    if optimizer in FORMATS and precision.lowered:
        raise ValueError(f"{optimizer} keeps its own low-bit state: it takes no OptimizerPrecision")
    fmt = FORMATS.get(optimizer)
    if fmt is not None:
        return 2 * (fmt.bits / 8 + 4 / fmt.block), 4, True
    state_bytes, scalar_bytes = OPTIMIZERS[optimizer]
    state_bytes = state_bytes * precision.state_dtype.itemsize // 4
    return state_bytes, scalar_bytes, precision.main_dtype == torch.float32


def _comm(
    policy: StagePolicy, numel: int, world: int, param_bytes: int, grad_bytes: int, gathers: int = 2
) -> int:
    """Ring wire bytes per step for ``numel`` elements (one bucket, or all of them); at
    stage 3 a bucket is gathered ``gathers`` times (once for the units that stay full from
    forward into backward)."""
    ring = (world - 1) / world
    return int(ring * numel * policy.wire_bytes_per_element(param_bytes, grad_bytes, gathers))


def _gathers_per_bucket(specs: Sequence[ParamSpec]) -> Callable[[BucketLayout], int]:
    """Stage-3 gathers per step of a bucket with the default options: once for the root unit
    ("0") and the last two units (they stay full into backward, [Note: unsharding]), twice
    for the others (and without units)."""
    unit_of = {spec.name: spec.unit for spec in specs}
    units = sorted({int(u) for u in unit_of.values() if u is not None})
    kept = {"0", *map(str, units[-2:])} if units else set()
    return lambda bucket: 1 if unit_of[bucket.params[0].name] in kept else 2


def plan_from_count(
    params: int,
    *,
    world_size: int,
    param_dtype: str = "bf16",
    grad_dtype: str = "fp32",
    optimizer: str = "adam",
    precision: OptimizerPrecision | None = None,
) -> dict[int, StagePlan]:
    """The formulas for ``params`` elements, no padding; main params are fp32 copies of
    16-bit params (4 bytes each, sharded from stage 1 on, like the optimizer state), none
    with ``precision.main_dtype`` bf16; state is ``precision.state_dtype``."""
    state_bytes, _, fp32_main = _check(world_size, optimizer, precision)
    pb, gb = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_dtype]
    mb = 4 if pb == 2 and fp32_main else 0
    n, shard = world_size, params / world_size
    plans = {}
    for stage in STAGES:
        policy = StagePolicy(stage)
        held = 0 if policy.shards_params and mb else pb  # stage 3, 16-bit: the main params hold the shard
        state = shard if policy.shards_optimizer else params
        plans[stage] = StagePlan(
            params=round(held * (shard if policy.shards_params else params)),
            grads=round(gb * (shard if policy.shards_grads else params)),
            main_params=round(mb * state),
            optimizer_state=round(state_bytes * state),
            comm_bytes_per_step=_comm(policy, params, n, pb, gb),
        )
    return plans


def layout_at(
    policy: StagePolicy,
    specs: Sequence[ParamSpec],
    world_size: int,
    bucket_size: int | None,
    align: int | None = None,
    buffer_per_unit: bool = False,
) -> Layout:
    """The layout ``shard`` builds for ``specs`` at ``policy``'s stage (``buffer_per_unit``:
    at stage 3, buffers unit by unit, [Note: unit homes] in ``planner/offload.py``)."""
    return plan_layout(
        specs,
        world_size=world_size,
        bucket_size=bucket_size,
        shard=policy.pads_for_shards,
        align=align,
        buffer_per_unit=buffer_per_unit and policy.gathers_units,
    )


def plan_from_specs(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    bucket_size: int | None,
    optimizer: str = "adamw",
    rank: int = 0,
    stage3_specs: Sequence[ParamSpec] | None = None,
    frozen_specs: Sequence[ParamSpec] = (),
    stage3_frozen_specs: Sequence[ParamSpec] | None = None,
    precision: OptimizerPrecision | None = None,
    offload: bool | frozenset[str] = False,
    streamed: bool = False,
    stream_chunk: int = STREAM_CHUNK,
) -> dict[int, StagePlan]:
    """The plan of ``rank`` for params described by ``specs`` (their dtypes and grad dtypes
    as flatshard would use them), on the layout ``shard`` would build; stage 3 lays out
    ``stage3_specs`` (``model_specs(module, stage=3)``: grouped by unit) when given.
    ``frozen_specs`` (``model_specs(module, frozen=True)``) are frozen params: whole on every
    rank at stages 0-2, sharded and gathered with their unit at stage 3 (laid out from
    ``stage3_frozen_specs`` when given), never with grads or optimizer state. ``offload``:
    True as ``shard(..., offload=Offload())`` ([Note: memory tiers] in ``planner/offload.py``);
    a set of stage-3 unit ids (``ParamSpec.unit``) as ``Offload(units=...)``: those units on
    the host at stage 3 ([Note: unit homes]), nothing at stages 0-2, which have no units;
    ``streamed``: as ``Offload(step="device", stream_chunk=stream_chunk)`` ([Note: streamed
    step] in ``optim/streamed_step.py``)."""
    state_bytes, scalar_bytes, fp32_main = _check(world_size, optimizer, precision)
    fmt = FORMATS.get(optimizer)  # (a blockwise format: piece runs on a layout aligned to its blocks)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    plans = {}
    for stage in STAGES:
        policy = StagePolicy(stage)
        staged = stage3_specs if policy.gathers_units and stage3_specs is not None else specs
        if not policy.gathers_params:  # (stage 0 gathers nothing: no buffers of fp8 gathers)
            staged = [replace(spec, gather_dtype=None) for spec in staged]
        per_unit = not isinstance(offload, bool)  # (units named: buffers unit by unit)
        layout = layout_at(policy, staged, world_size, bucket_size, fmt.align if fmt else None, per_unit)
        gathers = _gathers_per_bucket(staged)
        totals = dict.fromkeys(
            ("params", "grads", "main_params", "optimizer_state", "comm_bytes_per_step", "host"), 0
        )
        totals["link_bytes_per_step"] = 0
        group_of = {spec.name: 0 for spec in specs}
        chunked: list[tuple[int, int]] = []  # streamed runs: (elements, bytes on the device)
        for buffer in layout.buffers:
            host = _on_host(offload, buffer, policy)
            pb, gb = buffer.dtype.itemsize, buffer.grad_dtype.itemsize
            sent = buffer.gather_dtype.itemsize if buffer.gather_dtype else pb  # (none at stage 0)
            full, shard = buffer.numel, buffer.shard_numel(rank)
            half = buffer.dtype in HALF_DTYPES and fp32_main  # (at stage 3 they hold the 16-bit shard)
            held_by_main = half or host  # (offloaded fp32 params get a host copy too)
            totals["params"] += (0 if held_by_main else pb * shard) if policy.shards_params else pb * full
            totals["grads"] += gb * (shard if policy.shards_grads else full)
            main = (4 if half else pb) * shard if held_by_main else 0
            ran = _run_states(buffer, rank, group_of, fmt, (state_bytes, scalar_bytes))
            state = sum(st for _, st in ran)
            totals["main_params"] += main
            totals["optimizer_state"] += state
            totals["comm_bytes_per_step"] += sum(
                _comm(policy, b.numel, world_size, sent, gb, gathers(b)) for b in buffer.buckets
            )
            if host:
                ups = [gathers(b) if policy.shards_params else 1 for b in buffer.buckets]
                sizes = [b.shard_range(rank).size for b in buffer.buckets]
                over = sent if policy.shards_params else pb  # (stages 1-2: the stepped shard goes up)
                up = sum(over * size * n for size, n in zip(sizes, ups, strict=True))
                width = (4 if half else pb, gb if policy.shards_grads else 0)  # (main, grads sent)
                moved = (sum(n * width[0] for n, _ in ran) + state, sum(n * width[1] for n, _ in ran))
                _add_host(totals, policy, gb * shard, main + state, up, moved if streamed else None)
                # (a streamed run's bytes on the device: its main params, grads sent, state)
                chunked += [(n, n * sum(width) + st) for n, st in ran] if streamed else []
        totals["comm_bytes_per_step"] += _fp8_scales_bytes(layout, policy)
        cut = stream_chunks([n for n, _ in chunked], stream_chunk)
        totals["staging"] = staging_bytes([sum(chunked[i][1] for i in c) for c in cut])
        frozen = stage3_frozen_specs if policy.gathers_units and stage3_frozen_specs else frozen_specs
        _add_frozen(totals, policy, frozen, staged, world_size, bucket_size, rank, offload)
        if world_size == 1:
            totals["comm_bytes_per_step"] = 0
        plans[stage] = StagePlan(**totals)
    return plans


def _add_host(
    totals: dict[str, int],
    policy: StagePolicy,
    grads: int,
    kept: int,
    up: int,
    streamed: tuple[int, int] | None,
) -> None:
    """A buffer whose optimizer lives on the host ([Note: memory tiers]): its main params and
    state there (``kept`` bytes), and its ``grads`` bytes: the grad shards themselves at stages
    2-3, sent down once a step; at stages 0-1 a host frame beside the device's grad buffer that
    they are copied into, unless the step is streamed (it reads the device's). Its params go
    up (``up``: once a step, at stage 3 once a gather of this rank's part). A streamed step
    ([Note: streamed step] in ``optim/streamed_step.py``) also sends its runs' main params
    and state up and back, and their grads up where they live on the host: ``streamed`` is
    (the runs' main-param and state bytes, their grads' bytes on the host)."""
    frame = 0 if policy.shards_grads or streamed else grads
    totals["grads"] += frame
    totals["host"] += kept + (grads if policy.shards_grads else frame)
    totals["link_bytes_per_step"] += up + (grads if policy.shards_grads or not streamed else 0)
    if streamed is not None:
        totals["link_bytes_per_step"] += 2 * streamed[0] + streamed[1]


def _run_states(
    buffer: BufferLayout,
    rank: int,
    group_of: dict[str, int],
    fmt: BlockFormat | None,
    rates: tuple[float, int],
) -> list[tuple[int, int]]:
    """(elements, state bytes) of each of ``rank``'s runs of ``buffer``: ``rates`` (bytes an
    element, bytes a run) for flat runs, a piece run per param part for a blockwise format."""
    if fmt is None:
        sizes = [r.in_shard.size for r in plan_runs(buffer, rank, group_of)]
        return [(n, int(rates[0] * n) + rates[1]) for n in sizes]
    out = []
    for bucket in buffer.buckets:
        numel = {slot.name: slot.numel for slot in bucket.params}
        for piece in bucket.local_ranges(rank):
            if piece.name in group_of:
                n = piece.in_shard.size
                out.append((n, run_state_bytes(fmt, n, numel[piece.name])))
    return out


def _on_host(offload: bool | frozenset[str], buffer: BufferLayout, policy: StagePolicy) -> bool:
    """Whether ``buffer`` lives on the host under ``offload`` as ``plan_from_specs`` takes it:
    all of it, or at stage 3 the buffers of the units named ([Note: unit homes])."""
    if isinstance(offload, bool):
        return offload
    return policy.gathers_units and buffer.unit in offload


def _add_frozen(
    totals: dict[str, int],
    policy: StagePolicy,
    specs: Sequence[ParamSpec],
    trainable: Sequence[ParamSpec],
    world_size: int,
    bucket_size: int | None,
    rank: int,
    offload: bool | frozenset[str] = False,
) -> None:
    """Frozen params ([Note: frozen params] in ``units/build.py``): their bytes, whole or
    (stage 3) this rank's shard, and at stage 3 their gathers; ``offload`` (as
    ``plan_from_specs``'): at stage 3 the shards of the units it homes on the host, sent up
    the host link at each gather."""
    if not specs:
        return
    if not policy.shards_params:
        totals["params"] += sum(s.numel * s.dtype.itemsize for s in specs)
        return
    per_unit = not isinstance(offload, bool)
    layout = plan_layout(
        specs, world_size=world_size, bucket_size=bucket_size, shard=True, buffer_per_unit=per_unit
    )
    gathers = _gathers_per_bucket([*trainable, *specs])  # (the kept units are the model's)
    for buffer in layout.buffers:
        pb = buffer.dtype.itemsize
        shard = pb * buffer.shard_numel(rank)
        totals["params"] += shard
        ring = (world_size - 1) / world_size
        sent = buffer.gather_dtype.itemsize if buffer.gather_dtype is not None else pb
        totals["comm_bytes_per_step"] += sum(int(ring * b.numel * sent * gathers(b)) for b in buffer.buckets)
        if _on_host(offload, buffer, policy):
            totals["host"] += shard
            up = (sent * b.shard_range(rank).size * gathers(b) for b in buffer.buckets)
            totals["link_bytes_per_step"] += sum(up)
    totals["comm_bytes_per_step"] += _fp8_scales_bytes(layout, policy)


def _fp8_scales_bytes(layout: Layout, policy: StagePolicy) -> int:
    """The wire bytes of the all-reduce of the fp8 weights' amaxes (fp32, one a weight), once a
    forward at stage 3 and once a step at stages 1-2 ([Note: fp8 gathers] and [Note: fp8
    gathers after the step] in ``engine/fp8_gathers.py``), as ``CommStats`` counts it."""
    count = sum(len(list(b.params)) for b in layout.buffers if b.gather_dtype is not None)
    n = layout.world_size
    return 2 * (n - 1) * 4 * count // n if policy.gathers_params and count and n > 1 else 0


def _size(nbytes: int) -> str:
    """Decimal units, as in the ZeRO paper."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def format_plan(plans: dict[int, StagePlan], title: str) -> str:
    """A table of the plans."""
    heads = ["params", "grads", "main params", "optimizer", "per rank", "comm/step"]
    offloaded = any(p.host for p in plans.values())
    streamed = any(p.staging for p in plans.values())
    heads += ["on the host", "on the device", "host link/step"] if offloaded else []
    heads += ["step staging"] if streamed else []
    lines = [title, f"{'stage':>5}" + "".join(f"{h:>15}" for h in heads)]
    for stage, p in plans.items():
        cells = [p.params, p.grads, p.main_params, p.optimizer_state, p.bytes_per_rank, p.comm_bytes_per_step]
        cells += [p.host, p.device, p.link_bytes_per_step] if offloaded else []
        cells += [p.staging] if streamed else []
        lines.append(f"{stage:>5}" + "".join(f"{_size(c):>15}" for c in cells))
    return "\n".join(lines)
