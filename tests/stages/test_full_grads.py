"""``summon_full_params(with_grads=True)`` gives every trained param its full reduced grad in
``.grad`` at every stage ([Note: full params] in units/full_params.py), as torch DDP's
``p.grad``: at stages 1-2 only this rank's shard of the grad buffer holds reduced values,
so the block gathers them; before, ``with_grads`` below stage 3 left ``.grad`` as it was.

[Note: full-grad tolerance]

Both sides compute the same local grads (the same kernels on the same values and data; the
micro-batches accumulate in the same order), and differ only in how the N ranks' grads are
summed and scaled: DDP all-reduces with gloo's order and divides by N, flatshard multiplies
by 1/N before its reduce-scatter or all-reduce, summing bucket by bucket in its own order.
Summing N terms in any order is off by at most (N - 1) eps sum_r |g_r| (first order),
scaling each term by a rounded 1/N adds 2 eps |g_r| per term, so each side is within
(N + 1) eps sum_r |g_r| / N of the exact mean and the two within twice that, element by
element, with eps = 2**-23 (twice fp32's unit roundoff). ``sum_r |g_r|`` is measured: each
rank runs the same micro-batches through an unwrapped copy and the absolute grads are summed
over the ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT, accumulate
from flatshard import DistributedOptimizer
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

EPS = 2.0**-23
CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)


def _local_abs_sum(model: torch.nn.Module, step: int, accum: int, batch: int) -> list[torch.Tensor]:
    """sum over the ranks of |this rank's accumulated grad|, per trained param."""
    for micro in range(accum):
        x, y = CORPUS.batch(step * accum + micro, dist.get_rank(), batch)
        (model(x, y) / accum).backward()
    sums = []
    for p in (p for p in model.parameters() if p.requires_grad):
        total = p.grad.abs()
        dist.all_reduce(total)
        sums.append(total)
    model.zero_grad(set_to_none=True)
    return sums


def _worst_ratio(ours: torch.nn.Module, reference: DDP, abs_sums: list[torch.Tensor]) -> float:
    """max over elements of |ours - DDP| / bound ([Note: full-grad tolerance]): <= 1 passes."""
    n = dist.get_world_size()
    trained = [(p, q) for p, q in zip(ours.parameters(), reference.module.parameters(), strict=True)]
    trained = [(p, q) for p, q in trained if q.requires_grad]
    worst = 0.0
    with ours.summon_full_params(writeback=False, with_grads=True):
        for (p, q), total in zip(trained, abs_sums, strict=True):
            bound = 2 * (n + 1) * EPS * total / n
            diff = (p.grad.float() - q.grad).abs()
            if bool((diff[bound == 0] != 0).any()):
                return float("inf")
            worst = max(worst, float((diff / bound.clamp_min(torch.finfo(torch.float32).tiny)).max()))
    return worst


def _full_grads_case(stage: int, steps: int = 2, accum: int = 2, batch: int = 4) -> dict:
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    plain = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000))
    opt = DistributedOptimizer(ours, torch.optim.SGD, lr=0.1, momentum=0.9)
    out: dict = {"ratios": [], "outside": [], "zeros": []}
    for step in range(steps):
        abs_sums = _local_abs_sum(plain, step, accum, batch)
        list(accumulate(reference, ours, CORPUS, step, accum, batch))
        before = [p.grad for p in ours.parameters()]  # (stage 0: views of the grad buffer, as DDP's)
        out["ratios"].append(_worst_ratio(ours, reference, abs_sums))
        out["outside"].append(all(p.grad is g for p, g in zip(ours.parameters(), before, strict=True)))
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        # the next step starts all three from DDP's params: the grads then differ by the
        # reduction alone, not by a step's drift between the trajectories
        plain.load_state_dict(reference.module.state_dict())
        ours.load_state_dict(reference.module.state_dict())
        with ours.summon_full_params(writeback=False, with_grads=True):
            out["zeros"].append(all(not p.grad.any() for p in ours.parameters() if p.grad is not None))
            out["covered"] = {n for n, p in ours.named_parameters() if p.grad is not None}
    out["trained"] = {n for n, p in ours.named_parameters() if p.requires_grad}
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_summoned_grads_are_ddps_reduced_grads(stage, world_size):
    for result in run_distributed(_full_grads_case, world_size, stage):
        assert max(result["ratios"]) <= 1.0, result["ratios"]
        assert all(result["outside"])  # .grad is what it was again after the block
        assert all(result["zeros"])  # zeros after zero_grad, as the next backward starts from
        assert result["covered"] == result["trained"]


def _unreduced_case(stage: int) -> list[str]:
    torch.manual_seed(0)
    ours = flatshard.shard(TiedGPT(), stage=stage, buckets=flatshard.Buckets(size=3000))
    DistributedOptimizer(ours, torch.optim.SGD, lr=0.1)
    x, y = CORPUS.batch(0, dist.get_rank(), 4)
    with ours.no_sync():
        ours(x, y).backward()
    messages = []
    try:
        with ours.summon_full_params(writeback=False, with_grads=True):
            pass
    except RuntimeError as e:
        messages.append(str(e))
    with ours.summon_full_params(writeback=False):  # (without grads: fine)
        pass
    return messages


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grads_summed_under_no_sync_are_refused_not_shown_unreduced(stage):
    for messages in run_distributed(_unreduced_case, 2, stage):
        assert len(messages) == 1 and "not reduced yet" in messages[0]
