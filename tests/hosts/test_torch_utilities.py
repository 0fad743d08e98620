"""A sharded model under torch's own utilities ([Note: grads seen by torch] in
engine/grad_view.py): each row of the table in docs/torch-utilities.md is a test here (or,
for writes that reach the params, in test_param_writes.py),
against torch DDP doing the same thing on the same data at stages 0-3 on 1-3 ranks.

Tolerances ([Note: parity tolerances] in _parity.py): with SGD + momentum params follow DDP
to 1e-5 relative; a grad norm is the same sum of squares taken in another order, within
1e-5 relative (grads agree to ~1e-7, a norm of a few thousand terms adds at most a few ulps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import TiedGPT, drift_from, max_rel_diff
from _utilities import CORPUS, GRID, SGD, backward, pair, train_both
from flatshard.toolkit.testing import run_distributed


def _utility_run(stage: int, utility: str, steps: int = 3) -> dict:
    """Train both sides with ``utility`` applied to each one's ``.grad`` between backward and
    step; the values it returns on each side and the params' drift."""
    ours, opt, reference, opt_ref = pair(stage)
    values: list = []
    drift = [
        train_both(ours, opt, reference, opt_ref, step, lambda m: values.append(_apply(utility, m)))
        for step in range(steps)
    ]
    return {"returned": list(zip(values[::2], values[1::2], strict=True)), "drift": drift}


def _apply(utility: str, model) -> float | None:
    params = list(model.parameters())
    if utility == "clip_grad_norm_":
        return float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    if utility == "clip_grad_norm_inf":
        return float(torch.nn.utils.clip_grad_norm_(params, 0.01, norm_type="inf"))
    if utility == "clip_grad_norm_foreach":
        return float(torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True))
    if utility == "clip_grad_value_":
        torch.nn.utils.clip_grad_value_(params, 0.002)
        return None
    if utility == "grad_norms":  # what a logging callback computes, param by param
        return sum(float(p.grad.norm()) for p in params if p.grad is not None)
    raise ValueError(utility)


UTILITIES = ["clip_grad_norm_", "clip_grad_norm_inf", "clip_grad_norm_foreach", "clip_grad_value_"]
UTILITIES += ["grad_norms"]


@pytest.mark.parametrize("stage, world_size", GRID)
def test_clip_grad_norm_follows_ddp(stage, world_size):
    """torch.nn.utils.clip_grad_norm_ over a sharded model's params returns DDP's global norm
    and clips what the optimizer steps (it returned 0 and clipped nothing at stages 1-3)."""
    for result in run_distributed(_utility_run, world_size, stage, "clip_grad_norm_", timeout=90):
        for got, want in result["returned"]:
            assert got == pytest.approx(want, rel=1e-5), result["returned"]
        assert max(result["drift"]) < 1e-5, result["drift"]


@pytest.mark.parametrize("utility", UTILITIES[1:])
@pytest.mark.parametrize("stage, world_size", [(1, 3), (2, 2), (3, 3), (0, 2)])
def test_other_grad_utilities_follow_ddp(utility, stage, world_size):
    """The inf-norm, torch's foreach path, clip_grad_value_ and per-param norms: the same
    values as DDP's and the same trajectory."""
    for result in run_distributed(_utility_run, world_size, stage, utility, timeout=90):
        for got, want in result["returned"]:
            assert got == pytest.approx(want, rel=1e-5) if want is not None else got is None
        assert max(result["drift"]) < 1e-5, result["drift"]


