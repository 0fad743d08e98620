"""HybridDeviceOptimizer: the same trajectory as the plain torch optimizer at every offload
fraction, alone and as DistributedOptimizer's inner optimizer at stages 1-3 and world sizes
1-4; one source of truth for hyperparameters and state; exact resume from its state dict.

Without an accelerator the host and the device are the same CPU, so these runs exercise
the split, the copies, the per-param sub-optimizers and the state plumbing, but not the
streams (see the GPU notes in the README)."""

import copy
import io

import pytest
import torch

import flatshard
from _parity import (
    CFG,
    SGD,
    AwkwardGPT,
    check_parity,
    decay_groups,
    full_params,
    train_optimizer_side_by_side,
)
from flatshard import DistributedOptimizer, HybridDeviceOptimizer
from flatshard.planner.offload import offloaded_items as _offloaded
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def _train(model, opt, steps: range, sched=None) -> list[float]:
    losses = []
    for step in steps:
        x, y = CORPUS.batch(step, 0, 4)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _hybrid(model, fraction: float, cls=torch.optim.AdamW, overlap: bool = True, **kwargs):
    return HybridDeviceOptimizer(
        decay_groups(model), offload_fraction=fraction, cpu_optimizer_class=cls, overlap=overlap, **kwargs
    )


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(
    ("cls", "kwargs"), [(torch.optim.AdamW, ADAMW), (torch.optim.SGD, SGD["opt_kwargs"])]
)
def test_follows_the_plain_optimizer_bit_for_bit(fraction, overlap, cls, kwargs):
    """Two param groups, a StepLR schedule, a frozen param and a param that never gets a
    grad: every param equals the plain optimizer's after every step."""
    torch.manual_seed(0)
    model = AwkwardGPT()
    reference = copy.deepcopy(model)
    opt = _hybrid(model, fraction, cls, overlap, **kwargs)
    opt_ref = cls(decay_groups(reference), **kwargs)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in (opt, opt_ref)]
    for step in range(6):
        assert _train(model, opt, [step], scheds[0]) == _train(reference, opt_ref, [step], scheds[1])
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)
    assert opt.param_groups[1]["lr"] == opt_ref.param_groups[1]["lr"] < 3e-3  # the schedule ran
    total = sum(p.numel() for group in opt.param_groups for p in group["params"])
    offloaded = sum(p.numel() for p in opt.offloaded_params)
    assert (offloaded == 0) == (fraction == 0.0) and (offloaded == total) == (fraction == 1.0)


def test_the_offloaded_params_are_the_first_fraction_by_elements():
    assert _offloaded([10, 10, 10], 0.5) == [True, False, False]  # middles 5, 15, 25 < 15
    assert _offloaded([10, 10, 10], 0.51) == [True, True, False]
    assert _offloaded([10, 10, 10], 0.0) == [False] * 3
    assert _offloaded([10, 10, 10], 1.0) == [True] * 3
    torch.manual_seed(0)
    model = AwkwardGPT()
    opt = _hybrid(model, 0.3, **ADAMW)
    ordered = [p for group in opt.param_groups for p in group["params"]]
    assert opt.offloaded_params == ordered[: len(opt.offloaded_params)]  # a prefix, in group order
    share = sum(p.numel() for p in opt.offloaded_params) / sum(p.numel() for p in ordered)
    largest = max(p.numel() for p in ordered) / sum(p.numel() for p in ordered)
    assert abs(share - 0.3) <= largest / 2


def test_params_under_the_threshold_stay_on_the_device_and_steps_stay_exact():
    """offload_threshold: within the offloaded share, a param of fewer elements stays on the
    device; the run still equals the plain optimizer's bit for bit."""
    assert _offloaded([10, 2, 10], 1.0, 5) == [True, False, True]
    assert _offloaded([10, 2, 10], 0.6, 0) == [True, True, False]  # middles 5, 11, 17 < 13.2
    torch.manual_seed(0)
    model = AwkwardGPT()
    reference = copy.deepcopy(model)
    opt = _hybrid(model, 1.0, offload_threshold=64, **ADAMW)
    opt_ref = torch.optim.AdamW(decay_groups(reference), **ADAMW)
    for step in range(3):
        assert _train(model, opt, [step]) == _train(reference, opt_ref, [step])
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)
    ordered = [p for group in opt.param_groups for p in group["params"]]
    offloaded = {id(p) for p in opt.offloaded_params}
    assert {id(p) for p in ordered if p.numel() >= 64} == offloaded
    assert any(p.numel() < 64 for p in ordered)  # (some stayed)


