"""Wrapping beyond the DDP grid, at every stage: control flow, dtypes, groups, ranks that
disagree at wrap time, errors, accounting."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import TinyMoE
from flatshard.engine.grad_view import ShardedGrad
from flatshard.toolkit.testing import RankError, run_distributed


class TwoPaths(nn.Module):
    """Rank-dependent control flow: ``branch`` is used only when asked for."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, use_branch):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).pow(2).mean()


def _divergent_control_flow(bucket_size):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TwoPaths()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(model, find_unused_parameters=True, buckets=flatshard.Buckets(size=bucket_size))
    out = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        use = (rank + step) % 2 == 0 if world > 1 else step == 0
        ref(x, use).backward()
        ours(x, use).backward()
        for (name, p), q in zip(ours.named_parameters(), ref.module.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
        out.append([p.grad is None for p in ours.parameters()])
        ours.zero_grad()
        ref.zero_grad()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("bucket_size", [None, 1])
def test_params_unused_on_some_ranks_do_not_hang_and_match_ddp(world_size, bucket_size):
    run_distributed(_divergent_control_flow, world_size, bucket_size, timeout=60)


def _zeroed_not_none(stage):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoPaths()  # (its branch never runs: no rank's backward reaches it)
    before = [p.detach().clone() for p in model.branch.parameters()]
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(model, stage=stage, find_unused_parameters=True)
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    ref_opt = torch.optim.SGD(ref.parameters(), **kwargs)
    opt = flatshard.DistributedOptimizer(ours, torch.optim.SGD, **kwargs)
    for o in (ref_opt, opt):  # (before any backward too: every .grad None stays None)
        o.zero_grad(set_to_none=False)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        for net, o in ((ref, ref_opt), (ours, opt)):
            net(x, False).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    ours.wait_for_params()
    with ours.summon_full_params(writeback=False):
        for (name, p), q in zip(ours.named_parameters(), ref.module.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        return [torch.equal(a, b) for a, b in zip(model.branch.parameters(), before, strict=True)]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_grad_keeping_tensors_leaves_a_param_without_a_grad_without_one(stage):
    """torch's zero_grad(set_to_none=False) zeroes the grads that exist and leaves None where
    there is none, so SGD with momentum and weight decay never moves a param no backward
    reached. At stage 0 flatshard handed every param a zeroed grad, so weight decay moved it."""
    for unmoved in run_distributed(_zeroed_not_none, 2, stage):
        assert unmoved == [True, True]


def _backward_after_step(stage):
    """The GAN mistake: a second backward through a graph recorded before the step."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = DDP(copy.deepcopy(net))
    ours = flatshard.shard(net, stage=stage)
    messages = []
    for model, opt in (
        (ref, torch.optim.SGD(ref.parameters(), lr=0.5)),
        (ours, flatshard.DistributedOptimizer(ours, torch.optim.SGD, lr=0.5)),
    ):
        out = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)))
        out.square().mean().backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
        try:
            out.mean().backward()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e).split(":")[0])
    return messages


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_backward_through_a_graph_recorded_before_the_step_raises_as_in_ddp(stage):
    """torch's optimizers update params in place, which autograd sees: a later backward
    through activations of the old values raises. flatshard's step writes flat buffers, which
    autograd did not see, so that backward ran and paired the new params with the old
    activations; the step now marks the params it changed."""
    for ddp, ours in run_distributed(_backward_after_step, 2, stage):
        assert ddp is not None and "modified by an inplace operation" in ddp
        assert ours == ddp


class _ActivationFirst(nn.Module):
    """Blocks small enough to merge into one stage-3 unit, the first without params (an
    activation in a ModuleList); ``skip`` leaves blocks out (LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x, skip=()):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = block(x)
        return self.head(x).square().mean()


def _layer_dropped_on_one_rank():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _ActivationFirst()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(model, stage=3, find_unused_parameters=True, timeout=20)
    assert any(len(u.modules) > 1 for u in ours.flatshard_state.unsharder.units)  # (merged)
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    opts = (
        torch.optim.SGD(ref.parameters(), **kwargs),
        flatshard.DistributedOptimizer(ours, torch.optim.SGD, **kwargs),
    )
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for net, opt in zip((ref, ours), opts, strict=True):
            net(x, skip=(1,) if rank == 0 else ()).backward()
            opt.step()
            opt.zero_grad()
    with ours.summon_full_params(writeback=False):
        pairs = zip(ours.parameters(), ref.module.parameters(), strict=True)
        return max((p - q).abs().max().item() for p, q in pairs)


def test_a_layer_dropped_on_one_rank_in_a_merged_unit_with_an_activation_follows_ddp():
    """LayerDrop on rank 0 in a stage-3 unit merged from an activation and two linears: the
    activation's output grad gathered the unit again after the linears' grads had freed it,
    on the rank that ran them all only, and the ranks hung. A member holding none of the
    unit's params no longer gathers for its backward."""
    for diff in run_distributed(_layer_dropped_on_one_rank, 2, timeout=90):
        assert diff < 1e-6, diff


def _bf16_grads_accumulate_in_fp32(world_size):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    ours = flatshard.shard(model, buckets=flatshard.Buckets(size=100))
    (buffer,) = ours.flatshard_state.sets["main"].buffers
    assert buffer.param_data.dtype == torch.bfloat16 and buffer.grad_data.dtype == torch.float32
    expected = [torch.zeros(p.shape) for p in plain.parameters()]
    for micro in range(3):  # two accumulated micro-batches, then a synced one
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + micro)).bfloat16()
        with ours.no_sync() if micro < 2 else torch.enable_grad():
            ours(x).float().square().mean().backward()
        plain(x).float().square().mean().backward()
        for e, p in zip(expected, plain.parameters(), strict=True):
            e += p.grad.float()
            p.grad = None
    for e in expected:
        dist.all_reduce(e)
        e /= world_size
    for p, e in zip(ours.parameters(), expected, strict=True):
        assert isinstance(p.grad, ShardedGrad), "16-bit params hold grads in main_grad; .grad stands for it"
        torch.testing.assert_close(p.main_grad, e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad.norm(), e.norm(), rtol=1e-5, atol=1e-6)
    ours.zero_grad()
    x = torch.randn(8, 16).bfloat16()
    ours(x).float().sum().backward()  # after zero_grad the sum restarts
    plain(x).float().sum().backward()
    local = [p.grad.float() for p in plain.parameters()]
    for t in local:
        dist.all_reduce(t)
        t /= world_size
    for p, e in zip(ours.parameters(), local, strict=True):
        torch.testing.assert_close(p.main_grad, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [1, 3])
