"""Rules of the optimizer's runs ([Note: optimizer runs] in flatshard/_shard_map.py)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _layouts import layouts
from flatshard import ParamSpec, plan_layout
from flatshard.planner.shard_map import plan_runs


@st.composite
def runs_cases(draw):
    specs, layout = draw(layouts())
    n_groups = draw(st.integers(1, 3))
    group_of = {}
    for spec in specs:
        group = draw(st.integers(-1, n_groups - 1))  # -1: in no group, not optimized
        if group >= 0:
            group_of[spec.name] = group
    rank = draw(st.integers(0, layout.world_size - 1))
    shapes = {}  # some optimized params that lie whole in this rank's shard: whole-param runs
    for buffer in layout.buffers:
        for bucket in buffer.buckets:
            for piece in bucket.local_ranges(rank):
                numel = piece.in_param.size
                if (
                    piece.name in group_of
                    and piece.in_param.start == 0
                    and numel == layout.slot(piece.name)[1].numel
                ) and draw(st.booleans()):
                    shapes[piece.name] = (2, numel // 2) if numel % 2 == 0 else (numel,)
    return layout, rank, group_of, shapes


@settings(max_examples=300, deadline=None)
@given(runs_cases())
def test_runs_cover_optimized_params_once_and_nothing_else(case):
    layout, rank, group_of, shapes = case
    for buffer in layout.buffers:
        runs = plan_runs(buffer, rank, group_of, shapes)
        for bucket in buffer.buckets:
            mine = [r for r in runs if r.bucket == bucket.index]
            size = bucket.shard_range(rank).size
            for a, b in itertools.pairwise(mine):
                assert a.in_shard.end <= b.in_shard.start, "runs overlap or are out of order"
            for run in mine:
                assert 0 <= run.in_shard.start < run.in_shard.end <= size
            for piece in bucket.local_ranges(rank):
                group = group_of.get(piece.name)
                holders = [r for r in mine if r.in_shard.intersect(piece.in_shard) is not None]
                if group is None:
                    assert not holders, f"{piece.name} is in no group but lies in a run"
                else:
                    assert len(holders) == 1, f"{piece.name} lies in {len(holders)} runs"
                    (run,) = holders
                    assert run.group == group
                    assert run.in_shard.start <= piece.in_shard.start
                    assert piece.in_shard.end <= run.in_shard.end
                    if piece.name in shapes:  # rule 4: a run of its own, exactly the param
                        assert run.in_shard == piece.in_shard and run.shape == shapes[piece.name]
                    else:
                        assert run.shape is None


@settings(max_examples=300, deadline=None)
@given(runs_cases(), st.data())
def test_piece_params_are_runs_of_their_own_part_of_each_shard(case, data):
    """Rule 5: a param in ``pieces`` is, in this rank's shard, exactly one flat run of
    exactly its part; every other optimized piece still lies in one run of its group."""
    layout, rank, group_of, shapes = case
    pieces = {n for n in group_of if n not in shapes and data.draw(st.booleans())}
    for buffer in layout.buffers:
        runs = plan_runs(buffer, rank, group_of, shapes, pieces)
        for bucket in buffer.buckets:
            mine = [r for r in runs if r.bucket == bucket.index]
            for a, b in itertools.pairwise(mine):
                assert a.in_shard.end <= b.in_shard.start
            for piece in bucket.local_ranges(rank):
                holders = [r for r in mine if r.in_shard.intersect(piece.in_shard) is not None]
                if piece.name not in group_of:
                    assert not holders
                    continue
                (run,) = holders
                assert run.group == group_of[piece.name]
                if piece.name in pieces:
                    assert run.in_shard == piece.in_shard and run.shape == (piece.in_shard.size,)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_one_group_makes_one_run_per_bucket_shard_that_holds_params(case):
    specs, layout = case
    group_of = {spec.name: 0 for spec in specs}
    for rank in range(layout.world_size):
        for buffer in layout.buffers:
            runs = plan_runs(buffer, rank, group_of)
            with_params = [b for b in buffer.buckets if b.local_ranges(rank)]
            assert [r.bucket for r in runs] == [b.index for b in with_params]
            for run, bucket in zip(runs, with_params, strict=True):
                assert run.in_shard == (0, bucket.shard_range(rank).size)


def test_runs_split_where_the_group_changes_and_skip_params_in_no_group():
    specs = [ParamSpec(name, 100, torch.float32, torch.float32) for name in "abcd"]
    layout = plan_layout(specs, world_size=1, bucket_size=None, shard=True)
    (buffer,) = layout.buffers
    # buffer order is reversed registration: d c b a, each aligned to 64 elements
    offsets = {slot.name: slot.range for slot in buffer.params}
    runs = plan_runs(buffer, 0, {"a": 0, "b": 1, "d": 1})
    shard_end = buffer.buckets[0].shard_range(0).size
    assert [(r.group, tuple(r.in_shard)) for r in runs] == [
        (1, (0, offsets["c"].start)),  # d and the gap after it; c is in no group
        (1, (offsets["c"].end, offsets["a"].start)),  # the gap after c, b, and the gap after b
        (0, (offsets["a"].start, shard_end)),  # a and the end padding
    ]


def test_a_param_cut_across_shards_is_refused_as_a_whole_run():
    specs = [
        ParamSpec("a", 300, torch.float32, torch.float32),
        ParamSpec("b", 100, torch.float32, torch.float32),
    ]
    layout = plan_layout(specs, world_size=2, bucket_size=None)
    with pytest.raises(ValueError, match=r"param 'a' of shape \(300,\) is not whole in this shard"):
        for rank in range(2):
            plan_runs(layout.buffers[0], rank, {"a": 0, "b": 0}, {"a": (300,)})


def test_whole_param_buckets_give_each_matrix_one_shaped_run():
    specs = [
        ParamSpec(f"w{i}", 64 * n, torch.float32, torch.float32, whole=True)
        for i, n in enumerate([4, 3, 2, 1])
    ]
    layout = plan_layout(specs, world_size=2, bucket_size=None)
    shapes = {f"w{i}": (64, n) for i, n in enumerate([4, 3, 2, 1])}
    runs = [plan_runs(layout.buffers[0], r, {n: 0 for n in shapes}, shapes) for r in range(2)]
    assert sorted(s for rank in runs for s in (r.shape for r in rank)) == sorted(shapes.values())
    assert [sum(math.prod(r.shape) for r in rank) for rank in runs] == [320, 320]  # balanced: 4+1, 3+2