def test_state_and_param_groups_are_one_source_of_truth():
    torch.manual_seed(0)
    model = AwkwardGPT()
    opt = _hybrid(model, 0.5, **ADAMW)
    _train(model, opt, range(2))
    stand_in = {}
    for sub in opt.subs:
        for param, s in zip(sub.params, sub.stand_ins, strict=True):
            stand_in[param] = (sub, s)
    for p in opt.offloaded_params:
        sub, s = stand_in[p]
        assert s is not p and s.device.type == "cpu" and s.dtype == torch.float32
        if p.grad is None and p not in opt.state:
            continue
        assert opt.state[p] is sub.optimizer.state[s]  # the same dict, not a copy
        assert opt.state[p]["exp_avg"].shape == p.shape
    # a hand edit of a group reaches the sub-optimizers at the next step
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    after_1 = [p.detach().clone() for p in opt.param_groups[1]["params"]]
    _train(model, opt, range(2, 3))
    assert all(torch.equal(p, b) for p, b in zip(opt.param_groups[0]["params"], before, strict=True))
    assert not all(torch.equal(p, b) for p, b in zip(opt.param_groups[1]["params"], after_1, strict=True))
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # the class's defaults are shown


def test_bf16_params_update_through_fp32_masters_on_both_sides():
    """bf16 params at offload fractions 0, 0.5 and 1 take identical steps (fp32 masters on
    whichever side), and each param is its master rounded to bf16."""
    torch.manual_seed(0)
    model = AwkwardGPT().to(torch.bfloat16)
    models = [copy.deepcopy(model) for _ in range(3)]
    opts = [_hybrid(m, f, **ADAMW) for m, f in zip(models, (0.0, 0.5, 1.0), strict=True)]
    for m, opt in zip(models, opts, strict=True):
        _train(m, opt, range(4))
    for m in models[1:]:
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), models[0].parameters(), strict=True))
    masters = opts[1].masters()
    assert len(masters) == sum(1 for p in models[1].parameters() if p.requires_grad)
    for p, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), p)
    naive = copy.deepcopy(model)
    _train(naive, torch.optim.AdamW(decay_groups(naive), **ADAMW), range(4))
    assert not all(torch.equal(p, q) for p, q in zip(naive.parameters(), models[0].parameters(), strict=True))


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_bit_for_bit(dtype):
    torch.manual_seed(0)
    model = AwkwardGPT().to(dtype)
    opt = _hybrid(model, 0.3, **ADAMW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    _train(model, opt, range(3), sched)
    saved = _round_trip({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    expected = _train(model, opt, range(3, 6), sched)
    torch.manual_seed(1)
    resumed = AwkwardGPT().to(dtype)
    resumed.load_state_dict(saved["model"])
    resumed_opt = _hybrid(resumed, 0.3, **ADAMW)
    resumed_opt.load_state_dict(saved["opt"])
    resumed_sched = torch.optim.lr_scheduler.StepLR(resumed_opt, step_size=2, gamma=0.3)
    resumed_sched.load_state_dict(saved["sched"])
    assert _train(resumed, resumed_opt, range(3, 6), resumed_sched) == expected
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), model.parameters(), strict=True))


def test_state_dicts_are_interchangeable_with_the_plain_optimizer():
    torch.manual_seed(0)
    model = AwkwardGPT()
    reference = copy.deepcopy(model)
    opt = _hybrid(model, 0.6, **ADAMW)
    opt_ref = torch.optim.AdamW(decay_groups(reference), **ADAMW)
    _train(model, opt, range(2))
    _train(reference, opt_ref, range(2))
    # swap: each continues from the other's state (equal so far) and they stay equal
    mine, theirs = _round_trip(opt.state_dict()), _round_trip(opt_ref.state_dict())
    opt.load_state_dict(theirs)
    opt_ref.load_state_dict(mine)
    assert _train(model, opt, range(2, 5)) == _train(reference, opt_ref, range(2, 5))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_bad_arguments_name_the_value():
    model = AwkwardGPT()
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0, 1\], got 1.5"):
        _hybrid(model, 1.5)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match=f"offload_threshold must be an int >= 0 .elements., got {bad}"):
            _hybrid(model, 0.5, offload_threshold=bad)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer subclass, got 'adam'"):
        HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, cpu_optimizer_class="adam")
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        _hybrid(model, 0.5, lr=-1.0)
    opt = _hybrid(model, 0.5, **ADAMW)
    state = opt.state_dict()
    state["param_groups"][1]["params"] = state["param_groups"][1]["params"][:-1]
    with pytest.raises(ValueError, match=r"param group 1 has \d+ params in the state dict"):
        opt.load_state_dict(state)


