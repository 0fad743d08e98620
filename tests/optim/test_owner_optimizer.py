"""OwnerShardedOptimizer: with torch DDP it takes exactly the plain optimizer's steps at
world sizes 1-4 (each param updated by its owner, then broadcast in buckets); ownership,
buckets, param groups added later, sharded and consolidated state dicts, clear errors."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, SGD, AwkwardGPT, decay_groups, max_rel_diff
from flatshard import OwnerShardedOptimizer
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import RankError, run_distributed

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_M = (SGD["optimizer_class"], SGD["opt_kwargs"])


def _step(pairs, step: int, scheds=()) -> list[float]:
    """One step of every (model, optimizer) pair on this rank's batch; their losses."""
    x, y = CORPUS.batch(step, dist.get_rank(), 4)
    losses = []
    for model, opt in pairs:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for sched in scheds:
        sched.step()
    return losses


def _params(model) -> list[torch.Tensor]:
    return list(getattr(model, "module", model).parameters())


def _equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(_params(a), _params(b), strict=True))


def _against_ddp_case(cls, kwargs, steps: int = 6, wrap: str = "ddp", **owner_kwargs) -> dict:
    torch.manual_seed(0)
    model = AwkwardGPT()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    if wrap == "ddp":
        ours = DDP(model, find_unused_parameters=True)
    else:
        ours = flatshard.shard(
            model, stage=0, find_unused_parameters=True, buckets=flatshard.Buckets(size=3000)
        )
    opt_ref = cls(decay_groups(reference.module), **kwargs)
    opt = OwnerShardedOptimizer(decay_groups(getattr(ours, "module", ours)), cls, **owner_kwargs, **kwargs)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in (opt_ref, opt)]
    out = {"equal": [], "diff": [], "losses": []}
    for step in range(steps):
        loss_ref, loss = _step([(reference, opt_ref), (ours, opt)], step, scheds)
        out["losses"].append((loss, loss_ref))
        out["equal"].append(_equal(ours, reference))
        out["diff"].append(
            max(max_rel_diff(p, q) for p, q in zip(_params(ours), _params(reference), strict=True))
        )
    out.update(
        broadcasts=opt.stats.calls["broadcast"],
        buckets=len(opt._order),
        steps=steps,
        owned_with_state=len(opt.state),
        reference_state=len(opt_ref.state),
        owned=sum(1 for g in opt.param_groups for p in g["params"] if opt.owner_of(p) == dist.get_rank()),
        loads=opt.owned_numel,
        largest=max(p.numel() for g in opt.param_groups for p in g["params"]),
        n_params=sum(len(g["params"]) for g in opt.param_groups),
    )
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(("cls", "kwargs"), [ADAMW, SGD_M], ids=["adamw", "sgd"])
def test_with_ddp_it_takes_the_plain_optimizers_steps_exactly(world_size, cls, kwargs):
    """Two param groups, a StepLR schedule, a frozen param and one without grads: every
    param on every rank equals DDP + the plain optimizer's after every step."""
    results = run_distributed(_against_ddp_case, world_size, cls, kwargs)
    for r in results:
        assert all(r["equal"]), r["diff"]
        assert all(a == b for a, b in r["losses"])
        # balanced: ranks own element counts within one param of each other
        assert max(r["loads"]) - min(r["loads"]) <= r["largest"]
    if world_size > 1:
        # state lives only with the owner: ranks' states partition the stepped params
        stepped = results[0]["reference_state"]
        assert sum(r["owned_with_state"] for r in results) == stepped
        assert all(r["owned_with_state"] < stepped for r in results)


@pytest.mark.parametrize(
    "owner_kwargs",
    [
        {"assignment": "round_robin"},
        {"bucket_cap_bytes": 0},
        {"bucket_cap_bytes": 4000, "overlap": False},
        {"assignment": "round_robin", "bucket_cap_bytes": 4000},
    ],
    ids=["round_robin", "per_param", "small_buckets_no_overlap", "round_robin_small_buckets"],
)
def test_assignments_and_bucketings_agree(owner_kwargs):
    results = run_distributed(_against_ddp_case, 3, *ADAMW, **owner_kwargs)
    for r in results:
        assert all(r["equal"]), r["diff"]
        assert r["broadcasts"] == r["buckets"] * r["steps"]  # one broadcast per bucket per step
        if owner_kwargs.get("bucket_cap_bytes") == 0:
            assert r["buckets"] == r["n_params"]
        elif "bucket_cap_bytes" not in owner_kwargs:
            assert r["buckets"] <= 3  # one bucket per owner at the default cap


def test_with_flatshard_stage_0():
    results = run_distributed(_against_ddp_case, 3, *SGD_M, wrap="flatshard")
    for r in results:
        assert max(r["diff"]) < 1e-5, r["diff"]


def _add_group_case() -> bool:
    """Start with the matrices only and add the 1-D params as a second group after two
    steps, on both sides."""
    torch.manual_seed(0)
    model = AwkwardGPT()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = DDP(model, find_unused_parameters=True)
    first, second = (decay_groups(m.module) for m in (reference, ours))
    opt_ref = torch.optim.AdamW([first[0]], **ADAMW[1])
    opt = OwnerShardedOptimizer([second[0]], torch.optim.AdamW, **ADAMW[1])
    equal = []
    for step in range(5):
        if step == 2:
            opt_ref.add_param_group(first[1])
            opt.add_param_group(second[1])
        _step([(reference, opt_ref), (ours, opt)], step)
        equal.append(_equal(ours, reference))
    return all(equal) and opt.param_groups[1]["betas"] == (0.9, 0.999)


