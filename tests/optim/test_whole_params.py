"""Muon and other rules that need whole params, through ``DistributedOptimizer``
([Note: whole-param buckets] in layout.py, [Note: elementwise optimizers] in optim/inner.py).

The reference is torch DDP with the same torch optimizers: ``torch.optim.Muon`` on the
blocks' matrices and ``AdamW`` on the rest, on the same global batch (at one rank, a
single process). Tolerances are [Note: parity tolerances] in tests/_parity.py: at 1-2 ranks
the grads are the same sums as DDP's, and params match to 1e-5; at 3-4 ranks the sums run
in another order (grads agree to ~1e-7), which Adam turns into differences of order lr for
near-cancelling grads. Muon rounds each grad to bf16 for its Newton-Schulz iteration (as
torch runs it): a grad element on the other side of a rounding boundary changes that
step's update by one bf16 ulp (the first step differs by 6e-5), and on this small model
the difference grows about fivefold per step (2e-2 after four steps with AdamW on the rest,
7.5e-3 with SGD), and the losses of the next step follow by at most their first-order
bound (``first_order_loss_bounds``: on another CPU's kernels a loss differed by 1.2e-5 after
such a drift). So Muon at 3-4 ranks is held to 5e-2, far below what stepping fragments
costs (0.1 after one step); and the machinery itself is held to 1e-5 at 3-4 ranks by a
whole-tensor rule in fp32 (a normalised SGD), whose trajectory has no such amplifier.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import (
    CFG,
    NormalizedSGD,
    TiedGPT,
    accumulate,
    check_parity,
    first_order_loss_bounds,
    full_params,
    is_matrix,
    max_abs_diff,
    max_rel_diff,
)
from flatshard import DistributedOptimizer
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's params, AdamW's params) of a model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for n, p in named if is_matrix(n, p)], [p for n, p in named if not is_matrix(n, p)]


def train_muon_side_by_side(
    shard_kwargs: dict,
    matrices=(torch.optim.Muon, MUON),
    others=(torch.optim.AdamW, ADAMW),
    steps: int = 4,
    accum: int = 2,
    batch: int = 4,
) -> dict:
    """DDP + (Muon, AdamW) and flatshard + one DistributedOptimizer with a Muon group and an
    AdamW group (or other classes: ``matrices`` and ``others`` are (class, hyperparameters)),
    on the same data; loss and param differences at every step."""
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    (mat_class, mat_hyper), (other_class, other_hyper) = matrices, others
    mats, rest = split(reference.module)
    ref_opts = [mat_class(mats, **mat_hyper), other_class(rest, **other_hyper)]
    mats, rest = split(model)
    ours = flatshard.shard(model, whole_params=is_matrix, **shard_kwargs)
    opt = DistributedOptimizer(
        ours,
        other_class,
        params=[{"params": mats, "optimizer_class": mat_class, **mat_hyper}, {"params": rest}],
        **other_hyper,
    )
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    out = {"loss_diffs": [], "param_diffs": [], "norm_diffs": [], "loss_bounds": []}
    for step in range(steps):
        drift = max_abs_diff(ours, reference.module)
        out["loss_bounds"] += first_order_loss_bounds(reference.module, corpus, step, accum, batch, drift)
        for loss, loss_ref in accumulate(reference, ours, corpus, step, accum, batch):
            out["loss_diffs"].append(abs(loss - loss_ref) / abs(loss_ref))
        for o in [*ref_opts, opt]:
            o.step()
            o.zero_grad()
        ref_params = list(reference.module.parameters())
        diffs = [max_rel_diff(p, q) for p, q in zip(full_params(ours), ref_params, strict=True)]
        out["param_diffs"].append(max(diffs))
    torch.manual_seed(0)
    start = TiedGPT()  # how far training moved the params: parity is not two models standing still
    out["moved"] = max(max_rel_diff(p, q) for p, q in zip(start.parameters(), ref_params, strict=True))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_and_adamw_follow_ddp(stage, world_size):
    (result, *_) = run_distributed(
        train_muon_side_by_side, world_size, {"stage": stage, "buckets": flatshard.Buckets(size=3000)}
    )
    check_parity(result, params=1e-5 if world_size <= 2 else 5e-2)
    assert result["moved"] > 0.05


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_whole_tensor_rule_in_fp32_follows_ddp_exactly_at_3_and_4_ranks(stage, world_size):
    (result, *_) = run_distributed(
        train_muon_side_by_side,
        world_size,
        {"stage": stage, "buckets": flatshard.Buckets(size=3000)},
        matrices=(NormalizedSGD, {"lr": 0.01}),
        others=(torch.optim.SGD, {"lr": 0.01}),
    )
    check_parity(result, params=1e-5)
    assert result["moved"] > 0.05


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_whole_param_buckets_reduced_as_one_group_follow_ddp_exactly(stage):
    """Every bucket of a buffer in one group: the uneven shards of the whole-param buckets
    and the flat buckets' equal ones go into one all-to-all at 4 ranks."""
    (result, *_) = run_distributed(
        train_muon_side_by_side,
        4,
        {"stage": stage, "buckets": flatshard.Buckets(size=3000, per_launch=None)},
        matrices=(NormalizedSGD, {"lr": 0.01}),
        others=(torch.optim.SGD, {"lr": 0.01}),
    )
    check_parity(result, params=1e-5)
    assert result["moved"] > 0.05


