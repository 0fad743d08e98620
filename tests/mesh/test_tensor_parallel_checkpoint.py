"""A checkpoint of a tensor-parallel model keeps each param full ([Note: tensor-parallel
params] in ``engine/tensor_parallel.py``): saved at TP2 x DP2 it loads at TP1 x DP4 (the
plain model), TP2 x DP1 and in one process, and each continues the saving run's curve."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from _tensor_parallel import checkpoint_leg, gathered_state
from flatshard.checkpoint.weights import export_checkpoint
from flatshard.toolkit.testing import run_distributed

# fp32 and SGD with momentum, 2 steps after the load: the sums run in another order at each
# layout (tp's partial products, dp's all-reduce), a few ulps per op as in the TP parity test
# (RELATIVE there). A load that lost the momentum buffers, or put a tp shard's elements in
# the wrong places, is off by far more than 1e-5 from the first step on.
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The saving run: TP2 x DP2 at stage 1, saved after 2 steps, then 2 more."""
    path = str(tmp_path_factory.mktemp("tp") / "ckpt")
    return path, run_distributed(checkpoint_leg, 4, path, 2, 1, True, timeout=240)[0]


@pytest.mark.parametrize(
    ("world", "tp", "stage"),
    [(4, 0, 2), (2, 2, 0), (1, 0, 0), (4, 2, 3)],
    ids=["tp1xdp4", "tp2xdp1", "one-process", "tp2xdp2-stage3"],
)
def test_a_tensor_parallel_checkpoint_loads_at_another_layout_and_continues(saved, world, tp, stage):
    path, before = saved
    after = run_distributed(checkpoint_leg, world, path, tp, stage, False, timeout=240)[0]
    for name, value in before["params"].items():
        assert torch.equal(after["params"][name], value), name  # (loaded exactly, in full)
    for ours, theirs in zip(after["losses"], before["losses"], strict=True):
        assert abs(ours - theirs) / theirs < RELATIVE, (after["losses"], before["losses"])


def test_a_tensor_parallel_checkpoint_exports_whole_tensors(saved, tmp_path):
    path, before = saved
    out = tmp_path / "model.safetensors"
    export_checkpoint(path, str(out))
    exported = load_file(str(out))
    assert set(exported) == set(before["params"])
    for name, value in before["params"].items():
        assert torch.equal(exported[name], value), name


@pytest.mark.parametrize("stage, precision", [(1, "bf16"), (3, "bf16"), (3, "fp32")])
def test_full_state_dict_and_save_pretrained_of_a_tp_model_hold_whole_fp32_values(tmp_path, stage, precision):
    """Before, ``full_state_dict()`` gave DTensors (fp32) or failed viewing a tp shard's
    main params in the full param's shape (bf16), and at stage 3 in fp32 gave rank 0's own tp
    shard (a (32, 32) local of a (64, 32) weight). Now every entry is a plain tensor of the
    full shape, a trained param's is its fp32 main params gathered over tp (which round to
    the bf16 param exactly) or its fp32 values, and ``save_pretrained`` writes what
    ``from_pretrained`` reads."""
    r = run_distributed(gathered_state, 2, str(tmp_path / "pretrained"), stage, precision, timeout=240)[0]
    assert r["rounds"] and all(r["rounds"].values()), r["rounds"]
    for name, value in r["state"].items():
        assert type(value) is torch.Tensor, name
    for name in r["rounds"]:
        assert r["state"][name].dtype == torch.float32, name
    for name, value in r["read"].items():
        assert torch.equal(value, r["state"][name].to(value.dtype)), name
