"""StagePolicy: the one place that says what each stage keeps sharded and which collectives
it runs; options that do not apply to the chosen stage are errors naming the option."""

import pytest
from torch import nn

import flatshard
from flatshard.planner.stage import STAGES, StagePolicy


def test_the_table_of_the_note():
    rows = {
        s: (
            p.shards_optimizer,
            p.shards_grads,
            p.shards_params,
            p.grad_collective,
            p.gathers_buckets_after_step,
        )
        for s, p in ((s, StagePolicy(s)) for s in STAGES)
    }
    assert rows == {
        0: (False, False, False, "all_reduce", False),
        1: (True, False, False, "reduce_scatter", True),
        2: (True, True, False, "reduce_scatter", True),
        3: (True, True, True, "reduce_scatter", False),
    }
    assert [StagePolicy(s).gathers_units for s in STAGES] == [False, False, False, True]
    assert [StagePolicy(s).allows_replicated_mesh for s in STAGES] == [False, True, True, True]
    # fp32 params and grads (4 bytes): all-reduce 2x grads; reduce-scatter + one or two gathers
    assert [StagePolicy(s).wire_bytes_per_element(4, 4) for s in STAGES] == [8, 8, 8, 12]
    assert StagePolicy(3).wire_bytes_per_element(2, 4, gathers=1) == 6


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("backward_prefetch", None),
        ("forward_prefetch", 2),
        ("limit_all_gathers", 1),
        ("reshard_after_forward", False),
        ("units", [nn.Linear]),
        ("device", "cpu"),
        ("param_init_fn", print),
    ],
)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_options_below_stage_3_are_refused_naming_them(stage, option, value):
    """Nothing reads them below stage 3, so a user who set them would think they apply."""
    with pytest.raises(
        ValueError, match=rf"^stage3=Stage3\(.*{option}=.* applies to stage 3 only .* got stage {stage}"
    ):
        flatshard.shard(nn.Linear(2, 2), stage=stage, stage3=flatshard.Stage3(**{option: value}))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backward_prefetch": "later"}, "backward_prefetch must be one of"),
        ({"forward_prefetch": -1}, "forward_prefetch must be an int >= 0, got -1"),
        ({"limit_all_gathers": 1.5}, "limit_all_gathers must be an int >= 1, got 1.5"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward must be a bool, got 'yes'"),
        ({"unit_bytes": 0}, "unit_bytes must be an int >= 1 or None, got 0"),
    ],
)
def test_stage3_options_are_checked_once_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        flatshard.Stage3(**kwargs)


@pytest.mark.parametrize("stage", [4, -1, True, "2", 2.0])
def test_a_stage_that_is_not_0_to_3_is_refused(stage):
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3, got"):
        StagePolicy(stage)


@pytest.mark.parametrize(
    "keyword",
    ["bucket_size", "buckets_per_group", "pad_for_high_busbw", "unit_bytes", "units"],  # (retired spellings)
)
def test_the_options_objects_are_the_only_spelling(keyword):
    """``Buckets``, ``Stage3`` and ``Offload`` hold these options; ``shard()`` itself takes 13
    keywords, each in its signature (a misspelled one is a type checker's error, and Python's)."""
    import inspect

    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        flatshard.shard(nn.Linear(2, 2), stage=3, **{keyword: None})
    kinds = {p.kind for p in inspect.signature(flatshard.shard).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    keywords = [p for p in inspect.signature(flatshard.shard).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) == 13, [p.name for p in keywords]


def test_stage3_and_buckets_are_checked_where_they_are_built():
    new = flatshard.shard(
        nn.Linear(2, 2), stage=3, stage3=flatshard.Stage3(unit_bytes=None, forward_prefetch=0)
    )
    assert new.flatshard_state.policy.stage3.forward_prefetch == 0
    with pytest.raises(
        ValueError, match=r"^stage3=Stage3\(unit_bytes=None\) applies to stage 3 only .* got stage 2"
    ):
        flatshard.shard(nn.Linear(2, 2), stage=2, stage3=flatshard.Stage3(unit_bytes=None))
    with pytest.raises(ValueError, match="limit_all_gathers must be an int >= 1, got 0"):
        flatshard.Stage3(limit_all_gathers=0)
    model = flatshard.shard(nn.Linear(64, 64), buckets=flatshard.Buckets(size=50, per_launch=None))
    layout = [
        (b.layout.numel, len(b.layout.buckets))
        for s in model.flatshard_state.sets.values()
        for b in s.buffers
    ]
    assert layout[0][1] == 2  # (the bias, 64 elements, then the weight)
    assert len(model.flatshard_state.grad_sync.reductions) == 1
    with pytest.raises(TypeError, match=r"buckets must be a flatshard\.Buckets, got int"):
        flatshard.shard(nn.Linear(2, 2), buckets=1000)
    with pytest.raises(
        ValueError, match=r"Buckets.size must be a positive number of elements or None, got 0"
    ):
        flatshard.Buckets(size=0)
    with pytest.raises(TypeError, match="pad_for_high_busbw must be True or False, got 'no'"):
        flatshard.Buckets(pad_for_high_busbw="no")
