"""The precision-aware optimizer ([Note: precision-aware optimizer] in optim/precision.py):
stochastic rounding is unbiased and replays; the chunked fp32 step is torch's own step;
bf16 state and bf16 main params follow an fp32 run within the bound their rounding allows,
at every stage and world size; memory_report counts the bytes.

[Note: precision tolerances]

bf16 keeps 8 significant bits, so one stochastic rounding moves a value by less than one
ulp, at most 2**-7 of it. A state tensor rounded once a step carries after t steps an error
of at most t * 2**-7 of its size (each rounding's error decays by beta or momentum < 1
afterwards, bounded here by not decaying at all). Its effect on an update:

* SGD with momentum: the update is lr * buf, so its error is at most t * 2**-7 of it.
* Adam: the update is lr * m / sqrt(v); m's relative error t * 2**-7 and sqrt(v)'s half of
  v's add to 1.5 * t * 2**-7.

Summed over T steps, the params differ from the fp32 run's by at most c * D with
c = 1.5 * T * 2**-7 and D the fp32 run's own movement (the sum over steps of each step's
largest update); with T = 4, c = 0.047. bf16 main params are rounded themselves too: one
more ulp of the param a step, T * 2**-7 * max|w| in all. Grads move with the params, which
feeds the difference back; at lr 1e-2 over 4 steps that is a fraction of the first-order
bound, covered by a factor of 2. Against these, a step that lost its state (Adam's update
becomes sign(grad)) or its update (the param does not move) differs by about D. Adam is held
to the bound only where the two runs' grads agree to fp32 rounding (bf16 moments, 1-2
ranks): where they differ more (bf16 main params change the forward), Adam turns that into
lr-sized differences for grads that nearly cancel ([Note: parity tolerances]), so bf16 main
params are held to it with SGD, and their Adam loss curves are measured by
``benchmarks/precision.py``. Grads kept in bf16 are rounded (to nearest) in each
accumulation and reduction: at most N + 5 times a step for a tied param over 2
micro-batches, each by half an ulp, 2**-8; SGD's update is linear in them, so the bound is
(N + 5) 2**-8 of the movement, doubled for feedback.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT
from flatshard.optim import cpu_adam, fused_adam
from flatshard.optim.precision import PrecisionAwareOptimizer
from flatshard.optim.rounding import noise, round_into, salt, shift_of
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

BF16 = torch.bfloat16
ULP = 2.0**-7  # one bf16 ulp, relative to the value (8 significant bits)
STEPS = 4


# -- stochastic rounding ---------------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased_exact_where_it_can_be_and_replays():
    lo = torch.tensor(1.0, dtype=BF16)
    hi = torch.tensor(1.0 + 2.0**-7, dtype=BF16)
    fraction = 0.3
    n = 200_000
    value = torch.full((n,), 1.0 + fraction * 2.0**-7)
    out = torch.empty(n, dtype=BF16)
    round_into(out, value, salt(0, 1, 0, 0, "param"))
    assert set(out.unique().tolist()) == {lo.item(), hi.item()}
    up = (out == hi).double().mean().item()
    # binomial: the share rounded up has mean `fraction` and std sqrt(f (1-f) / n) = 0.001
    assert abs(up - fraction) < 6 * math.sqrt(fraction * (1 - fraction) / n), up
    far = torch.empty(n, dtype=BF16)  # elements past 2**31 of a run: the index's high half counts
    round_into(far, value, salt(0, 1, 0, 0, "param"), start=3 << 31)
    assert abs((far == hi).double().mean().item() - fraction) < 6 * math.sqrt(fraction * (1 - fraction) / n)
    assert not torch.equal(far, out)
    exact = torch.randn(1000).to(BF16).float()  # already bf16 values: never moved
    again = torch.empty(1000, dtype=BF16)
    round_into(again, exact, salt(0, 2, 0, 0, "param"))
    assert torch.equal(again.float(), exact)
    # the same salt replays; a run rounded in two pieces draws what it
    # draws whole; another step, run or key draws other bits ([Note: rounding bits])
    whole = torch.empty(n, dtype=BF16)
    round_into(whole, value, salt(7, 1, 0, 0, "param"))
    halves = torch.empty(n, dtype=BF16)
    round_into(halves[: n // 3], value[: n // 3], salt(7, 1, 0, 0, "param"))
    round_into(halves[n // 3 :], value[n // 3 :], salt(7, 1, 0, 0, "param"), start=n // 3)
    assert torch.equal(whole, halves)
    for other in (salt(7, 2, 0, 0, "param"), salt(7, 1, 0, 1, "param"), salt(7, 1, 0, 0, "exp_avg")):
        drawn = torch.empty(n, dtype=BF16)
        round_into(drawn, value, other)
        assert not torch.equal(drawn, whole)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    round_into(out[:4], special, salt(0, 1, 0, 0, "param"))
    assert out[:4].float().tolist() == special.tolist()


def test_a_nan_rounds_to_a_nan_whatever_its_bits():
    """Rounding adds to a value's low bits: a NaN's payload there would carry into its
    exponent and sign. 0x7FFFFFFF (the NaN a GPU's fp32 arithmetic writes) became -0.0 and
    0x7F800001 an infinity, so a NaN in a step on a GPU turned bf16 params into zeros without a
    word. Every NaN, either sign, any payload and any rounding bits, stays a NaN; infinities
    stay themselves. (The compiled kernel's NaNs: the fused step's test below.)"""
    nans = torch.tensor(
        [0x7FFFFFFF, 0x7F800001, 0x7FC00000, 0x7F80FFFF, -1, -4194304, -8388607], dtype=torch.int32
    ).view(torch.float32)  # (-1: 0xFFFFFFFF, -4194304: 0xFFC00000 (a CPU's), -8388607: 0xFF800001)
    value = torch.cat([nans.repeat(64), torch.tensor([float("inf"), -float("inf")])])
    for key in ("param", "exp_avg", "exp_avg_sq"):
        out = torch.empty(value.numel(), dtype=BF16)
        halves = salt(0, 1, 0, 0, key)
        round_into(out, value, halves, shift=shift_of(key))
        assert out[:-2].isnan().all(), key
        assert out[-2:].float().tolist() == [float("inf"), -float("inf")], key


def test_the_rounding_bits_are_uniform():
    """Each of the 16 bits is set in half the elements and neighbouring elements' bits are
    uncorrelated, as are one element's two moments' (4M draws: a bit's share has std 0.00025,
    a correlation std 0.0005; 8 std)."""
    bits = noise(torch.arange(1 << 22), salt(3, 5, 1, 2, "exp_avg_sq"), shift=shift_of("exp_avg_sq"))
    near = torch.arange((1 << 32) - 1000, 1 << 32)  # (far=False skips work, never changes bits)
    assert torch.equal(
        noise(near, salt(3, 5, 1, 2, "param"), far=False), noise(near, salt(3, 5, 1, 2, "param"))
    )
    shares = torch.tensor([((bits >> b) & 1).sum().item() / bits.numel() for b in range(16)])
    assert (shares - 0.5).abs().max().item() < 8 * 0.00025, shares
    pair = torch.stack([bits[:-1], bits[1:]]).double()
    assert abs(torch.corrcoef(pair)[0, 1].item()) < 8 * 0.0005
    # (an element's two moments draw the two halves of one hash: uncorrelated too; 1M draws,
    # a correlation's std 0.001)
    where = salt(3, 5, 1, 2, "exp_avg_sq")
    assert where == salt(3, 5, 1, 2, "exp_avg") and shift_of("exp_avg_sq") == 16
    first = noise(torch.arange(1 << 20), where, shift=shift_of("exp_avg"))
    pair = torch.stack([first, bits[: 1 << 20]]).double()
    assert abs(torch.corrcoef(pair)[0, 1].item()) < 8 * 0.001


def _pair(cls, params, kwargs, precision, chunk, fused):
    mine = [p.clone() for p in params]
    grads = {id(p): torch.empty(p.shape) for p in mine}
    ours = PrecisionAwareOptimizer(cls, [{"params": mine}], kwargs, precision, grads, chunk, fused)
    return mine, grads, ours


@pytest.mark.parametrize("path", ["chunked", "native", "torch ops"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_the_fp32_step_is_torchs_own(chunk, cls, path, monkeypatch):
    """fp32 main params and fp32 state equal torch's own step, bitwise, for chunks that cut
    runs anywhere: the chunked path and the fused step's torch ops equal torch's single-tensor
    step (torch's fp32 operations in torch's order), the native CPU loop equals torch's
    ``fused=True`` step, whose sqrt is correctly rounded where MKL's, which the other two
    call, is not always ([Note: native CPU Adam])."""
    torch.manual_seed(0)
    params = [torch.randn(n) for n in (17, 100, 3, 5000)]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "maximize": cls is torch.optim.Adam}
    if path == "native":
        assert cpu_adam.available()  # (the suite's machines have a C compiler: inductor needs one)
    else:
        monkeypatch.setattr(cpu_adam, "step", lambda *args: False)
    ref = cls(params, **kwargs, fused=path == "native")
    precision = flatshard.OptimizerPrecision(state_dtype=torch.float32)
    mine, grads, ours = _pair(cls, params, kwargs, precision, chunk, path != "chunked")
    for step in range(5):
        ref.param_groups[0]["lr"] = ours.param_groups[0]["lr"] = 1e-2 / (1 + step)  # (a schedule)
        for p, q in zip(params, mine, strict=True):
            p.grad = torch.randn_like(p)
            grads[id(q)].copy_(p.grad)
        ref.step()
        ours.step()
    for p, q in zip(params, mine, strict=True):
        assert torch.equal(q, p)
        assert ours.state[q]["step"].item() == 5
        assert set(ours.state[q]) == set(ref.state[p])


def test_the_fused_adam_step_is_the_chunked_one_in_bf16_natively_and_compiled(monkeypatch):
    """bf16 main params and moments: the fused step (natively, as torch ops, and compiled as
    on an accelerator) leaves the params and state the chunked path leaves, to the bit: the
    same fp32 operations in the same order and the same rounding bits ([Note: rounding
    bits]). (The native loop's sqrt is correctly rounded and MKL's not always: the two
    differ by an fp32 ulp in a few updates, which moves a bf16 result only where a rounding
    boundary falls inside that ulp, one time in 2**16.)"""
    torch.manual_seed(1)
    params = [torch.randn(n).to(BF16) for n in (1000, 37, 520)]  # (no chunk of 1 element: one graph)
    precision = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16, seed=5)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    runs = [
        _pair(torch.optim.AdamW, params, kwargs, precision, 64, fused) for fused in (False, True, True, True)
    ]
    native, compiled = runs[1][2], runs[3][2]  # (and runs[2]: the fused step as torch ops)
    native_step = cpu_adam.step
    from torch._dynamo.utils import counters

    poisoned = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)  # (a GPU's NaN)
    for step in range(5):
        if step == 1:  # every chunk length has been seen: what follows must not compile again
            graphs = counters["stats"]["unique_graphs"]
        grads = [torch.randn(p.shape) for p in params]
        if step == 4:  # (a NaN grad: every path, the compiled kernel's too, leaves NaNs, not -0.0)
            grads[0][5] = poisoned
        for mine, into, opt in runs:
            for q, g in zip(mine, grads, strict=True):
                into[id(q)].copy_(g)
            monkeypatch.setattr(cpu_adam, "step", native_step if opt is native else lambda *args: False)
            if opt is compiled:
                with _compiled_on_the_cpu():
                    opt.step()
            else:
                opt.step()
    # (the first GPU run of this kernel recompiled at each step on a changing step size, and
    # fell back to uncompiled code at dynamo's limit: the values that change are now tensors)
    assert counters["stats"]["unique_graphs"] == graphs
    (chunked, _, ref), *fused = runs
    for mine, _, opt in [(chunked, None, ref), *fused]:
        assert mine[0].isnan().nonzero().tolist() == [[5]] and not mine[1].isnan().any()
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[mine[0]][key].isnan().nonzero().tolist() == [[5]], key
    for mine, _, opt in fused:  # (to the bit but the NaNs' own bits: [Note: native CPU Adam])
        for q, r in zip(mine, chunked, strict=True):
            assert torch.equal(q.nan_to_num(), r.nan_to_num())
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt.state[q][key].dtype == BF16
                assert torch.equal(opt.state[q][key].nan_to_num(), ref.state[r][key].nan_to_num())
    assert any(not torch.equal(q, p) for q, p in zip(chunked, params, strict=True))


@contextlib.contextmanager
def _compiled_on_the_cpu():
    original = fused_adam.adam_chunk
    fused_adam.adam_chunk = fused_adam.compiled_adam_chunk()
    try:
        yield
    finally:
        fused_adam.adam_chunk = original


# -- following an fp32 run ---------------------------------------------------------------------------
def _params(model) -> list[torch.Tensor]:
    if isinstance(model, DDP):
        return [p.detach().float().clone() for p in model.module.parameters()]
    with model.summon_full_params(writeback=False):
        return [p.detach().float().clone() for p in model.parameters()]


def _follow(stage: int, cls_name: str, main_bf16: bool) -> dict:
    """Train a flatshard model with bf16 state (and ``main_bf16``: bf16 main params) beside
    an fp32-state run on the same data; return the largest param difference and the fp32
    run's movement D ([Note: precision tolerances])."""
    torch.set_num_threads(1)
    cls = getattr(torch.optim, cls_name)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1} if cls_name == "AdamW" else {"lr": 1e-2, "momentum": 0.9}
    torch.manual_seed(0)
    model = TiedGPT()
    if main_bf16:  # the fp32-state run: flatshard's fp32 main params of the same bf16 model
        mp = flatshard.MixedPrecision(BF16)
        reference = flatshard.shard(
            copy.deepcopy(model), stage=stage, mixed_precision=mp, buckets=flatshard.Buckets(size=3000)
        )
        opt_ref = flatshard.DistributedOptimizer(reference, cls, **kwargs)
        ours = flatshard.shard(model, stage=stage, mixed_precision=mp, buckets=flatshard.Buckets(size=3000))
    else:
        reference = DDP(copy.deepcopy(model))
        opt_ref = cls(reference.parameters(), **kwargs)
        ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000))
    precision = flatshard.OptimizerPrecision(
        main_dtype=BF16 if main_bf16 else torch.float32, state_dtype=BF16
    )
    opt = flatshard.DistributedOptimizer(ours, cls, precision=precision, **kwargs)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    allowance = 2 * STEPS * ULP if main_bf16 else 0.0  # (of each element: its own roundings)
    moved, diff, before = 0.0, 0.0, _params(reference)
    for step in range(STEPS):
        x, y = corpus.batch(step, dist.get_rank(), 4)
        for m in (reference, ours):
            m(x, y).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        after = _params(reference)
        moved += max((a - b).abs().max().item() for a, b in zip(after, before, strict=True))
        diff = max(
            ((a - b).abs() - allowance * b.abs()).max().item()
            for a, b in zip(_params(ours), after, strict=True)
        )
        before = after
    largest = max(p.abs().max().item() for p in before)
    return {"diff": diff, "moved": moved, "largest": largest}