def test_bf16_params_accumulate_fp32_main_grads(world_size):
    run_distributed(_bf16_grads_accumulate_in_fp32, world_size, world_size, timeout=60)


def _expert_params_reduce_over_their_group():
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    torch.manual_seed(0)
    model = TinyMoE()
    plain = copy.deepcopy(model)
    expert = flatshard.Experts(pair, lambda name, p: name.startswith("expert."), grad_scale=0.25)
    ours = flatshard.shard(model, expert=expert, buckets=flatshard.Buckets(size=1))
    assert set(ours.layouts) == {"main", "expert"} and ours.layouts["expert"].world_size == 2
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    ours(x).backward()
    plain(x).backward()
    # (an expert's .grad is a ShardedGrad even at stage 0: its norm spans the other experts)
    with ours.summon_full_params(with_grads=True):
        grads = {name: p.grad.clone() for name, p in ours.named_parameters()}
    for name, q in zip(grads, plain.parameters(), strict=True):
        g = q.grad.clone()
        if name.startswith("expert."):
            dist.all_reduce(g, group=pair)
            g *= 0.25
        else:
            dist.all_reduce(g)
            g /= 4
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_expert_params_get_their_own_group_and_scale():
    run_distributed(_expert_params_reduce_over_their_group, 4, timeout=60)


def _mismatched_models():
    width = 8 if dist.get_rank() == 0 else 9
    flatshard.shard(nn.Linear(width, 2))


def test_ranks_with_different_models_fail_at_wrap_time_naming_the_param():
    with pytest.raises(RankError, match=r"rank 1 has .*weight.*\(2, 9\).* where rank 0 has .*\(2, 8\)"):
        run_distributed(_mismatched_models, 2, timeout=60)


def _rank_dependent_option(stage: int, option: str, values: tuple) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    if option == "frozen":  # a frozen param on one rank only
        if dist.get_rank() == 1:
            model.add_module("extra", nn.Linear(2, 2).requires_grad_(False))
        flatshard.shard(model, stage=stage)
        return
    if option == "ignored_modules":  # a frozen layer replicated on one rank, sharded on the other
        model[0].requires_grad_(False)
        flatshard.shard(
            model,
            stage=stage,
            stage3=flatshard.Stage3(ignored_modules=[model[0]] if dist.get_rank() == 1 else None),
        )
        return
    value = values[dist.get_rank()]
    if option == "sync_module_states":
        options = {"sync_module_states": value}
    elif option == "pad_for_high_busbw":
        options = {"buckets": flatshard.Buckets(pad_for_high_busbw=value)}
    else:
        options = {"stage3": flatshard.Stage3(**{option: value})}
    flatshard.shard(model, stage=stage, **options)


