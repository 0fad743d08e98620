"""Expert parallelism with flatshard ([Note: expert parallelism] in
``src/flatshard/wrap/plan.py``): a mixture-of-experts Llama whose experts are spread over an
expert-parallel group, alone or folded into TP x DP, follows the same model in one process
at stages 0-3; a wrong scale leaves the curve; experts spread over tp without their group
named are refused."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flatshard
from _experts import LAYOUTS, train_experts
from _tensor_parallel import batches
from flatshard.toolkit.models.llama import Llama, LlamaConfig
from flatshard.toolkit.models.moe import expert_parallel, is_expert
from flatshard.toolkit.ranks import RankError
from flatshard.toolkit.testing import run_distributed

# fp32 throughout. The one-process reference sums each matmul, the batch mean and the tokens
# an expert runs in another order than tp's partial products, the all-to-all's regrouping
# and dp's all-reduce: a few ulps (eps = 1.2e-7) per op, over 3 SGD steps whose momentum
# adds at most (1 + 0.9 + 0.81) = 2.7 updates' worth of each step's relative error. 1e-5
# relative leaves ~10x room over that, as the tensor-parallel tests' bound
# (tests/mesh/test_tensor_parallel.py); the routing is dropless, so no token changes expert
# between the runs unless two router scores tie within rounding (the measured differences
# are <= 2e-7, so none did). An expert grad scaled 1 / edp instead of 1 / dp is off by 2x.
RELATIVE = 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_follows_one_process_at_every_stage(layout):
    """Losses, grad norms (torch's clip_grad_norm_ over ShardedGrads on even steps, the
    optimizer's on odd ones: each expert counted once over edp x ep) and every param (the
    experts gathered over ep) after 3 clipped SGD steps with momentum, at stages 0-3: experts
    over ep 2 x edp 2 with the dense params over all 4 ranks (DeepSpeed-MoE's layout), and in
    a TP2 x DP2 model with sequence parallelism the experts spread over tp (copies over dp)
    or over dp (copies over tp: the expert-data-parallel group is the tp one)."""
    results = run_distributed(train_experts, 4, layout, [0, 1, 2, 3], timeout=300)
    for stage, r in results[0].items():
        assert r["ref_norm"] > 0.5, "clipping must scale the grads for the norm to matter"
        assert max(r["loss"]) < RELATIVE, (stage, r["loss"])
        assert max(r["norm"]) < RELATIVE, (stage, r["norm"])
        worst = max(r["params"], key=r["params"].get)
        assert r["params"][worst] < RELATIVE, (stage, worst, r["params"][worst])
        assert any(is_expert(n, None) for n in r["params"])  # (the experts were compared)
    assert all(r == results[0] for r in results[1:])  # (every rank measured the same)


def test_compiled_expert_parallelism_follows_one_process():
    """The same at stage 3, EP2 x EDP2, with the model's forward through ``torch.compile``
    (the toolkit's ``MoE`` layers run eagerly inside it: routing sizes change every step,
    and each would recompile: 81 s cold instead of 35). Backend ``aot_eager``: [Note: compile
    backends in the suite] in conftest.py."""
    (r, *_) = run_distributed(train_experts, 4, "ep2xedp2", [3], compile="aot_eager", timeout=600)
    for key in ("loss", "norm"):
        assert max(r[3][key]) < RELATIVE, (key, r[3][key])
    assert max(r[3]["params"].values()) < RELATIVE


def test_experts_scaled_by_their_own_group_leave_the_curve():
    """The sensitivity of the parity above: expert grads scaled 1 / edp (flatshard's default
    before, dp / edp = 2x the mean over dp that DDP trains on) leave the one-process curve."""
    (r, *_) = run_distributed(train_experts, 4, "ep2xedp2", [1], expert_scale=0.5, timeout=300)
    assert max(r[1]["norm"]) > 100 * RELATIVE
    assert max(r[1]["params"].values()) > 100 * RELATIVE


def test_experts_spread_over_tp_without_their_group_are_refused():
    """Experts that differ between the tp ranks (spread over tp) with no ``ep`` given would
    clip each tp rank by its own norm: the norm's sum over tp finds them unlike and raises
    on every rank, naming tp and ``Experts(ep=...)``."""
    with pytest.raises(RankError, match=r"differ between the tp ranks.*Experts\(group, match, ep=") as info:
        run_distributed(train_experts, 4, "tp2xdp2-ep-on-tp", [1], name_ep=False, timeout=300)
    assert "failed too" in str(info.value)  # (every rank raised, none hung)


def _ep_sharing_the_expert_group() -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    experts = flatshard.Experts(mesh["dp"], is_expert, ep=mesh["dp"])
    try:
        flatshard.shard(Llama(LlamaConfig(n_experts=4)), expert=experts)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_an_expert_parallel_group_sharing_ranks_with_the_expert_group_is_refused():
    for message in run_distributed(_ep_sharing_the_expert_group, 2, timeout=60):
        assert "share ranks [0, 1]" in message and "ep" in message


def test_experts_spread_without_telling_flatshard_are_refused():
    """Experts spread by ``expert_parallel`` but sharded as dense params would be averaged
    with other ranks' experts: the model's first forward refuses it on every rank."""
    with pytest.raises(RankError, match=r"would average different experts.*Experts\(edp_group") as info:
        run_distributed(_experts_not_told, 4, timeout=60)
    assert "failed too" in str(info.value)


def _experts_not_told() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(0)
    model = expert_parallel(Llama(LlamaConfig(n_experts=4)), mesh["ep"].get_group())
    model = flatshard.shard(model, stage=1)
    (idx, targets), *_ = batches(1, 2)
    model(idx, targets)


def _whole_values_refused(path: str) -> list[str]:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    messages = []
    for ep in (mesh["ep"], None):
        torch.manual_seed(0)
        model = expert_parallel(Llama(LlamaConfig(n_experts=4)), mesh["ep"].get_group())
        model = flatshard.shard(model, expert=flatshard.Experts(mesh["edp"], is_expert, ep=ep))
        try:
            model.full_state_dict() if ep is not None else flatshard.save_checkpoint(path, model)
        except NotImplementedError as e:
            messages.append(str(e))
    return messages


def test_whole_values_an_expert_parallel_model_cannot_give_are_refused(tmp_path):
    """``full_state_dict()`` would give rank 0's experts only: refused, naming the checkpoint
    and export that give them all; a checkpoint needs the ep group to stack the shares."""
    for full, save in run_distributed(_whole_values_refused, 2, str(tmp_path / "ckpt"), timeout=60):
        assert "each rank holds only its own experts" in full and "export_checkpoint" in full
        assert "no expert-parallel group" in save and "ep=" in save
    assert not (tmp_path / "ckpt").exists()