def _bf16_clip(stage: int) -> dict:
    """16-bit params keep their grads in fp32 buffers (hidden): torch's clip on .grad reads
    those; the other side clips through the optimizer flatshard has always had."""
    mixed = flatshard.MixedPrecision(torch.bfloat16)
    sides = []
    for _ in range(2):
        torch.manual_seed(0)
        model = flatshard.shard(TiedGPT(), stage=stage, mixed_precision=mixed)
        sides.append((model, flatshard.DistributedOptimizer(model, torch.optim.SGD, **SGD)))
        backward(model, 0)
    by_torch = torch.nn.utils.clip_grad_norm_(sides[0][0].parameters(), 0.5)
    norms = (float(by_torch), float(sides[1][1].clip_grad_norm_(0.5)))
    grads = []
    for model, _ in sides:
        with model.summon_full_params(writeback=False, with_grads=True):
            grads.append([p.grad.float().clone() for p in model.parameters() if p.requires_grad])
    return {"norms": norms, "grad_diff": max(max_rel_diff(g, h) for g, h in zip(*grads, strict=True))}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_clip_of_bf16_params_is_the_optimizers_clip(stage):
    """With bf16 params the .grad torch clips is the fp32 grad flatshard steps: torch's clip
    and DistributedOptimizer.clip_grad_norm_ give the same norm and the same clipped grads
    (the same fp32 sums, the norm taken in another order: 1e-6 relative)."""
    for result in run_distributed(_bf16_clip, 2, stage, timeout=90):
        got, want = result["norms"]
        assert got == pytest.approx(want, rel=1e-6)
        assert result["grad_diff"] < 1e-6


def _torch_optimizer(stage: int) -> str:
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage, mixed_precision=flatshard.MixedPrecision(torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if stage > 0:  # (a sharded optimizer's grads exist only with flatshard's optimizer attached)
        flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    backward(model, 0)
    try:
        opt.step()
    except (flatshard.ShardedGradError, flatshard.ShardedParamError) as e:  # (stage 3: the param first)
        return str(e)
    return "stepped"


@pytest.mark.parametrize("stage", range(4))
def test_a_torch_optimizer_over_sharded_params_is_refused(stage):
    """A plain torch optimizer over the model's params saw .grad None and stepped nothing;
    now its first read of a grad flatshard holds is a ShardedGradError naming the param and
    the optimizer to use."""
    (message,) = run_distributed(_torch_optimizer, 1, stage, timeout=60)
    assert "DistributedOptimizer" in message and "param '" in message, message


def _hand_assigned(stage: int, how: str) -> dict:
    """Grads computed with torch.autograd.grad, then either assigned to .grad (refused) or
    accumulated with torch.autograd.backward (reduced like any grad: follows DDP)."""
    ours, opt, reference, opt_ref = pair(stage)
    drift = []
    for step in range(2):
        for model in (ours, reference):
            x, y = CORPUS.batch(step, dist.get_rank(), 4)
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(model(x, y), params)
            if model is reference or how == "assign":
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.clone()
                if model is reference:  # (DDP does not reduce assigned grads: do it as backward would)
                    for p in params:
                        dist.all_reduce(p.grad)
                        p.grad /= dist.get_world_size()
            else:
                torch.autograd.backward(params, grads)
        try:
            opt.step()
        except flatshard.ShardedGradError as e:
            return {"error": str(e)}
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        drift.append(drift_from(ours, reference.module))
    return {"drift": drift}


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 3), (2, 2), (3, 3)])
def test_hand_assigned_grads_are_refused_and_autograd_backward_is_the_way(stage, world_size):
    """A grad assigned to .grad after backward was ignored (stages 1-3: the step skipped) or
    stepped unreduced; it is refused at the step, naming torch.autograd.backward, which
    accumulates the same grads through the reduction and follows DDP (stages 0-2)."""
    refused = run_distributed(_hand_assigned, world_size, stage, "assign", timeout=90)
    instead = "torch.autograd.backward" if stage < 3 else "loss.backward()"
    assert all("assigned by hand" in r["error"] and instead in r["error"] for r in refused)
    if stage == 3:
        return  # (params are placeholders outside the model's forward and backward)
    for result in run_distributed(_hand_assigned, world_size, stage, "backward", timeout=90):
        assert max(result["drift"]) < 1e-5, result["drift"]