def _bound(result: dict) -> float:
    """[Note: precision tolerances]: 2 x 1.5 T 2**-7 D, plus fp32 noise (1e-5 of the largest
    param, as in [Note: parity tolerances]). bf16 main params' own roundings (2 T 2**-7 of
    each element) are taken off each element's difference before it is compared."""
    return 2 * 1.5 * STEPS * ULP * result["moved"] + 1e-5 * result["largest"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_state_follows_fp32_state(world_size, stage):
    """SGD + momentum (bf16 momentum buffer) beside DDP + SGD in fp32, every stage and world size."""
    for result in run_distributed(_follow, world_size, stage, "SGD", False):
        assert result["diff"] < _bound(result) < 0.2 * result["moved"], result


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_main_params_follow_fp32_main_params(world_size, stage):
    """SGD + momentum stepping the bf16 params themselves (and a bf16 momentum buffer) beside
    flatshard's fp32 main params of the same bf16 model."""
    for result in run_distributed(_follow, world_size, stage, "SGD", True):
        assert result["diff"] < _bound(result) < 0.2 * result["moved"], result


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adamw_with_bf16_moments_follows_fp32(world_size, stage):
    """AdamW with bf16 moments beside DDP + AdamW in fp32. (Not with bf16 main params, nor
    at 3-4 ranks: there the grads differ in their last bits, and Adam turns that into
    lr-sized differences where grads nearly cancel, [Note: parity tolerances] in _parity.py;
    ``benchmarks/precision.py`` measures those settings' loss curves instead.)"""
    for result in run_distributed(_follow, world_size, stage, "AdamW", False):
        assert result["diff"] < _bound(result) < 0.2 * result["moved"], result


def _follow_bf16_grads(stage: int) -> dict:
    """SGD + momentum on a bf16 model with grads kept in bf16 (two micro-batches, the first
    under no_sync) beside the same model with fp32 grads; the largest param difference
    beyond one bf16 ulp of each param (their 16-bit rounding of fp32 main params) and the
    fp32-grad run's movement ([Note: precision tolerances])."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TiedGPT()
    runs = []
    for grads in (None, BF16):
        mp = flatshard.MixedPrecision(BF16, grad_dtype=grads)
        sharded = flatshard.shard(
            copy.deepcopy(model), stage=stage, mixed_precision=mp, buckets=flatshard.Buckets(size=3000)
        )
        runs.append((sharded, flatshard.DistributedOptimizer(sharded, torch.optim.SGD, lr=0.1, momentum=0.9)))
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    moved, diff, before = 0.0, 0.0, _params(runs[0][0])
    for step in range(STEPS):
        for m, opt in runs:
            for micro in range(2):
                x, y = corpus.batch(2 * step + micro, dist.get_rank(), 4)
                with m.no_sync() if micro == 0 else contextlib.nullcontext():
                    (m(x, y) / 2).backward()
            opt.step()
            opt.zero_grad()
        after = _params(runs[0][0])
        moved += max((a - b).abs().max().item() for a, b in zip(after, before, strict=True))
        pairs = zip(_params(runs[1][0]), after, strict=True)
        diff = max(((a - b).abs() - ULP * b.abs()).max().item() for a, b in pairs)
        before = after
    assert runs[1][0].flatshard_state.sets["main"].buffers[0].layout.grad_dtype == BF16
    return {"diff": diff, "moved": moved, "largest": max(p.abs().max().item() for p in before)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grads_kept_in_bf16_follow_fp32_grads(world_size, stage):
    """MixedPrecision(grad_dtype=torch.bfloat16): each grad element is rounded to bf16 at
    most N + 5 times a step (2 micro-batches of a tied param's 2 uses, the 1/N scale, N - 1
    sums in the reduction), each by at most half an ulp, 2**-8 of the sum so far. SGD's
    update is linear in the grads, so the params drift from the fp32-grad run's by at most
    (N + 5) 2**-8 of its movement, doubled for the feedback through the grads."""
    for result in run_distributed(_follow_bf16_grads, world_size, stage):
        bound = 2 * (world_size + 5) * 2.0**-8 * result["moved"] + 1e-5 * result["largest"]
        assert result["diff"] < bound < 0.5 * result["moved"], result


def _replicas_agree(stage: int) -> list[float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage, mixed_precision=flatshard.MixedPrecision(BF16))
    precision = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, lr=1e-2)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    for step in range(3):
        model(*corpus.batch(step, dist.get_rank(), 4)).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return flat.tolist()


def test_replicated_state_stays_replicated():
    """At stage 0 every rank holds all of the state: the rounding's bits are the same on
    every rank, so the params stay bit-identical."""
    first, *others = run_distributed(_replicas_agree, 3, 0)
    assert all(o == first for o in others)


# -- bytes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("main", "state", "per_param"),
    [(torch.float32, torch.float32, 12), (torch.float32, BF16, 8), (BF16, BF16, 4)],
)
def test_memory_report_counts_main_params_and_state(main, state, per_param):
    """AdamW on a bf16 model: fp32 main + 2 fp32 moments is 12 bytes a param, bf16 moments 8,
    bf16 main params (the params themselves) and bf16 moments 4."""
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), mixed_precision=flatshard.MixedPrecision(BF16))
    precision = flatshard.OptimizerPrecision(main_dtype=main, state_dtype=state)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, lr=1e-3)
    model(*SyntheticCorpus(CFG.vocab_size, CFG.seq_len).batch(0, 0, 2)).backward()
    opt.step()
    report = flatshard.memory_report(model, opt)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    bytes_per_param = (report.main_params + report.optimizer_state) / numel
    # (above it: the 64-element alignment of each param, the bucket padding, a step count per run)
    assert per_param <= bytes_per_param < per_param * 1.06, bytes_per_param


# -- checkpoints ---------------------------------------------------------------------------------
def _run(stage: int, precision, steps: int, path: str | None = None, load: str | None = None):
    """AdamW on a bf16 TiedGPT: optionally load ``load``, train ``steps``, optionally save to
    ``path``; returns the params and every run's state, as fp32 lists."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage, mixed_precision=flatshard.MixedPrecision(BF16))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, lr=1e-2)
    start = 0
    if load is not None:
        start = flatshard.load_checkpoint(load, model, opt)["step"]
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    for step in range(start, start + steps):
        model(*corpus.batch(step, dist.get_rank(), 4)).backward()
        opt.step()
        opt.zero_grad()
    if path is not None:
        flatshard.save_checkpoint(path, model, opt, extra={"step": start + steps})
    state = [
        (key, value.float().tolist()) for run in opt.state.values() for key, value in sorted(run.items())
    ]
    with model.summon_full_params(writeback=False):
        params = [p.float().tolist() for p in model.parameters()]
    return {"params": params, "state": state}


LOW = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)