def test_param_groups_added_after_construction():
    assert all(run_distributed(_add_group_case, 3))


def _state_dict_case() -> dict:
    """Sharded round trip (same ranks) and consolidated state into a plain AdamW and into
    a round-robin OwnerShardedOptimizer: all continue exactly as the uninterrupted run."""

    def build(seed, assignment="balanced"):
        torch.manual_seed(seed)
        model = DDP(AwkwardGPT(), find_unused_parameters=True)
        return model, OwnerShardedOptimizer(
            decay_groups(model.module), torch.optim.AdamW, assignment=assignment, **ADAMW[1]
        )

    model, opt = build(0)
    for step in range(3):
        _step([(model, opt)], step)
    weights = copy.deepcopy(model.module.state_dict())
    sharded = copy.deepcopy(opt.state_dict())
    full = opt.consolidate_state_dict(to=0)
    full_everywhere = [full]
    dist.broadcast_object_list(full_everywhere, src=0)
    full = full_everywhere[0]
    for step in range(3, 6):
        _step([(model, opt)], step)
    results = {}
    for name, assignment, state in (
        ("sharded", "balanced", sharded),
        ("consolidated", "round_robin", full),
    ):
        resumed, resumed_opt = build(1, assignment)
        resumed.module.load_state_dict(weights)
        resumed_opt.load_state_dict(copy.deepcopy(state))  # loading aliases its tensors, as torch's does
        for step in range(3, 6):
            _step([(resumed, resumed_opt)], step)
        results[name] = _equal(resumed, model)
    plain = DDP(AwkwardGPT(), find_unused_parameters=True)
    plain.module.load_state_dict(weights)
    plain_opt = torch.optim.AdamW(decay_groups(plain.module), **ADAMW[1])
    plain_opt.load_state_dict(copy.deepcopy(full))
    for step in range(3, 6):
        _step([(plain, plain_opt)], step)
    results["plain"] = _equal(plain, model)
    results["full_has_every_state"] = len(full["state"]) == len(plain_opt.state)
    with pytest.raises(ValueError, match="with another param ownership"):
        build(2, "round_robin")[1].load_state_dict(sharded)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_dicts_resume_exactly(world_size):
    for result in run_distributed(_state_dict_case, world_size):
        assert all(result.values()), result


def _disagreeing_case() -> None:
    torch.manual_seed(0)
    model = AwkwardGPT()
    params = list(model.parameters())
    if dist.get_rank() == 1:
        params = params[:-1]
    OwnerShardedOptimizer(params, torch.optim.SGD, lr=0.1)


def test_ranks_with_different_params_are_refused():
    with pytest.raises(RankError, match="ranks disagree on the params given to OwnerShardedOptimizer"):
        run_distributed(_disagreeing_case, 2)


def test_bad_arguments_name_the_value():
    params = list(AwkwardGPT().parameters())
    with pytest.raises(ValueError, match=r"assignment must be one of .* got 'greedy'"):
        OwnerShardedOptimizer(params, torch.optim.SGD, assignment="greedy", lr=0.1)
    with pytest.raises(ValueError, match="bucket_cap_bytes must be >= 0, got -1"):
        OwnerShardedOptimizer(params, torch.optim.SGD, bucket_cap_bytes=-1, lr=0.1)
    with pytest.raises(ValueError, match="to must be a rank in"):
        OwnerShardedOptimizer(params, torch.optim.SGD, lr=0.1).consolidate_state_dict(to=1)


def _muon_case(steps: int = 4) -> list[bool]:
    """Muon over the 2-D weights (each rank steps the matrices it owns, whole) and AdamW over
    the rest, against DDP + the same two plain optimizers."""
    torch.manual_seed(0)
    model = AwkwardGPT()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = DDP(model, find_unused_parameters=True)

    def pair(m, muon_class):
        matrices = [p for p in m.parameters() if p.ndim == 2]
        rest = [p for p in m.parameters() if p.ndim != 2]
        return muon_class(matrices), torch.optim.AdamW(rest, lr=1e-2)

    plain = pair(reference.module, lambda ps: torch.optim.Muon(ps, lr=2e-2))
    owned = pair(ours.module, lambda ps: OwnerShardedOptimizer(ps, torch.optim.Muon, lr=2e-2))
    equal = []
    for step in range(steps):
        x, y = CORPUS.batch(step, dist.get_rank(), 4)
        for model_, opts in ((reference, plain), (ours, owned)):
            model_(x, y).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        equal.append(_equal(ours, reference))
    return equal


@pytest.mark.parametrize("world_size", [1, 3])
def test_muon_steps_whole_matrices_on_their_owners_exactly(world_size):
    """Muon orthogonalizes each matrix whole, so it needs whole params: owners give it that.
    Its construction used to fail on a 1-D probe tensor."""
    for equal in run_distributed(_muon_case, world_size):
        assert all(equal)
