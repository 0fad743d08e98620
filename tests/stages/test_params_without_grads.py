"""Params without a grad in a step keep their values and optimizer state, as torch's
optimizers skip a param whose ``.grad`` is None ([Note: params without a grad] in
optim/held.py): params frozen for good mid-run, and grads cleared through a module that holds
the sharded one (torch.compile's wrapper, a user's module), whose ``zero_grad`` never reaches
flatshard's.

Tolerances ([Note: parity tolerances] in _parity.py): AdamW (eps 1e-3, below) over 5 fp32
steps follows DDP to 1e-5 relative (grads differ by fp32 reassociation, ~1e-7 relative, and
an update moves by lr * that / eps); a frozen param is compared with ``torch.equal``: it must not move at all.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT, drift_from, step_both
from flatshard.errors import ShardedGradError
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
# eps well above the grads' rounding noise: Adam divides by sqrt(v) + eps, so an element whose
# grad is ~1e-9 (zero up to the reduction order) would otherwise take an lr-sized step of
# either sign; with eps = 1e-3 a grad difference d moves the update by lr * d / eps
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}


def _frozen_names(model: nn.Module) -> list[str]:
    """Block 0's trainable params (TiedGPT's blocks.0.ln1.weight is frozen from the start)."""
    return [
        n for n, _ in model.named_parameters() if n.startswith("blocks.0.") and n != "blocks.0.ln1.weight"
    ]


def _freeze_for_good(stage: int, precision: str, steps: int = 5, freeze_at: int = 2) -> dict:
    """Train, freeze block 0 for good after ``freeze_at`` steps (its grads None from then on:
    DDP's optimizer skips it), train on."""
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    mp = flatshard.MixedPrecision(torch.bfloat16) if precision == "bf16" else None
    ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000), mixed_precision=mp)
    opt = flatshard.DistributedOptimizer(ours, torch.optim.AdamW, **ADAMW)
    opt_ref = torch.optim.AdamW(reference.parameters(), **ADAMW)
    drift, still = [], []
    for step in range(steps):
        if step == freeze_at:
            for side in (ours, reference.module):
                for name, p in side.named_parameters():
                    if name in _frozen_names(side):
                        p.requires_grad_(False)
            with ours.summon_full_params(writeback=False):
                at_freeze = {
                    n: p.detach().clone() for n, p in ours.named_parameters() if n in _frozen_names(ours)
                }
        x, y = CORPUS.batch(step, dist.get_rank(), 4)
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            ours(x, y).backward()
            reference(x, y).backward()
        step_both(opt, opt_ref)
        drift.append(drift_from(ours, reference.module))
        if step >= freeze_at:
            with ours.summon_full_params(writeback=False):
                named = dict(ours.named_parameters())
                still.append(all(torch.equal(named[n], v) for n, v in at_freeze.items()))
    return {"drift": drift, "still": still}


@pytest.mark.parametrize("stage, world_size", [(0, 1), (1, 3), (2, 2), (3, 4), (3, 3)])
def test_params_frozen_for_good_mid_run_stop_moving(stage, world_size):
    """They moved 0.012 in 2 AdamW steps before (a frozen param's grad counted as zero)."""
    for result in run_distributed(_freeze_for_good, world_size, stage, "fp32", timeout=120):
        assert all(result["still"]), result
        assert max(result["drift"]) < 1e-5, result["drift"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_params_frozen_for_good_keep_their_bf16_main_params(stage):
    """With fp32 main params of bf16 params: the frozen params' main params are held too, so
    their bf16 values stay bit for bit (the bf16 model follows DDP only within bf16's
    rounding, so only that is asserted here)."""
    for result in run_distributed(_freeze_for_good, 2, stage, "bf16", timeout=120):
        assert all(result["still"]), result


def _toggled_adamw(stage: int, own_group: bool) -> dict:
    """Block 0 frozen for step 1 only, under AdamW: held in a run it shares (a warning when it
    steps again), or in a param group of its own (exact: its step count is held too)."""
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000))

    def groups(side: nn.Module):
        if not own_group:
            return [{"params": [p for p in side.parameters() if p.requires_grad]}]
        frozen = _frozen_names(side)
        named = [(n, p) for n, p in side.named_parameters() if p.requires_grad]
        return [
            {"params": [p for n, p in named if n in frozen]},
            {"params": [p for n, p in named if n not in frozen]},
        ]

    opt = flatshard.DistributedOptimizer(ours, torch.optim.AdamW, params=groups(ours), **ADAMW)
    opt_ref = torch.optim.AdamW(groups(reference.module), **ADAMW)
    drift, warned = [], []
    for step in range(4):
        for side in (ours, reference.module):
            for name, p in side.named_parameters():
                if name in _frozen_names(side):
                    p.requires_grad_(step != 1)
        x, y = CORPUS.batch(step, dist.get_rank(), 4)
        ours(x, y).backward()
        reference(x, y).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        warned.append(any("step again after steps without a grad" in str(w.message) for w in caught))
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        drift.append(drift_from(ours, reference.module))
    return {"drift": drift, "warned": warned}


@pytest.mark.parametrize("stage", [1, 3])
def test_toggled_params_in_their_own_group_follow_ddp_exactly(stage):
    for result in run_distributed(_toggled_adamw, 2, stage, True, timeout=120):
        assert max(result["drift"]) < 1e-5, result["drift"]
        assert not any(result["warned"]), result


