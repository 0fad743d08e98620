"""The device budget ([Note: device budget] in ``planner/budget.py``): the least offload that
fits, the bytes it plans equal to what a run holds, and a budget nothing fits refused by name."""

import itertools
import json

import pytest
import torch

import flatshard
from flatshard.planner.budget import fit_budget, in_flight_bytes
from flatshard.planner.plan import plan_from_specs
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig
from flatshard.toolkit.testing import run_distributed
from flatshard.wrap.specs import model_specs

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)


def _specs(dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    with torch.device("meta"):
        meta = GPT(CFG).to(dtype)
    return model_specs(meta), model_specs(meta, stage=3, unit_bytes=None)


def _fit(budget: int, stage: int, world: int = 2, rank: int = 0, dtype=torch.float32):
    specs, stage3 = _specs(dtype)
    return fit_budget(
        budget, specs, stage=stage, world_size=world, bucket_size=3000, rank=rank, stage3_specs=stage3
    )


def _extent(fit) -> float:
    """How much a decision offloads: its share, or at stage 3 the units it sends (all: inf)."""
    if fit.stage < 3 or fit.share == 0.0:
        return fit.share
    return float("inf") if fit.units is None else len(fit.units)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_decision_is_the_least_offload_that_fits(stage):
    """Budgets from generous to tight: nothing offloaded while it fits, then shares that grow
    as the budget shrinks (at stage 3: more units, each list the one before and one more),
    then all of the optimizer; below that, an error."""
    specs, stage3 = _specs()
    kwargs = {"world_size": 2, "bucket_size": 3000, "stage3_specs": stage3}
    base = plan_from_specs(specs, **kwargs)[stage]
    full = plan_from_specs(specs, offload=True, **kwargs)[stage]
    in_flight = _fit(10**9, stage).in_flight
    assert _fit(base.device + in_flight, stage).share == 0.0
    shares, units = [], []
    step = max(1, (base.device - full.device) // 40)  # (40 budgets between the two)
    for budget in range(base.device + in_flight - 1, full.device + in_flight - 1, -step):
        fit = _fit(budget, stage)
        assert fit.device_peak <= budget < base.device + in_flight
        shares.append(_extent(fit))
        units.append(fit.units)
    assert shares == sorted(shares) and shares[-1] in (1.0, float("inf")) and 0 < shares[0] < 1 + (stage == 3)
    if stage == 3:  # (units leave in one order: each decision holds the one before)
        lists = [u for u in units if u is not None]
        assert len(set(lists)) > 1 and all(a <= b for a, b in itertools.pairwise(lists))
    # (at stage 3 all of it offloaded leaves nothing of the model state on the device: below
    # that is below the units in flight, [Note: memory tiers])
    needs = f"stage {stage} needs {full.device + in_flight} bytes" if stage < 3 else "before any model state"
    assert (full.device == 0) == (stage == 3), full
    with pytest.raises(ValueError, match=needs):
        _fit(full.device + in_flight - 1, stage)


def test_a_budget_below_one_unit_is_refused_naming_it():
    """Stage 3 holds two of its largest unit in full at the peak (and the root unit): a budget
    below that is refused naming the unit and the bytes it needs, whatever is offloaded."""
    _, stage3 = _specs()
    total, unit, unit_bytes = in_flight_bytes(stage3)
    block = [s for s in stage3 if s.unit == unit]
    assert unit_bytes == sum(s.numel * 8 for s in block)  # (fp32 params and fp32 grads)
    with pytest.raises(ValueError, match=f"unit {unit} needs {unit_bytes} bytes in full") as e:
        _fit(total - 1, 3)
    assert "split the unit" in str(e.value)


def _planned_against_run(stage: int, fraction: float) -> tuple:
    """The plan of a budget ``fraction`` of the way from what all of the optimizer offloaded
    needs to what nothing offloaded does, and what a run with the decided ``Offload`` holds
    after a step (``memory_report``), on this rank."""
    specs, stage3 = _specs()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    kwargs = {"world_size": world, "bucket_size": 3000, "rank": rank, "stage3_specs": stage3}
    base = plan_from_specs(specs, **kwargs)[stage]
    full = plan_from_specs(specs, offload=True, **kwargs)[stage]
    budget = full.device + int(fraction * (base.device - 1 - full.device))
    fit = fit_budget(budget, specs, stage=stage, **kwargs)
    offload = {"offload": flatshard.Offload(optimizer=fit.share)} if fit.share else {}
    torch.manual_seed(0)
    model = flatshard.shard(GPT(CFG), stage=stage, buckets=flatshard.Buckets(size=3000), **offload)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(*SyntheticCorpus(64, 16).batch(0, rank, 4)).backward()
    opt.step()
    report = flatshard.memory_report(model, opt)
    return fit.share, (fit.plan.device, report.device), (fit.plan.host, report.host)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_planned_bytes_are_what_a_run_holds(stage):
    """Budgets that need a share of the optimizer and all of it, on 3 ranks (uneven shards):
    the device and host bytes the plan gives equal ``memory_report`` of the run with the
    decided ``Offload``, on every rank."""
    for fraction in (0.9, 0.5, 0.0):
        for share, device, host in run_distributed(_planned_against_run, 3, stage, fraction):
            assert 0 < share <= 1
            assert device[0] == device[1] and host[0] == host[1], (fraction, share, device, host)


def test_flatshard_plan_prints_each_stage_decision(capsys):
    from flatshard.app.cli import main

    assert main(["plan", "--model", "tiny", "-n", "2", "--device-budget", "300000", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages["2"]["fits"] and stages["2"]["share"] == 0.0
    assert stages["1"]["fits"] and 0 < stages["1"]["share"] < 1 and stages["1"]["device_peak"] <= 300000
    assert not stages["3"]["fits"] and "needs" in stages["3"]["why"]
    assert main(["plan", "--model", "tiny", "--device-budget", "300000", "--offload"]) == 2
    streamed = ["plan", "--model", "tiny", "-n", "2", "--device-budget", "300000", "--offload", "device"]
    assert main([*streamed, "--json"]) == 0  # ([Note: streamed step]: all of it or none below stage 3)
    one_chunk = json.loads(capsys.readouterr().out)["stages"]["1"]  # (the whole optimizer in one chunk)
    assert not one_chunk["fits"] and "streamed step's chunks" in one_chunk["why"], one_chunk
    assert (
        main([*streamed, "--stream-chunk", "2000", "--bucket-size", "3000", "--json"]) == 0
    )  # (runs < 2000)
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages["1"]["fits"] and stages["1"]["share"] == 1.0 and stages["1"]["staging"] > 0, stages["1"]
    assert stages["1"]["device_peak"] <= 300000
    assert main(["plan", "--model", "tiny", "--stream-chunk", "2000"]) == 2


def _train_offloaded(stage: int, offload: flatshard.Offload | None) -> tuple:
    """Two AdamW steps of the GPT sharded with ``offload``: (the optimizer's decided
    ``Offload``, ``memory_report``'s device bytes after them, the full state dict)."""
    torch.manual_seed(0)
    unmerged = flatshard.Stage3(unit_bytes=None) if stage == 3 else None  # (a unit a block: a choice)
    model = flatshard.shard(
        GPT(CFG), stage=stage, buckets=flatshard.Buckets(size=3000), offload=offload, stage3=unmerged
    )
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    corpus, rank = SyntheticCorpus(64, 16), torch.distributed.get_rank()
    for step in range(2):
        model(*corpus.batch(step, rank, 4)).backward()
        opt.step()
        opt.zero_grad()
    model.wait_for_params()
    staging = 0 if opt._streamed is None else opt._streamed.staging  # ([Note: streamed step])
    return opt.offload, (flatshard.memory_report(model, opt).device, staging), model.full_state_dict()


def _budgeted(stage: int, fraction: float, step: str) -> tuple:
    """A run with ``Offload(device_budget=B, step=step)``, B ``fraction`` of the way between
    what all of the optimizer offloaded and nothing offloaded need on the most loaded rank,
    beside the same run given the share it decided by hand; streamed, a step's chunks count at
    its peak."""
    with torch.device("meta"):
        specs = model_specs(GPT(CFG), stage=stage, unit_bytes=None)  # (as shard lays them out)
    world = torch.distributed.get_world_size()
    kwargs = {"world_size": world, "bucket_size": 3000, "stage3_specs": specs}
    base = max(plan_from_specs(specs, rank=r, **kwargs)[stage].device for r in range(world))
    streamed = {"streamed": step == "device", "stream_chunk": 700}
    alls = [plan_from_specs(specs, rank=r, offload=True, **kwargs, **streamed)[stage] for r in range(world)]
    in_flight = in_flight_bytes(specs)[0] if stage == 3 else 0
    full, peak = max(p.device for p in alls), max(max(in_flight, p.staging) for p in alls)
    budget = full + int(fraction * (base - 1 - full)) + peak
    offload = flatshard.Offload(device_budget=budget, step=step, stream_chunk=streamed["stream_chunk"])
    decided, (device, staging), values = _train_offloaded(stage, offload)
    by_hand = _train_offloaded(stage, decided)[2]
    same = all(torch.equal(values[k], by_hand[k]) for k in values)
    chosen = (0.0, None) if decided is None else (decided.fraction, decided.units)
    return chosen, device + max(in_flight, staging) <= budget, same


@pytest.mark.parametrize(("stage", "step"), [(1, "host"), (3, "host"), (1, "device"), (3, "device")])
def test_a_device_budget_given_to_shard_is_met(stage, step):
    """``shard(..., offload=Offload(device_budget=B))`` on 3 ranks: the optimizer takes the
    least offload that fits on every rank (a share, at stage 3 some units, then all of it as
    the budget shrinks), the device holds no more than B after the steps (stage 3: with the
    units in full at the peak added), and the run equals the one given that decision by
    hand, bit for bit. Streamed to the device ([Note: streamed step]): below stage 3 all of the
    optimizer or none, and the step's two chunks within the budget too."""
    for fraction, expected in ((0.6, "some"), (0.0, "all")):
        results = run_distributed(_budgeted, 3, stage, fraction, step)
        assert all(fits and same for _, fits, same in results), results
        decisions = {decided for decided, _, _ in results}
        assert len(decisions) == 1  # (every rank decides the same, without a word between them)
        share, units = decisions.pop()
        if expected == "all":
            assert share == 1.0 and units is None, (fraction, share, units)
        elif stage == 3:  # (units, by name: [Note: unit homes])
            assert share == 1.0 and units and all(u.startswith("blocks.") or u == "" for u in units), units
        elif step == "device":  # (a streamed step takes all of the optimizer or none)
            assert share in (0.0, 1.0) and units is None, (fraction, share)
        else:
            assert 0 < share < 1 and units is None, (fraction, share)


def _refusals() -> list[str]:
    out = []
    for budget, cls in ((10**9, torch.optim.RMSprop), (1000, torch.optim.AdamW)):
        model = flatshard.shard(GPT(CFG), stage=3, offload=flatshard.Offload(device_budget=budget))
        try:
            flatshard.DistributedOptimizer(model, cls, lr=1e-2)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_a_budget_that_cannot_be_met_is_refused_when_the_optimizer_is_built():
    """An optimizer whose state the planner does not know, a budget below stage 3's units in
    full: each a ValueError naming it; a budget beside a share is refused at once."""
    ((unknown, small),) = run_distributed(_refusals, 1)
    assert "RMSprop" in unknown and "Offload(optimizer=...)" in unknown
    assert "unit 'blocks." in small and "needs" in small and "device budget 1000 bytes" in small  # (by name)
    with pytest.raises(ValueError, match="not both"):
        flatshard.Offload(optimizer=0.5, device_budget=10**9)
    with pytest.raises(ValueError, match="positive number of bytes"):
        flatshard.Offload(device_budget=0)