def _zero_without_none(stage: int) -> dict:
    """``zero_grad(set_to_none=False)`` then ``step()``: torch steps on zero grads (momentum
    and weight decay move the params); it was a no-op here."""
    ours, opt, reference, opt_ref = pair(stage)
    drift = []
    for step in range(3):
        if step != 1:  # (step 1: no backward, only zeros)
            backward(ours, step)
            backward(reference, step)
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=False)
        opt_ref.zero_grad(set_to_none=False)
        drift.append(drift_from(ours, reference.module))
    return {"drift": drift}


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 3), (2, 2), (3, 3)])
def test_zero_grad_without_none_then_step_steps_on_zeros_as_torch(stage, world_size):
    for result in run_distributed(_zero_without_none, world_size, stage, timeout=90):
        assert max(result["drift"]) < 1e-5, result["drift"]


def _moves(stage: int) -> dict:
    """Moves and casts after ``shard()``: those that leave every param where it is are
    no-ops (training goes on as DDP's); others are refused naming the param, changing
    nothing."""
    ours, opt, reference, opt_ref = pair(stage)
    refused = {}
    for name, move in {
        "to(bf16)": lambda m: m.to(torch.bfloat16),
        "half()": lambda m: m.half(),
        "double()": lambda m: m.double(),
        "to(meta)": lambda m: m.to("meta"),
    }.items():
        try:
            move(ours)
        except RuntimeError as e:
            refused[name] = str(e)
    drift = []
    for step in range(3):
        for move in (lambda m: m.to("cpu"), lambda m: m.to(torch.device("cpu", 0)), lambda m: m.float()):
            assert move(ours) is ours
        drift.append(train_both(ours, opt, reference, opt_ref, step))
    return {"refused": refused, "drift": drift}


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 1), (2, 2), (3, 3)])
def test_moves_that_change_nothing_are_no_ops_and_others_are_refused(stage, world_size):
    """``model.to(torch.device("cpu", 0))`` trained wrong at stages 0 and 2 (the params left
    the buffers); a no-op ``.to("cpu")`` raised at stage 3; a cast froze params at 1-2."""
    for result in run_distributed(_moves, world_size, stage, timeout=90):
        assert set(result["refused"]) == {"to(bf16)", "half()", "double()", "to(meta)"}, result["refused"]
        assert all("param 'wte.weight'" in m and "before shard()" in m for m in result["refused"].values())
        assert max(result["drift"]) < 1e-5, result["drift"]


def _ddp_on_top(stage: int) -> str:
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage)
    try:
        DDP(model)
    except RuntimeError as e:
        return str(e)
    return "wrapped"


@pytest.mark.parametrize("stage", range(4))
def test_ddp_around_a_sharded_model_is_refused_where_it_is_built(stage):
    """What the HF Trainer and accelerate do on several ranks: it trained wrong at stage 2
    (a logged grad norm of 0.000) and raised an unrelated error at stage 3."""
    (message,) = run_distributed(_ddp_on_top, 1, stage, timeout=60)
    assert "DistributedDataParallel around" in message and "flatshard" in message, message


def _grad_scaler_run(stage: int) -> dict:
    """torch's loss-scaling loop on both sides: DDP with ``torch.amp.GradScaler``, ours with
    ``flatshard.ShardedGradScaler``. At step 1 one param's grad overflows (times inf on every
    rank, as an fp16 overflow in one layer): on the sharded side only the ranks holding a
    piece of it see it. Even steps unscale first and clip with torch's clip, odd ones let
    ``step`` unscale. Then a plain GradScaler drives ours: refused, nothing stepped."""
    ours, opt, reference, opt_ref = pair(stage)
    sides = [
        (ours, opt, flatshard.ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=1)),
        (reference, opt_ref, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)),
    ]
    norms, scales, drift = [], [], []
    for step in range(4):
        for model, o, scaler in sides:
            scaler.scale(_loss(model, step)).backward()
            if step == 1:
                list(model.parameters())[-1].grad.mul_(float("inf"))
            if step % 2 == 0:
                scaler.unscale_(o)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        scales.append((sides[0][2].get_scale(), sides[1][2].get_scale()))
        drift.append(drift_from(ours, reference.module))
    plain = torch.amp.GradScaler("cpu")
    plain.scale(_loss(ours, 4)).backward()
    refused = "stepped"
    try:
        plain.step(opt)
    except flatshard.ShardedGradError as e:
        refused = str(e)
    return {
        "norms": norms,
        "scales": scales,
        "drift": drift,
        "skipped": opt.skipped_steps,
        "refused": refused,
    }