def test_toggled_params_sharing_a_run_are_named_when_they_step_again():
    """Their moments are held, their run's step count is not: the step they resume in says so
    (on the ranks whose shards hold such a shared run)."""
    results = run_distributed(_toggled_adamw, 2, 2, False, timeout=120)
    assert [any(r["warned"][i] for r in results) for i in range(4)] == [False, False, True, False], results
    for result in results:
        assert result["drift"][1] < 1e-5, result["drift"]  # (the frozen step itself is exact)


class Holder(nn.Module):
    """A user's module around the sharded model (its zero_grad is nn.Module's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y)


def _cleared_through(stage: int, wrapper: str) -> dict:
    """Grads cleared only by the wrapper's ``zero_grad()`` (nn.Module's: every ``.grad`` set to
    None), as the HF Trainer clears them through torch.compile's wrapper. A step with no backward
    since is a no-op, as in torch."""
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    ours = flatshard.shard(model, stage=stage)
    opt = flatshard.DistributedOptimizer(ours, torch.optim.AdamW, **ADAMW)
    opt_ref = torch.optim.AdamW(reference.parameters(), **ADAMW)
    outer = torch.compile(ours, backend="eager") if wrapper == "compile" else Holder(ours)
    drift = []
    for step in range(4):
        x, y = CORPUS.batch(step, dist.get_rank(), 4)
        outer(x, y).backward()
        reference(x, y).backward()
        opt.step()
        opt_ref.step()
        outer.zero_grad()
        reference.zero_grad()
        if step == 1:  # (no backward: nothing to step)
            opt.step()
            opt_ref.step()
        drift.append(drift_from(ours, reference.module))
    return {"drift": drift}


@pytest.mark.parametrize("stage, wrapper", [(0, "module"), (1, "compile"), (2, "module"), (3, "module")])
def test_grads_cleared_through_a_wrapper_are_cleared(stage, wrapper):
    """Before, the wrapper's zero_grad left flatshard's sums: the next backward added to them."""
    for result in run_distributed(_cleared_through, 3 if stage == 3 else 2, stage, wrapper, timeout=180):
        assert max(result["drift"]) < 1e-5, result["drift"]


def _dropped_one(stage: int) -> str:
    model = flatshard.shard(TiedGPT(), stage=stage)
    flatshard.DistributedOptimizer(model, torch.optim.AdamW, **ADAMW)
    x, y = CORPUS.batch(0, dist.get_rank(), 4)
    model(x, y).backward()
    model.blocks[1].zero_grad()  # (a part's grads only, then another backward)
    try:
        model(x, y)
    except ShardedGradError as e:
        return str(e)
    return "no error"


def test_grads_dropped_for_some_params_then_a_forward_is_refused_naming_them():
    for message in run_distributed(_dropped_one, 2, 2, timeout=120):
        assert "'blocks.1." in message and "zero_grad" in message, message


class WithSpareParams(TiedGPT):
    """A head no forward uses (a classifier kept beside an LM head) and a probe that only
    rank 0's first micro-batch of each step uses (control flow that differs by rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare_head = nn.Linear(CFG.d_model, 3)
        self.probe = nn.Linear(CFG.d_model, 1)
        self.use_probe = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        loss = super().forward(idx, targets)
        if self.use_probe:
            loss = loss + 1e-2 * self.probe(self.wte(idx)).square().mean()
        return loss


def _spare_params(stage: int) -> dict:
    """Two micro-batches a step (the first under no_sync), against DDP told to find unused
    params (the only DDP that trains this model at all)."""
    torch.manual_seed(0)
    model = WithSpareParams()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(
        model, stage=stage, buckets=flatshard.Buckets(size=3000), find_unused_parameters=stage == 3
    )
    opt = flatshard.DistributedOptimizer(ours, torch.optim.AdamW, **ADAMW)
    opt_ref = torch.optim.AdamW(reference.parameters(), **ADAMW)
    with ours.summon_full_params(writeback=False):
        spare = ours.spare_head.weight.detach().clone()
    drift, still = [], []
    for step in range(3):
        for micro in range(2):
            for side in (ours, reference.module):
                side.use_probe = dist.get_rank() == 0 and micro == 0
            x, y = CORPUS.batch(2 * step + micro, dist.get_rank(), 4)
            if micro == 0:
                with ours.no_sync(), reference.no_sync():
                    ours(x, y).backward()
                    reference(x, y).backward()
            else:
                ours(x, y).backward()
                reference(x, y).backward()
        step_both(opt, opt_ref)
        drift.append(drift_from(ours, reference.module))
        with ours.summon_full_params(writeback=False):
            still.append(torch.equal(ours.spare_head.weight, spare))
    return {"drift": drift, "still": still}


@pytest.mark.parametrize("stage, world_size", [(0, 1), (0, 2), (1, 3), (2, 2), (3, 3)])
def test_params_no_rank_used_are_skipped_as_ddp_skips_them(stage, world_size):
    """A param that got no grad on any rank keeps grad None, so AdamW's weight decay leaves
    it where it is (before, it stepped on a zero grad: 1e-3 a step); a param only one rank
    used has the reduced grad on every rank, as under DDP."""
    for result in run_distributed(_spare_params, world_size, stage, timeout=120):
        assert all(result["still"]), result
        assert max(result["drift"]) < 1e-5, result["drift"]
