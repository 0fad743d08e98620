"""The native CPU Adam loop ([Note: native CPU Adam] in optim/cpu_adam.py): the fused step's
arithmetic and rounding bits, every dtype combination, pieces over threads and past 2**32 of
a run; its build cache; and the torch ops it falls back to."""

from __future__ import annotations

import itertools

import pytest
import torch

from flatshard.optim import cpu_adam, fused_adam
from flatshard.optim.rounding import salt

F32, BF16 = torch.float32, torch.bfloat16

# (length, first element's place in its run, Adam's L2 term, maximize, betas): a tail that is
# no whole vector, a piece that crosses 2**32 (the hash's second round), a beta1 at or below
# 0.5 (lerp's other formula), enough elements for a piece a thread
CASES = [
    (37, 5, 0.1, False, (0.9, 0.95)),
    (4099, (1 << 32) - 2000, 0.0, True, (0.3, 0.999)),
    (200_003, 12_345, 0.0, False, (0.9, 0.999)),
]


def _inputs(dtypes, n):
    """A param, a grad and Adam's two moments of ``n`` elements in ``dtypes``."""
    param_dtype, grad_dtype, state_dtype = dtypes
    torch.manual_seed(n)
    return [
        torch.randn(n).to(param_dtype),
        (torch.randn(n) * 1e-2).to(grad_dtype),
        (torch.randn(n) * 1e-2).to(state_dtype),
        (torch.rand(n) * 1e-4).to(state_dtype),
    ]


def _salts_and_hyper(case):
    _, _, l2, _, betas = case
    group = {
        "lr": 1e-2,
        "betas": betas,
        "eps": 1e-8,
        "weight_decay": l2 or 0.1,
        "decoupled_weight_decay": not l2,
    }
    return [h for key in fused_adam.STATE_KEYS for h in salt(7, 3, 0, 1, key)], fused_adam.scalars(group, 3)


def _both(dtypes, case, threads):
    """The inputs, and the same step through the fused step's torch ops and through the native loop."""
    n, start, l2, maximize, _ = case
    tensors = _inputs(dtypes, n)
    halves, hyper = _salts_and_hyper(case)
    ops = [t.clone() for t in tensors]
    fused_adam.adam_chunk(*ops, torch.tensor([start, *halves]), torch.tensor(hyper), l2, maximize)
    native = [t.clone() for t in tensors]
    torch.set_num_threads(threads)
    try:
        assert cpu_adam.step(*native, start, halves, hyper, l2, maximize)
    finally:
        torch.set_num_threads(1)
    return tensors, ops, native


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtypes", list(itertools.product((F32, BF16), repeat=3)), ids=str)
def test_the_native_loop_is_the_fused_step(dtypes, threads):
    """Moments to the bit (their arithmetic and rounding bits are the same); params to the bit
    but where torch's CPU sqrt (MKL's, not always correctly rounded) and the native loop's
    (correctly rounded, as torch's own fused=True step) differ. There the update ``u`` (the
    result less the decayed param) is a quotient whose denominators differ by an fp32 ulp,
    each quotient rounded (half an ulp), so the two differ by under 2 eps32 |u|; each sum is
    rounded once more into the param's dtype (half an ulp each, one bf16 ulp when rounded
    stochastically): |a - b| <= 2 eps32 |u| + eps max(|a|, |b|), eps the param dtype's."""
    eps32 = torch.finfo(F32).eps
    for case in CASES:
        before, ops, native = _both(dtypes, case, threads)
        for name, a, b in zip(("exp_avg", "exp_avg_sq"), ops[2:], native[2:], strict=True):
            assert torch.equal(a.view(-1), b.view(-1)), (case, name)
        decay = _salts_and_hyper(case)[1][0]
        a, b, w0 = ops[0].double(), native[0].double(), before[0].double()
        bound = 2 * eps32 * (a - w0 * decay).abs() + torch.finfo(ops[0].dtype).eps * a.abs().maximum(b.abs())
        assert ((a - b).abs() <= bound).all(), case
        assert (a == b).double().mean() > 0.99, case


