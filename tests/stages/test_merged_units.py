"""Merged units ([Note: merged units] in units/unit_tree.py): which units merge, that a bucket
never mixes merged units, that merging cuts the collectives a step issues, and that stage 3
with merged units follows torch DDP where ranks run every block, skip some, run one twice
or recompute them."""

from functools import partial

import pytest
import torch
from torch import nn

import flatshard
from _parity import (
    SGD,
    CheckpointedGPT,
    RankSkippingGPT,
    SharedBlockGPT,
    TiedGPT,
    check_parity,
    decay_groups,
    train_optimizer_side_by_side,
)
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig
from flatshard.toolkit.models.gpt import Block
from flatshard.toolkit.testing import run_distributed
from flatshard.units.unit_tree import assign_params, find_units, merge_units
from flatshard.wrap.specs import stage3_units

SIX = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=6, n_heads=2)
BLOCK_BYTES = 4 * sum(p.numel() for p in Block(SIX).parameters())
PAIRS = 2 * BLOCK_BYTES + 100
"""``unit_bytes`` that merges the blocks of these GPTs in pairs."""


def _merged(model: nn.Module, unit_bytes, units=None):
    """The units of ``model`` after merging, and ``{id(param): merged unit}``."""
    return stage3_units(model, list(model.named_parameters()), units, unit_bytes)


def test_adjacent_blocks_merge_up_to_the_bytes_and_the_root_never_does():
    model = GPT(SIX)
    units, unit_of = _merged(model, PAIRS)
    assert [u.names for u in units] == [
        ("",),
        ("blocks.0", "blocks.1"),
        ("blocks.2", "blocks.3"),
        ("blocks.4", "blocks.5"),
    ]
    assert [u.name for u in units][1] == "blocks.0..blocks.1"
    assert [u.parent for u in units] == [None, 0, 0, 0]
    assert unit_of[id(model.blocks[3].fc.weight)] == 2 and unit_of[id(model.wte.weight)] == 0
    odd = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=5, n_heads=2))
    assert [u.names[-1] for u in _merged(odd, PAIRS)[0]] == ["", "blocks.1", "blocks.3", "blocks.4"]
    assert len(_merged(model, 2 * BLOCK_BYTES - 1)[0]) == 1 + 6, "a pair above the bytes does not merge"
    assert len(_merged(model, BLOCK_BYTES - 1)[0]) == 1 + 6, "a unit above the bytes stays one unit"
    assert len(_merged(model, None)[0]) == 1 + 6
    assert [u.names for u in _merged(model, 10**9)[0]] == [("",), tuple(f"blocks.{i}" for i in range(6))]


def test_only_sibling_leaf_units_merge():
    """Blocks holding linear units are not leaves and stay whole; the linears of one block
    merge with each other but never with another block's."""
    model = GPT(SIX)
    units, unit_of = _merged(model, 10**9, units={Block, nn.Linear})
    blocks = [u for u in units if u.names[0].count(".") == 1]
    assert [u.names for u in blocks] == [(f"blocks.{i}",) for i in range(6)]
    linears = [u for u in units if u.names[0].count(".") > 1]
    assert linears[0].names == tuple(f"blocks.0.{n}" for n in ("attn.qkv", "attn.proj", "fc", "out"))
    assert len(linears) == 6 and all(units[u.parent] in blocks for u in linears)
    assert unit_of[id(model.blocks[2].ln1.weight)] == blocks[2].index
    separate = find_units(model, {Block, nn.Linear})
    same, same_of = merge_units(separate, assign_params(model, separate), [0] * len(separate), None)
    assert same is separate and same_of == assign_params(model, separate)


def test_a_bucket_never_mixes_merged_units_and_unit_bytes_is_checked():
    torch.manual_seed(0)
    model = GPT(SIX)
    twin = GPT(SIX)
    unit_of = _merged(twin, PAIRS)[1]
    names = {n: unit_of[id(p)] for n, p in twin.named_parameters()}
    sharded = flatshard.shard(
        model, stage=3, buckets=flatshard.Buckets(size=10**9), stage3=flatshard.Stage3(unit_bytes=PAIRS)
    )
    buckets = sharded.layouts["main"].buffers[0].buckets
    assert sorted({names[s.name] for b in buckets for s in b.params}) == [0, 1, 2, 3]
    assert all(len({names[s.name] for s in b.params}) == 1 for b in buckets)
    assert len(buckets) == 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="unit_bytes must be"):
            flatshard.shard(GPT(SIX), stage=3, stage3=flatshard.Stage3(unit_bytes=bad))
    with pytest.raises(ValueError, match=r"unit_bytes=.* applies to stage 3 only"):
        flatshard.shard(GPT(SIX), stage=2, stage3=flatshard.Stage3(unit_bytes=PAIRS))


