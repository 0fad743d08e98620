"""Grads that hold inf or NaN: loss scaling's skipped steps and back-off, and a NaN in one
rank's grad shard reaching every norm and clip as under DDP."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT, full_params
from flatshard import DistributedOptimizer, DynamicLossScaler
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# -- loss scaling and overflow ------------------------------------------------------------------
def _overflow_case(inject_on_rank: int | None, dtype: torch.dtype, initial_scale: float) -> list[dict]:
    torch.manual_seed(0)
    ours = flatshard.shard(TiedGPT().to(dtype), stage=2, buckets=flatshard.Buckets(size=3000))
    scaler = DynamicLossScaler(initial_scale, backoff_factor=2.0**-4, growth_interval=3)
    loss_scale = scaler if dtype == torch.float16 else None
    opt = DistributedOptimizer(ours, torch.optim.AdamW, lr=1e-2, loss_scale=loss_scale, nonfinite="skip")
    rows = []
    for step in range(10):
        x, y = CORPUS.batch(step, _rank(), 4)
        loss = ours(x, y)
        if step in (1, 2) and _rank() == inject_on_rank:
            loss = loss * float("nan")
        opt.scale_loss(loss).backward()
        before = [p.detach().clone() for p in ours.parameters()]
        opt.step()
        opt.zero_grad()
        ours.wait_for_params()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, ours.parameters(), strict=True))
        rows.append(
            {
                "skipped": opt.last_step_skipped,
                "unchanged": unchanged,
                "scale": opt.loss_scale,
                "loss": loss.item(),
            }
        )
    return rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(dtype):
    results = run_distributed(_overflow_case, 3, 1, dtype, 2.0**8)
    for rows in results:
        assert [r["skipped"] for r in rows] == [False, True, True] + [False] * 7
        assert all(r["unchanged"] == r["skipped"] for r in rows)
    if dtype == torch.float16:  # backed off twice, then grew after 3 good steps, twice
        assert [r["scale"] for r in results[0]] == [2**8, 2**4, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0]


class _NaNInGrad(torch.autograd.Function):
    """The identity, whose backward puts a NaN in element 5 of its input's grad (one element
    of one param: it lands in one rank's grad shard)."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[5] = float("nan")
        return grad


class _OneNaN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return (self.a(x).sum(-1, keepdim=True) * _NaNInGrad.apply(self.w)).square().mean()


def _one_nan_case(stage: int) -> dict:
    torch.manual_seed(0)
    model = _OneNaN()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(_rank()))
    out = {}
    for name, net in (("ddp", DDP(copy.deepcopy(model))), ("ours", flatshard.shard(model, stage=stage))):
        opt = (
            torch.optim.AdamW(net.parameters(), lr=0.1)
            if name == "ddp"
            else DistributedOptimizer(net, torch.optim.AdamW, lr=0.1, nonfinite="step")
        )
        net(x).backward()
        try:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, norm_type=math.inf, error_if_nonfinite=True)
            raised = False
        except RuntimeError:
            raised = True
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, norm_type=math.inf)
        opt.zero_grad()
        net(x).backward()  # (again, clipped by the optimizer's 2-norm and stepped anyway)
        clip = torch.nn.utils.clip_grad_norm_ if name == "ddp" else None
        norm2 = clip(net.parameters(), 1.0) if clip is not None else opt.clip_grad_norm_(1.0)
        opt.step()
        if name == "ddp":
            params = {k: v.detach() for k, v in net.module.named_parameters()}
        else:
            params = dict(zip([k for k, _ in net.named_parameters()], full_params(net), strict=True))
        out[name] = {
            "raised": raised,
            "inf_norm_nan": bool(norm.isnan()),
            "norm_nan": bool(norm2.isnan()),
            "nan_params": sorted(k for k, v in params.items() if v.isnan().any()),
        }
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_one_nan_in_one_ranks_grad_shard_reaches_every_norm_as_in_ddp(stage):
    """A NaN in one element of one grad sits in one rank's shard. The inf-norm's max over ranks
    dropped it (gloo's MAX keeps a NaN only as its local operand, NCCL's never): torch's
    clip_grad_norm_ returned a finite norm on some ranks and did not raise where DDP does. And
    a step taken anyway (``nonfinite="step"``) clipped by 1 where torch clips by NaN, leaving
    every other param finite where DDP's are all NaN."""
    for result in run_distributed(_one_nan_case, 2, stage):
        assert result["ours"] == result["ddp"], result
        assert result["ddp"]["raised"] and result["ddp"]["inf_norm_nan"] and result["ddp"]["norm_nan"]
        assert result["ddp"]["nan_params"] == ["a.bias", "a.weight", "w"]


def test_fp16_dynamic_scale_backs_off_from_overflow_and_training_recovers():
    (rows, _) = run_distributed(_overflow_case, 2, None, torch.float16, 2.0**40)
    skipped = [r["skipped"] for r in rows]
    assert skipped[0], "a scale of 2**40 must overflow fp16 grads"
    first_good = skipped.index(False)
    assert not any(skipped[first_good:]), skipped
    assert rows[first_good]["scale"] < 2.0**40
    assert rows[-1]["loss"] < rows[first_good]["loss"], rows
