"""Launches of reductions across dtypes ([Note: grad sync] in engine/grad_sync.py):
``Buckets(per_launch=k)`` takes a set's buckets of every buffer (dtype) in backward order,
k at a time, and a launch's reductions (one per buffer) start together. A GPT whose MLP input
layers are fp64 (two buffers: fp32 and fp64) follows DDP exactly at stages 1-3 on 1-4
ranks ([Note: parity tolerances] in tests/_parity.py: SGD, 1e-5; fp64 sums only make the
fp32 comparison tighter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flatshard
from _parity import SGD, TiedGPT, check_parity, train_optimizer_side_by_side
from flatshard.toolkit.testing import run_distributed


class Float64Linear(nn.Linear):
    """A linear layer that keeps its params and computes in fp64, in and out in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.double(), self.weight, self.bias).to(x.dtype)


class TwoDtypeGPT(TiedGPT):
    """TiedGPT whose blocks' ``fc`` layers are fp64: its params fill two buffers."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            fc = block.fc
            wide = Float64Linear(
                fc.in_features, fc.out_features, bias=fc.bias is not None, dtype=torch.float64
            )
            wide.load_state_dict(fc.state_dict())
            block.fc = wide


def test_a_launch_spans_both_dtypes_in_backward_order():
    model = flatshard.shard(TwoDtypeGPT(), stage=1, buckets=flatshard.Buckets(size=1000, per_launch=3))
    reductions = model.flatshard_state.grad_sync.reductions
    dtypes = {g.launch: set() for g in reductions}
    for g in reductions:
        dtypes[g.launch].add(g.buffer.layout.dtype)
    assert any(len(d) == 2 for d in dtypes.values())  # a launch holds buckets of both buffers
    launches = [g.launch for g in reductions]
    assert launches == sorted(launches)  # a launch's reductions follow each other
    sizes = {u: sum(len(g.buckets) for g in reductions if g.launch == u) for u in launches}
    assert all(n == 3 for n in list(sizes.values())[:-1])  # k buckets a launch (the last: the rest)
    # backward order: each launch's params were registered before the previous launch's
    names = model.flatshard_state.sets["main"].names
    last = []
    for u in sorted(set(launches)):
        last.append(max(names.index(n) for g in reductions if g.launch == u for n in g.names))
    assert last == sorted(last, reverse=True)


GROUPED = [(world, stage, 2) for world in (1, 2, 3, 4) for stage in (1, 2, 3)] + [(3, 2, None)]


@pytest.mark.parametrize(("world_size", "stage", "per_launch"), GROUPED)
def test_two_dtype_launches_follow_ddp(world_size, stage, per_launch):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "buckets": flatshard.Buckets(size=1000, per_launch=per_launch)},
        **SGD,
        model_cls=TwoDtypeGPT,
    )
    check_parity(result, params=1e-5)


def _launches_case(stage: int) -> list[bool]:
    """For every reduction launched in a backward: were all of its launch's reductions complete?"""
    from flatshard.engine import reduction
    from flatshard.toolkit.data import SyntheticCorpus

    torch.manual_seed(0)
    model = flatshard.shard(TwoDtypeGPT(), stage=stage, buckets=flatshard.Buckets(size=1000, per_launch=3))
    flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    reductions = model.flatshard_state.grad_sync.reductions
    seen: list[bool] = []
    start_sync = reduction.Reduction.start_sync

    def watched(started) -> None:
        seen.append(all(g.complete for g in reductions if g.launch == started.launch))
        start_sync(started)

    reduction.Reduction.start_sync = watched
    corpus = SyntheticCorpus(64, 16)
    x, y = corpus.batch(0, torch.distributed.get_rank(), 4)
    model(x, y).backward()
    return seen


@pytest.mark.parametrize("stage", [1, 2])
def test_a_reduction_starts_only_with_its_whole_launch(stage):
    for seen in run_distributed(_launches_case, 2, stage):
        assert seen and all(seen)