# -- inside DistributedOptimizer ---------------------------------------------------------------------
def _hybrid_kwargs(fraction: float, overlap: bool = True, cls=torch.optim.AdamW) -> dict:
    return {"offload_fraction": fraction, "cpu_optimizer_class": cls, "overlap": overlap}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_as_the_inner_optimizer_it_follows_ddp(world_size, stage):
    """DistributedOptimizer(HybridDeviceOptimizer(AdamW), 30% offloaded) with param groups
    and a schedule follows DDP + AdamW, as DistributedOptimizer(AdamW) does."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "buckets": flatshard.Buckets(size=3000)},
        groups=decay_groups,
        schedule=True,
        ours_optimizer_class=HybridDeviceOptimizer,
        ours_opt_kwargs={**_hybrid_kwargs(0.3), "lr": 1e-2, "weight_decay": 0.1},
    )
    check_parity(result, params=1e-5 if world_size <= 2 else 1e-2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_as_the_inner_optimizer_with_a_threshold_it_follows_ddp(world_size):
    """All offloaded but the shard runs under 1000 elements (a rank's pieces of the small
    params), at stage 2 with SGD + momentum: DDP's trajectory within 1e-5."""
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": 2, "buckets": flatshard.Buckets(size=3000)},
        **SGD,
        ours_optimizer_class=HybridDeviceOptimizer,
        ours_opt_kwargs={
            **SGD["opt_kwargs"],
            **_hybrid_kwargs(1.0, cls=torch.optim.SGD),
            "offload_threshold": 1000,
        },
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_as_the_inner_optimizer_with_sgd_at_the_extremes(fraction):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        3,
        {"stage": 2, "buckets": flatshard.Buckets(size=3000)},
        **SGD,
        clip=0.5,
        ours_optimizer_class=HybridDeviceOptimizer,
        ours_opt_kwargs={**SGD["opt_kwargs"], **_hybrid_kwargs(fraction, cls=torch.optim.SGD)},
    )
    check_parity(result, params=1e-5)


def _inner_equals_plain_case(stage: int, dtype: torch.dtype) -> bool:
    """The same sharded run with AdamW and with HybridDeviceOptimizer(AdamW) as the inner
    optimizer, including a state-dict round trip of the latter mid-run."""

    def build(cls, **kwargs):
        torch.manual_seed(0)
        model = flatshard.shard(AwkwardGPT().to(dtype), stage=stage, buckets=flatshard.Buckets(size=3000))
        return model, DistributedOptimizer(model, cls, **ADAMW, **kwargs)

    plain, plain_opt = build(torch.optim.AdamW)
    ours, ours_opt = build(HybridDeviceOptimizer, **_hybrid_kwargs(0.5, overlap=False))
    rank = torch.distributed.get_rank()
    for step in range(4):
        x, y = CORPUS.batch(step, rank, 4)
        for model, opt in ((plain, plain_opt), (ours, ours_opt)):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if step == 1:
            saved = copy.deepcopy(ours_opt.state_dict())
            ours_opt.inner.reload_model_params()
            ours_opt.load_state_dict(saved)
    return all(torch.equal(p, q) for p, q in zip(full_params(ours), full_params(plain), strict=True))


@pytest.mark.parametrize(("stage", "dtype"), [(1, torch.float32), (3, torch.bfloat16)])
def test_as_the_inner_optimizer_it_steps_exactly_like_the_plain_one(stage, dtype):
    assert all(run_distributed(_inner_equals_plain_case, 2, stage, dtype))