def test_a_resume_at_the_same_layout_is_exact(tmp_path):
    """Saved after 2 steps and resumed for 2 more, bit for bit the uninterrupted 4 steps: the
    stored bf16 values come back as they were, and the rounding's bits replay."""
    straight = run_distributed(_run, 2, 2, LOW, 4)
    run_distributed(_run, 2, 2, LOW, 2, str(tmp_path / "a"))
    resumed = run_distributed(_run, 2, 2, LOW, 2, None, str(tmp_path / "a"))
    assert resumed == straight


def test_low_precision_checkpoints_load_into_fp32_state_at_any_layout_and_back(tmp_path):
    """bf16 main params and state saved at 2 ranks, stage 1; loaded into fp32 main params and
    state at 3 ranks, stage 3 (every value widened exactly) and saved again; loaded back at 2
    ranks, stage 1: every param and state value is the one first saved (a bf16 value widened
    and rounded to nearest is itself)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = run_distributed(_run, 2, 1, LOW, 3, a)
    widened = run_distributed(_run, 3, 3, None, 0, b, a)
    back = run_distributed(_run, 2, 1, LOW, 0, None, b)
    assert back == saved
    assert widened[0]["params"] == saved[0]["params"]


def test_grads_kept_in_bf16_halve_the_grad_bytes():
    torch.manual_seed(0)
    reports = []
    for grads in (None, BF16):
        mp = flatshard.MixedPrecision(BF16, grad_dtype=grads)
        model = flatshard.shard(TiedGPT(), stage=1, mixed_precision=mp)
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        model(*SyntheticCorpus(CFG.vocab_size, CFG.seq_len).batch(0, 0, 2)).backward()
        opt.step()
        reports.append(flatshard.memory_report(model, opt))
    assert reports[1].grads * 2 == reports[0].grads
    assert (reports[1].main_params, reports[1].optimizer_state) == (
        reports[0].main_params,
        reports[0].optimizer_state,
    )
