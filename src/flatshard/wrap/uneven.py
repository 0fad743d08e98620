"""Uneven inputs: every rank stops at the same step when one runs out of data.

A rank whose loader is exhausted leaves the training loop while the others enter one more
step's collectives, which then wait for it (``DesyncError`` once the deadline passes). DDP
answers with ``Join``, where the exhausted ranks shadow the others' collectives with zero
grads; under sharding every gather and reduce-scatter would need its shadow. ``even_batches``
takes the simpler way out: the ranks agree, before each batch, that each still has one, so
all stop together at the shortest rank's end. The batches left on the longer ranks are not
trained on, as with a ``DistributedSampler(drop_last=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar, cast

import torch
from torch import nn

from flatshard.comm.collectives import all_reduce
from flatshard.wrap.module import job_world

T = TypeVar("T")


def even_batches(batches: Iterable[T], model: nn.Module | None = None) -> Iterator[T]:
    """Yield from ``batches`` while every rank of the default process group still has a
    batch; every rank stops at the same step.

    Costs one 4-byte all-reduce per batch, within the deadline of ``model``'s collectives
    (``shard(timeout=...)``; without a model, the default)::

        for x, y in flatshard.even_batches(loader, model):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    """
    world = job_world(model)
    device = world.control_device
    source = iter(batches)
    while True:
        batch = next(source, _END)
        has = torch.tensor([0 if batch is _END else 1], dtype=torch.int32, device=device)
        all_reduce(has, world, op="min").wait()
        if not int(has):
            return
        yield cast(T, batch)


_END = object()