def test_non_finite_values_come_out_as_the_fused_step_writes_them():
    """NaN and inf grads, params and moments (a NaN's payload in its low mantissa bits, which
    rounding would carry into an infinity's bits or, from 0x7FFFFFFF, a GPU's NaN, into -0.0,
    or in its high ones) give the fused step's moments: the same bits, but a NaN is a NaN on
    both sides with bits of its own (torch's vectorized CPU conversion writes 0xFFFF, the
    native loop c10's 0x7FC0), wherever the step in fp32 gives a NaN."""
    n = 4099
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")])
    payloads = torch.tensor([0x7F800001, 0x7F812345, 0xFFC00001, 0x7FFFFFFF], dtype=torch.int64)
    for dtypes in ((BF16, F32, BF16), (BF16, BF16, BF16), (F32, F32, BF16)):
        tensors = _inputs(dtypes, n)
        for k, t in enumerate(tensors):
            values = torch.cat([specials, payloads.to(torch.int32).view(torch.float32)])
            t[100 * k : 100 * k + 8] = values.to(t.dtype)
        case = (n, 77, 0.0, False, (0.9, 0.95))
        halves, hyper = _salts_and_hyper(case)
        unrounded = [t.float() for t in tensors]  # (the same step in fp32: where it gives NaNs)
        fused_adam.adam_chunk(*unrounded, torch.tensor([77, *halves]), torch.tensor(hyper), 0.0, False)
        ops = [t.clone() for t in tensors]
        fused_adam.adam_chunk(*ops, torch.tensor([77, *halves]), torch.tensor(hyper), 0.0, False)
        native = [t.clone() for t in tensors]
        assert cpu_adam.step(*native, 77, halves, hyper, 0.0, False)
        for a, b, ref in zip(ops, native, unrounded, strict=True):
            nan = ref.isnan()
            assert nan.any() and torch.equal(a.isnan(), nan) and torch.equal(b.isnan(), nan), dtypes
        for a, b in zip(ops[2:], native[2:], strict=True):
            nan = a.isnan()
            bits = torch.int16 if a.dtype == BF16 else torch.int32
            assert torch.equal(a[~nan].view(bits), b[~nan].view(bits)), dtypes
            assert a.isinf().any(), dtypes  # (infinities reached the moments too)


def test_a_run_in_pieces_draws_what_it_draws_whole():
    """Two calls over pieces of a run (the second starting at its place) equal one call."""
    n, start, l2, maximize, _ = case = CASES[2]
    halves, hyper = _salts_and_hyper(case)
    whole = _inputs((BF16, F32, BF16), n)
    pieces = [t.clone() for t in whole]
    assert cpu_adam.step(*whole, start, halves, hyper, l2, maximize)
    cut = n // 3
    assert cpu_adam.step(*(t[:cut] for t in pieces), start, halves, hyper, l2, maximize)
    assert cpu_adam.step(*(t[cut:] for t in pieces), start + cut, halves, hyper, l2, maximize)
    for a, b in zip(whole, pieces, strict=True):
        assert torch.equal(
            a.view(torch.int16) if a.dtype == BF16 else a, b.view(torch.int16) if b.dtype == BF16 else b
        )


def test_what_the_loop_does_not_take_is_left_to_torch():
    """A dtype it has no loop for, a strided view, moments of two dtypes or a length that
    differs: False, and nothing written."""
    n = 64
    plain = [torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]
    hyper = fused_adam.scalars({"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, 1)
    for bad in (
        [plain[0].half(), *plain[1:]],
        [torch.zeros(2 * n)[::2], *plain[1:]],
        [plain[0], plain[1], plain[2].bfloat16(), plain[3]],
        [torch.zeros(n + 1), *plain[1:]],
    ):
        before = [t.clone() for t in bad]
        assert not cpu_adam.step(*bad, 0, [0] * 6, hyper, 0.0, False)
        assert all(torch.equal(a, b) for a, b in zip(before, bad, strict=True))


def _step_run():
    """One ``step_run`` of a bf16 run with bf16 moments; its state."""
    torch.manual_seed(0)
    run, grad, state = torch.randn(1000).bfloat16(), torch.randn(1000), {}
    group = {
        "lr": 1e-2,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "decoupled_weight_decay": True,
    }
    fused_adam.step_run(run, grad, state, group, (0, 0, 0), 64, BF16)
    return state


def test_the_build_is_cached_and_a_missing_compiler_falls_back_with_a_warning(tmp_path, monkeypatch):
    """The loop is built once into the cache folder (nothing else left there) and loaded from
    there after; without a compiler the first use warns why, and the step runs as torch ops
    to the same moments."""
    monkeypatch.setenv("FLATSHARD_CACHE_DIR", str(tmp_path))
    cpu_adam._library.cache_clear()
    try:
        assert cpu_adam.available()
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].name.startswith("cpu_adam-") and built[0].suffix == ".so", built
        stamp = built[0].stat().st_mtime_ns
        cpu_adam._library.cache_clear()
        assert cpu_adam.available() and built[0].stat().st_mtime_ns == stamp
        native = _step_run()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("FLATSHARD_CACHE_DIR", str(tmp_path / "other"))
        cpu_adam._library.cache_clear()
        with pytest.warns(UserWarning, match=r"native CPU Adam step is not available \(FileNotFoundError"):
            ops = _step_run()
        assert not (tmp_path / "other").exists()
    finally:
        cpu_adam._library.cache_clear()
    for key in ("exp_avg", "exp_avg_sq"):
        assert native[key].dtype == BF16 and torch.equal(native[key], ops[key]), key
