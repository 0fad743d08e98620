"""StagePolicy: the one place that says what each stage keeps sharded and which collectives
it runs; options that do not apply to the chosen stage are errors naming the option."""

import pytest
from torch import nn

import flatshard
from flatshard.planner.stage import STAGES, StagePolicy, UnitOptions


def test_the_table_of_the_note():
    rows = {
        s: (p.shards_optimizer, p.shards_grads, p.shards_params, p.reduction, p.gathers_buckets_after_step)
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
        ("backward_prefetch", "later"),
        ("backward_prefetch", None),
        ("forward_prefetch", 2),
        ("limit_all_gathers", 0),
        ("reshard_after_forward", False),
        ("units", [3]),
        ("device", "cpu"),
        ("param_init_fn", print),
    ],
)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_options_below_stage_3_are_refused_naming_them(stage, option, value):
    """They used to be accepted silently (stage=2, backward_prefetch="later", units=[3])."""
    with pytest.raises(ValueError, match=rf"^{option}=.* applies to stage 3 only .* got stage {stage}"):
        flatshard.shard(nn.Linear(2, 2), stage=stage, **{option: value})


def test_defaults_passed_explicitly_are_fine_at_every_stage():
    for stage in STAGES:
        flatshard.shard(
            nn.Linear(2, 2), stage=stage, backward_prefetch="pre", units=None, limit_all_gathers=2
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backward_prefetch": "later"}, "backward_prefetch must be one of"),
        ({"forward_prefetch": -1}, "forward_prefetch must be an int >= 0, got -1"),
        ({"limit_all_gathers": 1.5}, "limit_all_gathers must be an int >= 1, got 1.5"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward must be a bool, got 'yes'"),
    ],
)
def test_unit_options_are_checked_once_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UnitOptions(**kwargs)
    with pytest.raises(ValueError, match=message):
        flatshard.Stage3(**kwargs)


@pytest.mark.parametrize("stage", [4, -1, True, "2", 2.0])
def test_a_stage_that_is_not_0_to_3_is_refused(stage):
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3, got"):
        StagePolicy(stage)


def test_stage3_options_are_one_validated_policy_and_the_old_keywords_still_work():
    """``shard(stage=3, stage3=flatshard.Stage3(...))``; the former keywords warn, naming the
    new spelling, and build the same policy; giving both, or ``stage3`` below stage 3, is an
    error naming it."""
    new = flatshard.shard(
        nn.Linear(2, 2), stage=3, stage3=flatshard.Stage3(unit_bytes=None, forward_prefetch=0)
    )
    with pytest.warns(
        DeprecationWarning, match=r"pass stage3=flatshard\.Stage3\(unit_bytes=\.\.\., forward_"
    ):
        old = flatshard.shard(nn.Linear(2, 2), stage=3, unit_bytes=None, forward_prefetch=0)
    assert new.flatshard_state.policy == old.flatshard_state.policy
    assert new.flatshard_state.policy.unit_options.forward_prefetch == 0
    with pytest.raises(TypeError, match="in stage3= only"):
        flatshard.shard(nn.Linear(2, 2), stage=3, stage3=flatshard.Stage3(), unit_bytes=None)
    with pytest.raises(
        ValueError, match=r"^stage3=Stage3\(unit_bytes=None\) applies to stage 3 only .* got stage 2"
    ):
        flatshard.shard(nn.Linear(2, 2), stage=2, stage3=flatshard.Stage3(unit_bytes=None))
    with pytest.raises(TypeError, match="unexpected keyword argument 'unit_byte'"):
        flatshard.shard(nn.Linear(2, 2), stage=3, unit_byte=None)
    with pytest.raises(ValueError, match="limit_all_gathers must be an int >= 1, got 0"):
        flatshard.Stage3(limit_all_gathers=0)


def test_bucket_options_are_one_validated_policy_and_the_old_keywords_still_work():
    """``shard(buckets=flatshard.Buckets(...))``: the former keywords warn, naming the new
    spelling, and lay out the same buckets; giving both is an error; a bad value is refused
    naming it; ``shard()`` keeps 12 keywords."""
    import inspect

    def layout(model):
        return [
            (b.layout.numel, len(b.layout.buckets))
            for s in model.flatshard_state.sets.values()
            for b in s.buffers
        ]

    new = flatshard.shard(nn.Linear(64, 64), buckets=flatshard.Buckets(size=50, per_group=None))
    with pytest.warns(
        DeprecationWarning, match=r"pass buckets=flatshard\.Buckets\(size=\.\.\., per_group=\.\.\.\)"
    ):
        old = flatshard.shard(nn.Linear(64, 64), bucket_size=50, buckets_per_group=None)
    assert layout(new) == layout(old) and layout(new)[0][1] == 2  # (the bias, 64 elements, then the weight)
    assert len(new.flatshard_state.grad_sync.groups) == len(old.flatshard_state.grad_sync.groups) == 1
    with pytest.raises(TypeError, match="in buckets= only"):
        flatshard.shard(nn.Linear(2, 2), buckets=flatshard.Buckets(), bucket_size=10)
    with pytest.raises(TypeError, match=r"buckets must be a flatshard\.Buckets, got int"):
        flatshard.shard(nn.Linear(2, 2), buckets=1000)
    with pytest.raises(
        ValueError, match=r"Buckets.size\) must be a positive number of elements or None, got 0"
    ):
        flatshard.Buckets(size=0)
    with pytest.raises(TypeError, match="pad_for_high_busbw must be True or False, got 'no'"):
        flatshard.Buckets(pad_for_high_busbw="no")
    keywords = [p for p in inspect.signature(flatshard.shard).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) == 12, [p.name for p in keywords]