def _loss(model, step: int) -> torch.Tensor:
    x, y = CORPUS.batch(step, dist.get_rank(), 4)
    return model(x, y)


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 3), (2, 2), (3, 3), (3, 1)])
def test_grad_scaler_sees_an_overflow_in_any_ranks_shard(stage, world_size):
    """An overflow in one rank's shard made that rank skip while the others stepped (then a
    DesyncError naming no scaler). With ShardedGradScaler every rank skips step 1 and backs
    its scale off, as under DDP: the same scales to the bit (powers of two), the same norms
    and params as DDP within 1e-5 (unscaling by a power of two is exact: the tolerance of the
    unscaled runs above). torch's own GradScaler on a DistributedOptimizer is refused."""
    for result in run_distributed(_grad_scaler_run, world_size, stage, timeout=90):
        assert all(a == b for a, b in result["scales"]), result["scales"]
        assert [s for s, _ in result["scales"]] == [2.0**11, 2.0**10, 2.0**11, 2.0**12]
        assert result["skipped"] == 1
        for got, want in zip(result["norms"][::2], result["norms"][1::2], strict=True):
            assert got == pytest.approx(want, rel=1e-5), result["norms"]
        assert max(result["drift"]) < 1e-5, result["drift"]
        assert "ShardedGradScaler" in result["refused"] and "nothing was stepped" in result["refused"]


# -- parametrized modules ----------------------------------------------------------------------
def _parametrized(kind: str) -> torch.nn.Module:
    """TiedGPT with one of torch's parametrizations: the weight a module computes with is
    made from params sharded apart from it (``weight_norm``'s two, ``orthogonal``'s one), and
    spectral norm writes its buffers ``_u``/``_v`` in every training forward."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = TiedGPT()
    if kind == "weight_norm":
        parametrizations.weight_norm(model.blocks[0].fc)
    elif kind == "spectral_norm":
        parametrizations.spectral_norm(model.blocks[0].fc)
    elif kind == "orthogonal":
        parametrizations.orthogonal(model.blocks[1].attn.proj)
    else:  # (the old weight_norm: a forward pre-hook sets a plain attribute from its params)
        torch.nn.utils.weight_norm(model.blocks[0].fc)
    return model


def _parametrized_runs(stage: int) -> dict:
    out = {}
    for kind in ("weight_norm", "spectral_norm", "orthogonal", "old weight_norm"):
        reference = DDP(_parametrized(kind))  # (built again: the old weight_norm cannot be deep-copied)
        ours = flatshard.shard(_parametrized(kind), stage=stage, buckets=flatshard.Buckets(size=3000))
        opt = flatshard.DistributedOptimizer(ours, torch.optim.SGD, **SGD)
        opt_ref = torch.optim.SGD(reference.parameters(), **SGD)
        drift = [train_both(ours, opt, reference, opt_ref, step) for step in range(3)]
        theirs = dict(reference.module.named_buffers())
        buffers = max((max_rel_diff(b, theirs[n]) for n, b in ours.named_buffers()), default=0.0)
        full, expected = ours.full_state_dict(), reference.module.state_dict()
        same_keys = not full or list(full) == list(expected)
        out[kind] = {"drift": max(drift), "buffers": buffers, "state dict keys": same_keys}
    return out


@pytest.mark.parametrize("stage, world_size", [(1, 3), (3, 2)])
def test_parametrized_modules_follow_ddp(stage, world_size):
    """Parametrizations (``torch.nn.utils.parametrizations``, the old ``weight_norm``) train as
    under DDP: params within 1e-5 after 3 steps, spectral norm's buffers (its power iteration,
    from the same weights) within 1e-5, and the full state dict has the unsharded model's keys."""
    for result in run_distributed(_parametrized_runs, world_size, stage, timeout=120):
        for kind, r in result.items():
            assert r["drift"] < 1e-5 and r["buffers"] < 1e-5 and r["state dict keys"], (kind, r)
