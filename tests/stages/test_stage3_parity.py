"""Stage 3 follows torch DDP + the same torch optimizer (and torch FSDP2).

Same harness as the stage 0-2 parity tests (tolerances: [Note: parity tolerances] in
tests/_parity.py); the units are the transformer blocks and the root.
"""

import warnings

import pytest
import torch

from _parity import (
    SGD,
    CheckpointedGPT,
    RankSkippingGPT,
    RankUnusedGPT,
    SharedBlockGPT,
    SkippingGPT,
    check_parity,
    decay_groups,
    train_against_fsdp2,
    train_optimizer_side_by_side,
)
from flatshard import Buckets, Stage3
from flatshard.toolkit.testing import run_distributed


def _stage3(reshard_after_forward: bool) -> dict:
    """``shard()``'s arguments of these runs: stage 3 in buckets of 3000 elements."""
    return {
        "stage": 3,
        "buckets": Buckets(size=3000),
        "stage3": Stage3(reshard_after_forward=reshard_after_forward),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_sgd_groups_schedule_clip_accumulation(world_size, reshard_after_forward):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        _stage3(reshard_after_forward),
        **SGD,
        groups=decay_groups,
        schedule=True,
        clip=0.5,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_adamw_groups_schedule(world_size):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": 3, "buckets": Buckets(size=3000)},
        groups=decay_groups,
        schedule=True,
    )
    check_parity(result, params=1e-5 if world_size <= 2 else 1e-2)


@pytest.mark.parametrize(
    ("forward_prefetch", "backward_prefetch", "limit"), [(0, None, 1), (2, "post", 2), (3, "pre", 8)]
)
def test_prefetch_settings_do_not_change_the_trajectory(forward_prefetch, backward_prefetch, limit):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        3,
        {
            "stage": 3,
            "buckets": Buckets(size=1000),
            "stage3": Stage3(
                forward_prefetch=forward_prefetch,
                backward_prefetch=backward_prefetch,
                limit_all_gathers=limit,
            ),
        },
        **SGD,
        clip=0.5,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_follows_fsdp2(world_size, reshard_after_forward):
    """flatshard stage 3 and torch FSDP2 on the same blocks, both with AdamW (unclipped:
    a clipping coefficient that differs in the 7th digit turns into differences of order lr
    under Adam, see [Parity tolerances]; clipping is compared with SGD above)."""
    (result, *_) = run_distributed(
        train_against_fsdp2,
        world_size,
        _stage3(reshard_after_forward),
        fsdp_kwargs={"reshard_after_forward": reshard_after_forward},
        clip=None,
    )
    check_parity(result, params=1e-5 if world_size <= 2 else 1e-2)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4)])
def test_replicated_sharding(mesh_shape):
    """A 2-D (replicate, shard) mesh: units gathered within a row, grad shards all-reduced
    across rows; parity with DDP over all 4 ranks."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        4,
        {"stage": 3, "buckets": Buckets(size=3000)},
        **SGD,
        clip=0.5,
        mesh_shape=mesh_shape,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("model_cls", [SharedBlockGPT, CheckpointedGPT])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shared_blocks_and_activation_checkpointing(model_cls, reshard_after_forward):
    """SharedBlockGPT runs its first block again after the others (gathered again for the
    second call; its grads sum both calls); CheckpointedGPT recomputes every block in
    backward (non-reentrant checkpointing), which finds its params full."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        3,
        _stage3(reshard_after_forward),
        **SGD,
        clip=0.5,
        model_cls=model_cls,
    )
    check_parity(result, params=1e-5)


DIVERGING = {
    "optimizer_class": torch.optim.SGD,  # plain SGD: a zero grad changes nothing, as a missing one
    "opt_kwargs": {"lr": 0.1},
    "clip": 0.5,
    "reference_kwargs": {"find_unused_parameters": True},  # DDP's reference where grads go missing
}
"""Training where ranks leave different params without grads, against DDP."""


@pytest.mark.parametrize("model_cls", [SkippingGPT, RankSkippingGPT])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("accum", [1, 2])
def test_a_unit_not_called_in_some_forwards(model_cls, reshard_after_forward, accum):
    """A block is skipped on every second forward, by every rank (SkippingGPT) or by rank r
    for block r (RankSkippingGPT: ranks take different control flow; every rank still issues
    the same gathers, [Note: unsharding], and waits for a reduction only where that cannot
    deadlock, [Note: two process groups]). With ``accum=1`` every such forward's backward
    reduces grads. The skipped grads are zero there, and plain SGD (where a zero grad
    changes nothing, as a missing one in torch) follows DDP."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        3,
        _stage3(reshard_after_forward),
        **DIVERGING,
        model_cls=model_cls,
        steps=4 if accum == 1 else 3,
        accum=accum,
        timeout=60,
    )
    check_parity(result, params=1e-5)


def _train_with_a_short_block_timeout(*args, **kwargs):
    """``train_optimizer_side_by_side`` with grad sync giving up a blocked wait after 0.3 s;
    also returns the warnings raised."""
    import flatshard.engine.grad_sync

    flatshard.engine.grad_sync.BLOCK_TIMEOUT_S = 0.3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_optimizer_side_by_side(*args, **kwargs)
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("find_unused_parameters", [True, False])
def test_params_of_a_unit_that_ran_without_grads_on_some_ranks(find_unused_parameters):
    """Rank r's block r skips its MLP on every second forward (every backward reduces).
    With ``find_unused_parameters=True`` no rank waits for a reduction while it still has
    gathers to issue ([Note: two process groups]). Without it (a broken promise) a rank
    that waits for the reduction of those params gives the wait up after
    ``BLOCK_TIMEOUT_S`` and warns instead of hanging. Either way the unused params
    contribute zeros and SGD follows DDP."""
    results = run_distributed(
        _train_with_a_short_block_timeout,
        3,
        {
            "stage": 3,
            "find_unused_parameters": find_unused_parameters,
            "buckets": Buckets(size=3000),
            "stage3": Stage3(unit_bytes=None),
        },
        **DIVERGING,
        model_cls=RankUnusedGPT,
        steps=4,
        accum=1,
        timeout=90,
    )
    check_parity(results[0][0], params=1e-5)
    warned = [m for _, messages in results for m in messages if "grad-scratch bound" in m]
    if find_unused_parameters:
        assert not warned, warned
    else:
        assert warned, "no rank gave up waiting: the test no longer reaches the case it guards"
        assert all("find_unused_parameters=True" in m for m in warned), warned
