"""[Note: lifecycles]: every state has its edges, illegal moves raise, and a training step
walks the states the note describes."""

import pytest
import torch
from torch import nn

import flatshard
from flatshard.engine.lifecycle import (
    TRANSITIONS,
    Backward,
    Gather,
    Grads,
    IllegalTransition,
    ReductionState,
    advance,
)


def test_every_state_has_its_edges_and_illegal_moves_raise():
    for enum in (Backward, Grads, ReductionState, Gather):
        for state in enum:
            assert state in TRANSITIONS and all(type(n) is enum for n in TRANSITIONS[state])
    assert advance(ReductionState.COLLECTING, ReductionState.REDUCING, "g") is ReductionState.REDUCING
    with pytest.raises(IllegalTransition, match="reduction 3: REDUCED -> REDUCING"):
        advance(ReductionState.REDUCED, ReductionState.REDUCING, "reduction 3")
    with pytest.raises(IllegalTransition):
        advance(Backward.IDLE, Backward.UNBOUNDED, "backward")
    with pytest.raises(IllegalTransition, match="a unit: SHARDED -> FULL"):
        advance(Gather.SHARDED, Gather.FULL, "a unit")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_step_walks_the_states(stage):
    torch.manual_seed(0)
    model = flatshard.shard(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), stage=stage, buckets=flatshard.Buckets(size=8)
    )
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    sync = model.flatshard_state.grad_sync
    assert (sync.backward, sync.grads) == (Backward.IDLE, Grads.EMPTY)
    seen = []

    def inputs():  # whose grad arrives last in backward, before the end-of-backward callback
        x = torch.randn(2, 4, requires_grad=True)
        x.register_hook(lambda grad: seen.append(sync.backward))
        return x

    with model.no_sync():
        model(inputs()).sum().backward()
    assert sync.grads is Grads.UNREDUCED
    with pytest.raises(RuntimeError, match="no_sync"):
        opt.step()
    model(inputs()).sum().backward()
    assert seen == [Backward.RUNNING, Backward.RUNNING]
    assert (sync.backward, sync.grads) == (Backward.IDLE, Grads.REDUCED)
    assert {g.state for g in sync.reductions} == {ReductionState.COLLECTING}  # reset for the next backward
    opt.step()
    opt.zero_grad()
    assert sync.grads is Grads.EMPTY


def test_stage3_units_walk_sharded_gathering_full():
    torch.manual_seed(0)
    model = flatshard.shard(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), stage=3, stage3=flatshard.Stage3(units=[nn.Linear])
    )
    unsharder = model.flatshard_state.unsharder
    model.wait_for_params()
    assert set(unsharder.state) == {Gather.SHARDED}
    unsharder.unshard(0)
    assert unsharder.state[0] is Gather.GATHERING
    unsharder.wait(0)
    assert unsharder.state[0] is Gather.FULL
    unsharder.reshard(0)
    assert unsharder.state[0] is Gather.SHARDED