def _collectives_per_step(unit_bytes) -> dict[str, int]:
    """Collectives rank 0 issues in one training step (after one step of warm-up)."""
    torch.manual_seed(0)
    model = flatshard.shard(
        GPT(SIX),
        stage=3,
        buckets=flatshard.Buckets(size=10**9),
        stage3=flatshard.Stage3(unit_bytes=unit_bytes),
    )
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    corpus = SyntheticCorpus(SIX.vocab_size, SIX.seq_len)
    for step in range(2):
        model.comm_stats.reset()
        x, y = corpus.batch(step, torch.distributed.get_rank(), 2)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.comm_stats.calls)


def test_merging_cuts_the_gathers_and_reductions_a_step_issues():
    """Six blocks a unit each: the root and the last two stay full into backward (gathered
    once), four blocks twice: 11 gathers, 7 reduce-scatters. In pairs: 3 + 2 and 4."""
    per_block = run_distributed(_collectives_per_step, 2, None)[0]
    pairs = run_distributed(_collectives_per_step, 2, PAIRS)[0]
    assert (per_block["all_gather"], per_block["reduce_scatter"]) == (11, 7), per_block
    assert (pairs["all_gather"], pairs["reduce_scatter"]) == (5, 4), pairs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_merged_units_follow_ddp(world_size):
    """Six blocks merged in pairs: the first pair is freed after forward and gathered again
    in backward, the others stay full; SGD with param groups, a schedule and clipping."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": 3, "buckets": flatshard.Buckets(size=3000), "stage3": flatshard.Stage3(unit_bytes=PAIRS)},
        **SGD,
        groups=decay_groups,
        schedule=True,
        clip=0.5,
        model_cls=partial(TiedGPT, SIX),
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("backward_prefetch", ["post", None])
def test_merged_units_follow_ddp_with_other_prefetch(backward_prefetch):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        3,
        {
            "stage": 3,
            "stage3": flatshard.Stage3(
                unit_bytes=PAIRS, backward_prefetch=backward_prefetch, forward_prefetch=2
            ),
        },
        **SGD,
        clip=0.5,
        model_cls=partial(TiedGPT, SIX),
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_merged_units_where_ranks_skip_some_of_their_modules(reshard_after_forward):
    """Four blocks in two pairs; rank r skips block r or exits before the last r blocks, so
    a pair runs whole on one rank, half on another and not at all on a third; every rank
    still issues the same gathers and SGD follows DDP."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        3,
        {
            "stage": 3,
            "stage3": flatshard.Stage3(unit_bytes=PAIRS, reshard_after_forward=reshard_after_forward),
        },
        optimizer_class=torch.optim.SGD,
        opt_kwargs={"lr": 0.1},
        clip=0.5,
        reference_kwargs={"find_unused_parameters": True},
        model_cls=RankSkippingGPT,
        steps=4,
        accum=1,
        timeout=60,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize(
    ("model_cls", "options"),
    [(partial(SharedBlockGPT, SIX), {"stage3": flatshard.Stage3(unit_bytes=PAIRS)}), (CheckpointedGPT, {})],
    ids=["shared-block", "checkpointed"],
)
def test_merged_units_run_twice_or_recomputed(model_cls, options):
    """SharedBlockGPT runs block 0 again after the last pair: its pair was freed once both
    of its blocks ran, so it is gathered again and freed at the end of the forward.
    CheckpointedGPT (default ``unit_bytes``: both blocks one unit) recomputes its blocks in
    backward."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side, 3, {"stage": 3, **options}, **SGD, clip=0.5, model_cls=model_cls
    )
    check_parity(result, params=1e-5)


def test_units_may_name_one_class():
    """``Stage3(units=Block)`` picks the same units as ``units=[Block]`` (a single class was a
    ``TypeError: 'type' object is not iterable``)."""
    model = GPT(SIX)
    one, listed = find_units(model, Block), find_units(model, [Block])
    assert [u.names for u in one] == [u.names for u in listed] and len(one) == 1 + SIX.n_layers
    sharded = flatshard.shard(GPT(SIX), stage=3, stage3=flatshard.Stage3(units=Block, unit_bytes=None))
    assert len(sharded.flatshard_state.unsharder.units) == 1 + SIX.n_layers
