"""DistributedOptimizer at stages 0-2 follows torch DDP + the same torch optimizer.

Every run trains a tied-embedding GPT with a frozen param side by side with a DDP
reference, with grad accumulation, and compares losses, grad norms and params at every
step (tolerances: [Note: parity tolerances] in tests/_parity.py).
"""

import pytest
import torch

from _parity import SGD, check_parity, decay_groups, train_optimizer_side_by_side
from flatshard import Buckets
from flatshard.toolkit.testing import run_distributed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("bucket_size", [None, 3000])
def test_sgd_groups_schedule_clip_accumulation(world_size, stage, bucket_size):
    """Two param groups (different lr and weight decay), a StepLR schedule, clipping that
    binds, two micro-batches per step: params equal DDP's to 1e-5 at every step."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "buckets": Buckets(size=bucket_size)},
        **SGD,
        groups=decay_groups,
        schedule=True,
        clip=0.5,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_adamw_groups_schedule(world_size, stage):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "buckets": Buckets(size=3000)},
        groups=decay_groups,
        schedule=True,
    )
    check_parity(result, params=1e-5 if world_size <= 2 else 1e-2)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_reducing_every_micro_batch_accumulates_like_no_sync(world_size, stage):
    """Syncing every micro-batch (new grads added to shards that already hold a reduced
    sum) gives what DDP gives when it accumulates under no_sync."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "buckets": Buckets(size=2000)},
        **SGD,
        accum=3,
        sync_every_micro_batch=True,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_summed_grads_every_micro_batch(world_size, stage):
    """grad_scale=1.0 sums instead of averaging, so a shard's earlier sum must not be
    counted once per rank: SGD with lr / N and weight decay * N must equal DDP exactly."""
    lr, wd = SGD["opt_kwargs"]["lr"], SGD["opt_kwargs"]["weight_decay"]
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "grad_scale": 1.0, "buckets": Buckets(size=2000)},
        **SGD,
        ours_opt_kwargs={"lr": lr / world_size, "momentum": 0.9, "weight_decay": wd * world_size},
        accum=3,
        sync_every_micro_batch=True,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.Adagrad, torch.optim.RMSprop])
def test_other_elementwise_optimizers(optimizer_class):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        2,
        {"stage": 2, "buckets": Buckets(size=3000)},
        optimizer_class=optimizer_class,
        opt_kwargs={"lr": 1e-2},
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1)])
@pytest.mark.parametrize("stage", [1, 2])
def test_replicated_sharding_over_a_2d_mesh(mesh_shape, stage):
    """A (replicate, shard) mesh at 4 ranks: shards reduce-scattered within each row and
    all-reduced across rows follow DDP over all 4 ranks."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        4,
        {"stage": stage, "buckets": Buckets(size=2000)},
        **SGD,
        groups=decay_groups,
        clip=0.5,
        mesh_shape=mesh_shape,
    )
    check_parity(result, params=1e-5)


GROUPED = [
    *[(world, stage, {"buckets": Buckets(per_launch=None)}) for world in (1, 2, 3, 4) for stage in (1, 2, 3)],
    *[(3, stage, {"buckets": Buckets(per_launch=3)}) for stage in (1, 2, 3)],
    *[(3, stage, {"buckets": Buckets(pad_for_high_busbw=True)}) for stage in (1, 2)],
]
"""Several buckets reduced as one group (one all-to-all on gloo: ``reduce_scatter_coalesced``),
every bucket of a buffer in one group at every world size, and 2**16 padding."""


@pytest.mark.parametrize(("world_size", "stage", "layout_kwargs"), GROUPED)
def test_coalesced_groups_and_high_busbw_padding(world_size, stage, layout_kwargs):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, **layout_kwargs, "buckets": Buckets(size=1000)},
        **SGD,
        clip=0.5,
    )
    check_parity(result, params=1e-5)