@pytest.mark.parametrize(
    ("stage", "option", "values", "named"),
    [
        (2, "sync_module_states", (False, True), "sync_module_states=True"),
        (2, "pad_for_high_busbw", (False, True), "pad_for_high_busbw=True"),
        (3, "backward_prefetch", ("pre", "post"), "backward_prefetch=post"),
        (3, "forward_prefetch", (1, 2), "forward_prefetch=2"),
        (0, "frozen", None, r"frozen extra\.weight \(2, 2\) torch\.float32"),
        (3, "ignored_modules", None, r"frozen 0\.weight \(4, 4\) torch\.float32 replicated"),
    ],
)
def test_ranks_that_differ_in_an_option_that_changes_the_collectives_fail_at_wrap_time(
    stage, option, values, named
):
    """They used to hang until gloo's timeout, or abort steps later."""
    with pytest.raises(RankError, match=rf"ranks disagree on the main params: rank 1 has '{named}'"):
        run_distributed(_rank_dependent_option, 2, stage, option, values, timeout=60)


def _comm_accounting():
    torch.manual_seed(0)
    model = flatshard.shard(
        nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3)), buckets=flatshard.Buckets(size=20)
    )
    stats = model.comm_stats
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, 10)
    with model.no_sync():
        model(x).sum().backward()
    assert stats.total_wire_bytes == 0 and not stats.calls, "no_sync must not communicate"
    model(x).sum().backward()
    n_buckets = len(model.layouts["main"].buffers[0].buckets)
    return (
        dict(stats.calls),
        stats.payload_bytes["all_reduce"],
        stats.wire_bytes["all_reduce"],
        numel,
        n_buckets,
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bytes_moved_per_step_match_theory(world_size):
    calls, payload, wire, numel, n_buckets = run_distributed(_comm_accounting, world_size, timeout=60)[0]
    if world_size == 1:
        assert calls == {} and payload == 0
    else:
        assert calls == {"all_reduce": n_buckets} and n_buckets > 1
        assert payload == 4 * numel
        assert wire == sum(2 * (world_size - 1) * b // world_size for b in _bucket_bytes(numel, n_buckets))


def _bucket_bytes(numel, n_buckets):
    # the buckets of the two-layer model at bucket_size=20: recomputed from the layout
    layout = flatshard.plan_layout(
        [
            flatshard.ParamSpec(n, k, torch.float32, torch.float32)
            for n, k in [("0.weight", 100), ("0.bias", 10), ("1.weight", 30), ("1.bias", 3)]
        ],
        world_size=1,
        bucket_size=20,
        shard=False,
    )
    sizes = [4 * b.numel for b in layout.buffers[0].buckets]
    assert sum(sizes) == 4 * numel and len(sizes) == n_buckets
    return sizes


def _mesh_group_and_module_states():
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(rank)  # different init on every rank
    model = nn.Linear(4, 4)
    model.register_buffer("running", torch.full((2,), float(rank)))
    ours = flatshard.shard(model, group=mesh, sync_module_states=True)
    return ours.weight.detach().clone(), ours.running.clone()


def test_device_mesh_group_and_sync_module_states():
    results = run_distributed(_mesh_group_and_module_states, 3, timeout=60)
    for w, b in results:
        torch.testing.assert_close(w, results[0][0], rtol=0, atol=0)
        assert b.tolist() == [0.0, 0.0]


def _sum_of_token_losses():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    plain = copy.deepcopy(model)
    ours = flatshard.shard(model, grad_scale=1.0)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    ours(x).sum().backward()
    plain(x).sum().backward()
    g = plain.weight.grad.clone()
    dist.all_reduce(g)
    torch.testing.assert_close(ours.weight.grad, g)


def test_grad_scale_one_sums_instead_of_averaging():
    run_distributed(_sum_of_token_losses, 2, timeout=60)


def test_world_of_one_without_torch_distributed():
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    plain = copy.deepcopy(model)
    ours = flatshard.shard(model, buckets=flatshard.Buckets(size=1))
    x = torch.randn(6, 3)
    for _ in range(2):  # without zero_grad the grads accumulate, as in torch
        ours(x).sum().backward()
        plain(x).sum().backward()
    for p, q in zip(ours.parameters(), plain.parameters(), strict=True):
        assert p.grad is p.main_grad
        torch.testing.assert_close(p.grad, q.grad)
    ours.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in ours.parameters())


def test_params_are_views_into_the_flat_buffers_and_keep_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = model[0].bias.requires_grad_(False)
    ours = flatshard.shard(model, buckets=flatshard.Buckets(size=None))
    (buffer,) = ours.flatshard_state.sets["main"].buffers
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
        if p is frozen:
            assert not hasattr(p, "main_grad"), "frozen params stay out of the buffers"
        else:
            assert p.untyped_storage().data_ptr() == buffer.param_data.untyped_storage().data_ptr()
            assert p.main_grad.untyped_storage().data_ptr() == buffer.grad_data.untyped_storage().data_ptr()
    assert [n for n, _ in ours.named_parameters()] == list(before), "names are kept"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"stage": 5}, ValueError, "stage must be 0, 1, 2 or 3, got 5"),
        ({"grad_scale": -1.0}, ValueError, "grad_scale .* got -1.0"),
        ({"grad_scale": float("inf")}, ValueError, "grad_scale must be a positive finite number .* got inf"),
        ({"grad_scale": float("nan")}, ValueError, "grad_scale .* got nan"),
        ({"grad_scale": "abc"}, ValueError, "grad_scale .* got 'abc'"),
        ({"group": "world"}, TypeError, "group must be .* got str"),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        flatshard.shard(nn.Linear(2, 2), **kwargs)