def _whole_rule_on_a_mesh(stage: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return train_muon_side_by_side(
        {"stage": stage, "group": mesh, "buckets": flatshard.Buckets(size=3000)},
        matrices=(NormalizedSGD, {"lr": 0.01}),
        others=(torch.optim.SGD, {"lr": 0.01}),
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_whole_param_buckets_under_replicated_sharding_follow_ddp_exactly(stage):
    """2 replicas x 2 shards: the uneven shards (some empty) are all-reduced across the
    replicas as they are."""
    (result, *_) = run_distributed(_whole_rule_on_a_mesh, 4, stage)
    check_parity(result, params=1e-5)
    assert result["moved"] > 0.05


@pytest.mark.parametrize("stage", [2, 3])
def test_adafactor_steps_whole_matrices_with_its_factored_state(stage):
    """torch's Adafactor keeps a row and a column moment per matrix: it needs the whole
    matrix, as Muon does, and follows DDP + Adafactor at 3 ranks."""
    (result, *_) = run_distributed(
        train_muon_side_by_side,
        3,
        {"stage": stage, "buckets": flatshard.Buckets(size=3000)},
        matrices=(torch.optim.Adafactor, {"lr": 0.01}),
        others=(torch.optim.SGD, {"lr": 0.01}),
    )
    check_parity(result, params=1e-5)
    assert result["moved"] > 0.05


def _refusals() -> list[str]:
    """What a user meets at 2 ranks without ``whole_params``: a clear refusal, not fragments."""
    messages = []
    for cls, hyper in [(torch.optim.Muon, MUON), (NormalizedSGD, {"lr": 0.01})]:
        model = flatshard.shard(TiedGPT(), stage=2, buckets=flatshard.Buckets(size=3000))
        mats, rest = split(model)
        groups = [{"params": mats, "optimizer_class": cls, **hyper}, {"params": rest}]
        try:
            DistributedOptimizer(model, torch.optim.AdamW, params=groups, **ADAMW)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_a_whole_tensor_rule_over_a_layout_that_cuts_its_params_is_refused():
    for messages in run_distributed(_refusals, 2):
        assert len(messages) == 2
        for message, name in zip(messages, ["Muon", "NormalizedSGD"], strict=True):
            assert f"{name} (param group 0) is not known to be elementwise" in message
            assert "2-rank layout cuts 'blocks." in message
            assert "whole_params=" in message
