"""Invariants of the pure layout planner ([Note: layout] in flatshard/planner/layout.py)."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flatshard
from _layouts import layouts
from flatshard import ParamSpec, plan_layout
from flatshard.planner.layout import BUCKET_ALIGN, PARAM_ALIGN, balance, plan_owners


def _params_disjoint_and_inside_their_bucket(case):
    specs, layout = case
    seen = set()
    for buf in layout.buffers:
        last_end = 0
        for bucket in buf.buckets:
            for slot in bucket.params:
                assert bucket.start <= slot.start < slot.end <= bucket.start + bucket.numel_unpadded
                assert slot.start >= last_end, "params overlap"
                assert slot.numel == specs[slot.index].numel
                assert slot.bucket == bucket.index
                last_end = slot.end
                seen.add(slot.name)
    assert seen == {s.name for s in specs}


def _buckets_tile_buffer_and_respect_dtype_and_order(case):
    specs, layout = case
    first_seen = list(dict.fromkeys((s.dtype, s.grad_dtype) for s in specs))
    assert [(b.dtype, b.grad_dtype) for b in layout.buffers] == first_seen
    for buf in layout.buffers:
        assert buf.buckets[0].start == 0 and buf.buckets[-1].end == buf.numel
        for a, b in zip(buf.buckets, buf.buckets[1:], strict=False):
            assert a.end == b.start
        for a, b in zip(buf.buckets, buf.buckets[1:], strict=False):
            assert min(s.index for s in a.params) > max(s.index for s in b.params)
        for bucket in buf.buckets:
            indices = [slot.index for slot in bucket.params]
            if not _is_whole_bucket(specs, layout, bucket):
                assert indices == sorted(indices, reverse=True), (
                    "params must be in reverse registration order"
                )
        for slot in buf.params:
            spec = specs[slot.index]
            assert (spec.dtype, spec.grad_dtype) == (buf.dtype, buf.grad_dtype)


def _bucket_closing_rules(case):
    specs, layout = case
    size = layout.bucket_size
    for buf in layout.buffers:
        for bucket, following in zip(buf.buckets, [*buf.buckets[1:], None], strict=True):
            slots = bucket.params
            if any(specs[s.index].own_bucket for s in slots):
                assert len(slots) == 1
            assert len({specs[s.index].unit for s in slots}) == 1
            in_order = _sizes_in_order(specs, slots, layout.sharded)
            nxt = None if following is None else specs[max(s.index for s in following.params)]
            if size is not None and len(slots) > 1:
                assert in_order[-2] < size  # it closed as soon as it was full
            if following is not None:  # it closed for a reason
                assert (
                    (size is not None and in_order[-1] >= size)
                    or nxt.own_bucket
                    or specs[slots[0].index].own_bucket
                    or nxt.unit != specs[slots[0].index].unit
                )


def _sharded_alignment_and_padding(case):
    _, layout = case
    if not layout.sharded:
        for buf in layout.buffers:
            assert buf.numel == buf.numel_unpadded
        return
    multiple = math.lcm(layout.world_size, 128)
    assert layout.pad_multiple % multiple == 0
    for buf in layout.buffers:
        for bucket in buf.buckets:
            assert bucket.start % BUCKET_ALIGN == 0
            if bucket.bounds is None:
                assert bucket.numel % layout.pad_multiple == 0
                assert bucket.shard_size * layout.world_size == bucket.numel
            else:  # uneven shards, each aligned and tiling the bucket
                assert bucket.bounds[0] == 0 and bucket.bounds[-1] == bucket.numel
                assert all(b % BUCKET_ALIGN == 0 for b in bucket.bounds)
                assert len(bucket.splits) == layout.world_size and min(bucket.splits) >= 0
            for slot in bucket.params:
                assert slot.start % PARAM_ALIGN == 0


def _every_element_owned_once_and_ranges_consistent(case):
    _, layout = case
    for buf in layout.buffers:
        for bucket in buf.buckets:
            owners = {slot.name: [0] * slot.numel for slot in bucket.params}
            for rank in range(layout.world_size):
                shard = bucket.shard_range(rank)
                for r in bucket.local_ranges(rank):
                    _, slot = layout.slot(r.name)
                    sizes = {r.in_buffer.size, r.in_bucket.size, r.in_shard.size, r.in_param.size}
                    assert len(sizes) == 1 and r.in_buffer.size > 0
                    assert r.in_bucket.start == r.in_buffer.start - bucket.start
                    assert r.in_shard.start == r.in_buffer.start - shard.start
                    assert r.in_param.start == r.in_buffer.start - slot.start
                    assert r.in_shard.start >= 0 and r.in_shard.end <= shard.size
                    assert r.in_param.start >= 0 and r.in_param.end <= slot.numel
                    for k in range(r.in_param.start, r.in_param.end):
                        owners[r.name][k] += 1
                    assert layout.param_ranges(r.name, rank) == r
            expected = 1 if layout.sharded else layout.world_size
            for name, counts in owners.items():
                assert set(counts) == {expected}, f"{name}: elements owned {set(counts)} times"


@settings(max_examples=300, deadline=None)
@given(layouts(aligned=True))
def test_aligned_layouts_cut_a_param_only_at_multiples_of_align(case):
    """[Note: aligned shards]: every param starts at a multiple of ``align``, every rank's
    piece of a param starts at a multiple of it from the param's start and ends at one or at
    the param's end, and every element is still owned once."""
    _, layout, align = case
    for buf in layout.buffers:
        for bucket in buf.buckets:
            owned = {slot.name: 0 for slot in bucket.params}
            for slot in bucket.params:
                assert not layout.sharded or slot.start % align == 0, slot
            for rank in range(layout.world_size):
                for r in bucket.local_ranges(rank):
                    _, slot = layout.slot(r.name)
                    assert r.in_param.start % align == 0, (r, align)
                    assert r.in_param.end % align == 0 or r.in_param.end == slot.numel, (r, align)
                    owned[r.name] += r.in_param.size
            expected = 1 if layout.sharded else layout.world_size
            assert owned == {s.name: s.numel * expected for s in bucket.params}


