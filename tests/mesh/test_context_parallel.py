"""flatshard as the data-parallel dimension of a context-parallel model: with grads reduced
over the flattened ``dp x cp`` mesh dimension (Megatron's ``with_context_parallel``), CP2 x DP2
follows the whole model in one process at every stage."""

from __future__ import annotations

import pytest

from _context_parallel import reference, train_cp_dp
from flatshard.toolkit.ranks import RankError
from flatshard.toolkit.testing import run_distributed

# fp32: each attention row's softmax over gathered keys, and each grad summed over 2 dp and
# 2 cp ranks, in another order than one process's: a few ulps (eps = 1.2e-7) per op, over 3
# SGD steps with momentum 0.9 (at most 2.7 steps' worth of each step's relative error), as in
# the tensor-parallel tests: 1e-5 relative leaves ~10x room. Grads left unreduced over cp
# (the group without cp) are off by 1e-2 or more after one step.
RELATIVE = 1e-5
STEPS, BATCH = 3, 4


def _worst(result: dict, expected: dict) -> dict[str, float]:
    rel = {
        key: max(abs(a - b) / b for a, b in zip(result[key], expected[key], strict=True))
        for key in ("loss", "norm")
    }
    rel["params"] = max(
        ((v - expected["params"][n]).abs().max() / expected["params"][n].abs().max()).item()
        for n, v in result["params"].items()
    )
    return rel


def test_context_parallel_follows_one_process_at_every_stage():
    """Losses (the mean of every rank's token mean), grad norms (the optimizer's and torch's
    clip_grad_norm_ over ShardedGrads) and every param after 3 clipped SGD steps, at stages
    0-3."""
    expected = reference(STEPS, BATCH)
    assert min(expected["norm"]) > 1.0, "clipping must scale the grads for the norm to matter"
    results = run_distributed(train_cp_dp, 4, [0, 1, 2, 3], timeout=300)
    for rank, by_stage in enumerate(results):
        for stage, r in by_stage.items():
            worst = _worst(r, expected)
            assert max(worst.values()) < RELATIVE, (rank, stage, worst)


def test_sharding_a_context_parallel_model_over_dp_alone_is_refused():
    """With cp left out of flatshard's group, each cp rank's params would drift from the
    others' (off by 1e-2 after one step, measured before this check), with no error: the
    toolkit's context-parallel model refuses it at its first forward, on every rank."""
    with pytest.raises(RankError, match=r"context-parallel over the ranks \[\d, \d\].*_flatten\(\)") as info:
        run_distributed(train_cp_dp, 4, [1], cp_in_group=False, timeout=300)
    assert "failed too" in str(info.value)