def test_module_without_trainable_params_and_double_wrap_are_rejected():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="Linear has no parameter that requires grad"):
        flatshard.shard(frozen)
    wrapped = flatshard.shard(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already sharded"):
        flatshard.shard(wrapped)


def _wrap_case(stage: int, kind: str) -> str:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model = DDP(model) if kind == "ddp" else fully_shard(model)
    try:
        flatshard.shard(model, stage=stage)
    except TypeError as e:
        return str(e)
    return "wrapped"


def test_a_module_already_under_ddp_or_fsdp_is_refused():
    """At stage 0 a DDP-wrapped module used to train without its params ever changing."""
    for message in run_distributed(_wrap_case, 2, 0, "ddp") + run_distributed(_wrap_case, 1, 3, "ddp"):
        assert message.startswith("the module is already data-parallel (DistributedDataParallel)")
        assert "pass its .module" in message
    for message in run_distributed(_wrap_case, 2, 2, "fsdp"):
        assert message.startswith("the module is already data-parallel (FSDPSequential)")
    outer = nn.Sequential(nn.Linear(2, 2), nn.DataParallel(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"submodule '1' is already data-parallel \(DataParallel\)"):
        flatshard.shard(outer)


class ReusedUnderCheckpoint(nn.Module):
    """``shared`` is used inside a reentrant checkpoint and outside it, so its grad arrives
    twice in one backward (once per autograd graph task)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, self.first(x), use_reentrant=True)
        return self.shared(torch.tanh(h)).square().sum()


def _grad_arriving_twice(accumulate):
    torch.manual_seed(0)
    model = ReusedUnderCheckpoint()
    plain = copy.deepcopy(model)
    calls = []
    model.shared.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    ours = flatshard.shard(model, buckets=flatshard.Buckets(size=None))
    for micro in range(2 if accumulate else 1):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + micro))
        with ours.no_sync() if accumulate and micro == 0 else torch.enable_grad():
            ours(x).backward()
        plain(x).backward()
    assert len(calls) == (4 if accumulate else 2), "the test needs two grads per backward"
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        g = q.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(p.grad, g / dist.get_world_size(), msg=name)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_grad_arriving_twice_in_one_backward_is_summed_once_scaled(accumulate):
    run_distributed(_grad_arriving_twice, 2, accumulate, timeout=60)


def _sync_states_keeps_experts_distinct():
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    torch.manual_seed(rank)  # every rank starts different
    model = TinyMoE()
    expert = flatshard.Experts(pair, lambda name, p: name.startswith("expert."))
    ours = flatshard.shard(model, expert=expert, sync_module_states=True)
    return ours.router.weight.detach().clone(), ours.expert.weight.detach().clone()


def test_sync_module_states_takes_experts_from_their_own_group():
    (r0, e0), (r1, e1), (r2, e2), (r3, e3) = run_distributed(
        _sync_states_keeps_experts_distinct, 4, timeout=60
    )
    for r in (r1, r2, r3):
        torch.testing.assert_close(r, r0, rtol=0, atol=0)
    torch.testing.assert_close(e1, e0, rtol=0, atol=0)
    torch.testing.assert_close(e3, e2, rtol=0, atol=0)
    assert not torch.equal(e0, e2), "each expert group keeps its own experts"