def test_align_must_be_a_multiple_of_64():
    with pytest.raises(ValueError, match="align must be a positive multiple of 64 elements, got 100"):
        plan_layout([ParamSpec("w", 10, torch.float32, torch.float32)], world_size=2, align=100)
    with pytest.raises(ValueError, match=r"Buckets\.align must be a positive multiple of 64 elements"):
        flatshard.Buckets(align=32)


def _is_whole_bucket(specs, layout, bucket) -> bool:
    return layout.sharded and layout.world_size > 1 and any(specs[s.index].whole for s in bucket.params)


def _sizes_in_order(specs, slots, sharded: bool) -> list[int]:
    """The bucket's size after each of its params, laid out one after another in buffer
    order (what the closing rule counts, whatever the placement)."""
    cursor, out = 0, []
    for slot in sorted(slots, key=lambda s: -s.index):
        cursor = (-(-cursor // PARAM_ALIGN) * PARAM_ALIGN if sharded else cursor) + specs[slot.index].numel
        out.append(cursor)
    return out


def _whole_param_buckets_keep_each_param_on_one_rank(case):
    specs, layout = case
    loads, largest = [0] * layout.world_size, 0  # over every whole-param bucket of the layout
    for buf in layout.buffers:
        for bucket in buf.buckets:
            assert (bucket.bounds is not None) == _is_whole_bucket(specs, layout, bucket)
            if not _is_whole_bucket(specs, layout, bucket):
                continue
            held = [0] * layout.world_size
            for slot in bucket.params:
                ranks = [r for r in range(layout.world_size) if layout.param_ranges(slot.name, r) is not None]
                assert len(ranks) == 1, f"{slot.name} is split over ranks {ranks}"
                assert bucket.owner(slot) == ranks[0]
                ranges = layout.param_ranges(slot.name, ranks[0])
                assert ranges.in_param == (0, slot.numel)
                held[ranks[0]] += _aligned(slot.numel)
                largest = max(largest, _aligned(slot.numel))
            # padded by alignment only: each shard is its params, rounded up to BUCKET_ALIGN
            assert list(bucket.splits) == [-(-h // BUCKET_ALIGN) * BUCKET_ALIGN for h in held]
            loads = [a + b for a, b in zip(loads, held, strict=True)]
    # balanced over the layout: the fullest rank holds at most the mean plus the largest param
    assert max(loads) <= sum(loads) / len(loads) + largest


def _aligned(numel: int) -> int:
    return -(-numel // PARAM_ALIGN) * PARAM_ALIGN


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_random_layouts_keep_every_invariant(case):
    """The checks above, each on the same random layouts: drawing a layout is nearly all of a
    check's time (hypothesis's ~80 draws a layout, 20 ms; planning it, under 1 ms), so one
    draw serves them all, 300 a run."""
    for check in (
        _params_disjoint_and_inside_their_bucket,
        _buckets_tile_buffer_and_respect_dtype_and_order,
        _bucket_closing_rules,
        _sharded_alignment_and_padding,
        _every_element_owned_once_and_ranges_consistent,
        _whole_param_buckets_keep_each_param_on_one_rank,
    ):
        check(case)


def test_balance_is_largest_first_to_the_least_loaded():
    assert balance([5, 1, 4, 3, 3], 2) == [0, 1, 1, 1, 0]  # 5, 4, 3, 3, 1: loads 5/4, 5/7, 8/7, 8/8
    loads = [10, 0]
    assert balance([3, 3], 2, loads) == [1, 1] and loads == [10, 6]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 8), st.lists(st.integers(0, 40), max_size=8))
def test_plan_owners_leaves_no_move_or_swap_that_lowers_the_fullest_rank(sizes, ranks, start):
    start = (start + [0] * ranks)[:ranks]
    loads = list(start)
    owners = plan_owners(sizes, ranks, loads)
    expected = list(start)
    for size, owner in zip(sizes, owners, strict=True):
        expected[owner] += size
    assert loads == expected
    first = list(start)
    balance(sizes, ranks, first)
    assert max(loads) <= max(first)  # never worse than largest-first alone
    top = max(loads)
    for i, owner in enumerate(owners):
        if loads[owner] != top:
            continue
        for rank in range(ranks):
            smaller = [0] + [sizes[j] for j, o in enumerate(owners) if o == rank and sizes[j] < sizes[i]]
            for b in smaller:
                d = sizes[i] - b
                assert rank == owner or max(top - d, loads[rank] + d) >= top


def test_plan_owners_finds_the_perfect_split_largest_first_misses():
    """The medium GPT's matrices over 8 ranks (in units of d**2: six layers of 4, 4, 3, 1):
    largest first ends at 10 against a mean of 9; moves and swaps reach 9 on every rank."""
    sizes = [4, 4, 3, 1] * 6
    first = [0] * 8
    balance(sizes, 8, first)
    assert max(first) == 10
    loads = [0] * 8
    plan_owners(sizes, 8, loads)
    assert loads == [9] * 8


def test_whole_bucket_by_hand():
    """Four matrices and two biases over two ranks: owners by size, each shard its own params."""
    specs = [
        _spec("w0", 1000, whole=True),
        _spec("b0", 10),
        _spec("w1", 3000, whole=True),
        _spec("w2", 2000, whole=True),
        _spec("b1", 10),
        _spec("w3", 500, whole=True),
    ]
    layout = plan_layout(specs, world_size=2)
    (bucket,) = layout.buffers[0].buckets
    owner = {s.name: next(r for r in range(2) if layout.param_ranges(s.name, r)) for s in bucket.params}
    # largest first: w1 (3008) r0, w2 (2048) r1, w0 (1024) r1, w3 (512) r0, the biases r1;
    # no move or swap lowers rank 0's 3520
    assert owner["w1"] == 0 and owner["w2"] == 1 and owner["w0"] == 1
    assert owner["w3"] == 0 and owner["b0"] == owner["b1"] == 1
    assert bucket.bounds == (0, 3584, 3584 + 3200)  # 3520 and 3200, rounded up to 128
    # rank 1's shard: its params in buffer order (w3, b1, w2, w1, b0, w0), each 64-aligned
    assert [(s.name, s.start) for s in bucket.params if owner[s.name] == 1] == [
        ("b1", 3584),
        ("w2", 3648),
        ("b0", 5696),
        ("w0", 5760),
    ]
    flat = plan_layout([dataclasses.replace(s, whole=False) for s in specs], world_size=2)
    assert layout.buffers[0].numel == flat.buffers[0].numel  # no padding beyond alignment here
    unsharded = [dataclasses.replace(s, whole=False) for s in specs]
    assert plan_layout(specs, world_size=1) == plan_layout(unsharded, world_size=1)  # one rank holds all


def test_a_unit_with_fewer_matrices_than_ranks_leaves_some_shards_empty():
    """Two units of two matrices over four ranks: owners balance across the units, so each
    rank holds one matrix and two shards of each bucket are empty."""
    specs = [_spec(f"{u}.w{i}", 4096, whole=True, unit=u) for u in ("a", "b") for i in range(2)]
    layout = plan_layout(specs, world_size=4)
    buckets = layout.buffers[0].buckets
    assert [b.splits.count(0) for b in buckets] == [2, 2]
    assert sorted(b.owner(s) for b in buckets for s in b.params) == [0, 1, 2, 3]
    assert all(r.shard_range(k).size in (0, 4096) for r in buckets for k in range(4))


def _spec(name, numel, dtype=torch.float32, **kw):
    return ParamSpec(name, numel, dtype, torch.float32, **kw)


def test_megatron_example_by_hand():
    # registration order a, b, c; laid out c, b, a; bucket closes once it holds >= 200
    specs = [_spec("a", 100), _spec("b", 150), _spec("c", 70)]
    layout = plan_layout(specs, world_size=3, bucket_size=200)
    (buf,) = layout.buffers
    assert [[s.name for s in b.params] for b in buf.buckets] == [["c", "b"], ["a"]]
    c, b = buf.buckets[0].params
    assert (c.start, c.end, b.start, b.end) == (0, 70, 128, 278)
    assert buf.buckets[0].end == 384 and buf.buckets[0].numel_unpadded == 278
    assert buf.buckets[1].start == 384 and buf.buckets[1].end == 768
    # rank 1 owns [128, 256) of bucket 0: the first 128 elements of b
    (r,) = buf.buckets[0].local_ranges(1)
    assert r.name == "b" and r.in_param == (0, 128) and r.in_shard == (0, 128)


def test_high_busbw_padding_and_own_bucket():
    specs = [_spec("emb", 500, own_bucket=True), _spec("w", 10)]
    layout = plan_layout(specs, world_size=4, pad_for_high_busbw=True)
    (buf,) = layout.buffers
    assert [[s.name for s in b.params] for b in buf.buckets] == [["w"], ["emb"]]
    assert all(b.numel == 2**16 for b in buf.buckets)


def test_unsharded_layout_has_no_padding_and_whole_bucket_shards():
    layout = plan_layout([_spec("a", 5), _spec("b", 7)], world_size=4, shard=False)
    (buf,) = layout.buffers
    assert buf.numel == 12 and buf.buckets[0].shard_range(3) == (0, 12)


def test_params_gathered_in_fp8_get_a_buffer_of_their_own():
    """([Note: fp8 gathers]) Same dtypes, but one buffer (and so one bucket, one gather
    dtype) per gather dtype, in first-seen order, each tiled and padded as any buffer."""
    fp8 = torch.float8_e4m3fn
    specs = [
        _spec("norm", 10),
        _spec("w1", 300, gather_dtype=fp8),
        _spec("b", 7),
        _spec("w2", 300, gather_dtype=fp8),
    ]
    layout = plan_layout(specs, world_size=3, bucket_size=500)
    plain, gathered = layout.buffers
    assert (plain.gather_dtype, gathered.gather_dtype) == (None, fp8)
    assert [s.name for s in plain.params] == ["b", "norm"] and [s.name for s in gathered.params] == [
        "w2",
        "w1",
    ]
    assert all(b.numel % 384 == 0 for b in gathered.buckets)
    assert "gathered in float8_e4m3fn" in str(layout)


def test_str_is_a_table():
    text = str(plan_layout([_spec("w", 100), _spec("h", 10, torch.bfloat16)], world_size=2))
    assert "buffer 0: param float32" in text and "buffer 1: param bfloat16" in text and " w" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "bucket_size": 0}, "bucket_size"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layout([_spec("a", 1)], **kwargs)


def test_bad_specs_name_the_param():
    with pytest.raises(ValueError, match="'x'"):
        _spec("x", 0)
    with pytest.raises(ValueError, match="'a' appears more than once"):
        plan_layout([_spec("a", 1), _spec("a", 2)], world_size=1)
    with pytest.raises(ValueError, match="rank 5"):
        plan_layout([_spec("a", 1)], world_size=2).buffers[0].buckets[0].shard_range(5)
