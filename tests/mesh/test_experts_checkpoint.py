"""Checkpoints of an expert-parallel model ([Note: expert parallelism] in
``src/flatshard/wrap/plan.py``): each expert param is saved whole (the ep ranks' shares
stacked along dim 0), so a checkpoint written at one layout loads at another, or in one
process, and continues the curve; ``export_checkpoint`` writes the whole model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from _experts import checkpoint_leg
from flatshard.checkpoint.weights import export_checkpoint
from flatshard.toolkit.testing import run_distributed

# fp32 and SGD with momentum, 2 steps after the load: the sums run in another order at each
# layout (tp's partial products, the all-to-all's regrouping, dp's all-reduce), a few ulps
# per op as in the expert parity test (RELATIVE there). A load that put one rank's experts
# in another's place, or lost the momentum buffers, is off by far more from the first step.
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The saving run: EP2 x EDP2 (dense over 4 ranks) at stage 1, saved after 2 steps, then 2 more."""
    path = str(tmp_path_factory.mktemp("ep") / "ckpt")
    return path, run_distributed(checkpoint_leg, 4, path, "ep2xedp2", 1, True, timeout=240)[0]


@pytest.mark.parametrize(
    ("world", "layout", "stage"),
    [(4, "ep4", 2), (4, "tp2xdp2-ep-on-dp", 3), (1, None, 0)],
    ids=["ep4", "tp2xdp2-stage3", "one-process"],
)
def test_an_expert_parallel_checkpoint_loads_at_another_layout_and_continues(saved, world, layout, stage):
    path, before = saved
    after = run_distributed(checkpoint_leg, world, path, layout, stage, False, timeout=240)[0]
    for name, value in before["params"].items():
        assert torch.equal(after["params"][name], value), name  # (loaded exactly, in full)
    for ours, theirs in zip(after["losses"], before["losses"], strict=True):
        assert abs(ours - theirs) / theirs < RELATIVE, (after["losses"], before["losses"])


def test_an_expert_parallel_checkpoint_exports_whole_experts(saved, tmp_path):
    path, before = saved
    out = tmp_path / "model.safetensors"
    export_checkpoint(path, str(out))
    exported = load_file(str(out))
    assert set(exported) == set(before["params"])
    assert exported["layers.0.feed_forward.experts.w1"].shape[0] == 4  # (every expert, not a share)
    for name, value in before["params"].items():
        assert torch.equal(exported[name], value), name
