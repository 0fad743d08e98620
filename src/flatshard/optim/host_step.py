"""The optimizer's update on the host: which kernel steps it, and the grads it reads
([Note: memory tiers] in ``planner/offload.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from flatshard.comm.collectives import CommStats
from flatshard.optim.shards import BufferShards
from flatshard.planner.budget import least_offload
from flatshard.planner.offload import Offload

FUSED_ON_HOST = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""torch classes with a fused CPU kernel (``fused=True``): one pass over each tensor."""
FUSED_ON_DEVICE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""torch classes with a fused accelerator kernel (Adagrad's is CPU-only)."""


def host_defaults(
    optimizer_class: type,
    classes: Sequence[type],
    defaults: dict[str, Any],
    fused: Sequence[type] = FUSED_ON_HOST,
) -> dict[str, Any]:
    """``defaults`` with the fastest kernel asked for, where the user chose none: torch's
    fused one when every class is in ``fused`` (those with a fused kernel where the step runs:
    the host's by default), else ``foreach`` when every class takes it (torch's default on the
    CPU is a loop over tensors, op by op)."""
    from flatshard.optim.hybrid import HybridDeviceOptimizer

    if isinstance(optimizer_class, type) and issubclass(optimizer_class, HybridDeviceOptimizer):
        raise ValueError(
            "a HybridDeviceOptimizer inside a DistributedOptimizer of a model sharded with "
            "Offload(optimizer=True): the offload already steps every shard on the host; pass the "
            "host class itself (e.g. torch.optim.AdamW)"
        )
    if "fused" in defaults or "foreach" in defaults:
        return defaults
    if all(cls in fused for cls in classes):
        return {**defaults, "fused": True}
    if all("foreach" in inspect.signature(cls).parameters for cls in classes):
        return {**defaults, "foreach": True}
    return defaults


def budget_offload(
    offload: Offload | None,
    planned: Any,
    stage: int,
    optimizer_class: type,
    defaults: dict[str, Any],
    precision,
) -> Offload | None:
    """``offload`` with its device budget decided: the least share of the optimizer (at stage
    3: the fewest units) that fits on every rank ([Note: device budget] in
    ``planner/budget.py``); None for none."""
    if offload is None or offload.device_budget is None:
        return offload
    kinds = {torch.optim.Adam: "adamw", torch.optim.AdamW: "adamw", torch.optim.Adagrad: "adagrad"}
    if optimizer_class is torch.optim.SGD:
        kind = "sgd-momentum" if defaults.get("momentum", 0) else "sgd"
    elif optimizer_class in kinds:
        kind = kinds[optimizer_class]
    else:
        raise ValueError(
            f"Offload(device_budget=...) plans the state of torch's Adam, AdamW, SGD and Adagrad, not "
            f"{getattr(optimizer_class, '__name__', optimizer_class)}: give the share instead "
            "(Offload(optimizer=...))"
        )
    budget = offload.device_budget
    share, units = least_offload(
        budget,
        planned,
        stage=stage,
        optimizer=kind,
        precision=precision,
        streamed=offload.step == "device",
        stream_chunk=offload.stream_chunk,
    )
    if units is not None:  # (stage 3: these units on the host, [Note: unit homes])
        named = tuple(planned.unit_names[int(u)] for u in sorted(units, key=int))
        return replace(offload, device_budget=None, units=named)
    return replace(offload, device_budget=None, optimizer=share) if share else None


def resolve_offload(
    offload: Offload | None, optimizer_class: type, classes: Sequence[type], defaults: dict[str, Any]
) -> tuple[Offload | None, type, dict[str, Any]]:
    """What ``Offload`` makes of a ``DistributedOptimizer``: the offload whose host frames
    its shards get (all of the optimizer on the host; None otherwise), the class that steps
    them (a ``HybridDeviceOptimizer`` over ``optimizer_class`` for a share below 1) and its
    defaults, with the kernel of where it steps asked for ([Note: streamed step] in
    ``optim/streamed_step.py`` for ``step="device"``)."""
    share = 0.0 if offload is None else offload.fraction
    if share == 0.0:
        return None, optimizer_class, defaults
    fused = FUSED_ON_DEVICE if offload is not None and offload.step == "device" else FUSED_ON_HOST
    defaults = host_defaults(optimizer_class, classes, defaults, fused)
    if share == 1.0:
        return offload, optimizer_class, defaults
    from flatshard.optim.hybrid import HybridDeviceOptimizer

    assert offload is not None  # (a share above 0)
    hybrid = {
        "offload_fraction": share,
        "cpu_optimizer_class": optimizer_class,
        "pin_memory": offload.pin_memory,
    }
    return None, HybridDeviceOptimizer, {**defaults, **hybrid}


def ready_host_frames(shards: Sequence[BufferShards], stats: CommStats) -> None:
    """The grads of every offloaded buffer copied to the host (counted in ``stats``), and
    waited for; and every queued copy out of a host frame the step is to write (a gather of
    a forward run between the backward and the step reads the main params there) done."""
    fetched = [s for s in shards if s.host_grads is not None]
    for s in fetched:
        s.fetch_grads(stats)
    read = [s for s in shards if s.host_grads is not None or s.on_host]
    devices = {s.buffer.device for s in read if s.buffer.device.type == "cuda"}
    for device in devices:  # (asynchronous copies from or into pinned memory: done before the host writes)
        torch.cuda.current_stream(device).synchronize()
