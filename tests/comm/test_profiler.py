"""A ``torch.profiler`` trace names flatshard's communication ([Note: profiler ranges] in
``comm/trace.py``): each collective with its bytes and implementation, each wait, stage 3's
unit gathers and waits, and the optimizer step; with no profiler running there are none."""

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import flatshard
from _parity import TiedGPT
from flatshard.comm import trace
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed


def _traced_step(stage: int) -> list[str]:
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage, buckets=flatshard.Buckets(size=3000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = SyntheticCorpus(64, 16).batch(0, dist.get_rank(), 4)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        model.wait_for_params()
    return sorted({e.name for e in prof.events() if e.name.startswith("flatshard::")})


@pytest.mark.parametrize("stage", [2, 3])
def test_a_trace_names_each_collective_wait_and_unit(stage):
    for names in run_distributed(_traced_step, 2, stage):
        assert any(n.startswith("flatshard::reduce_scatter ") and " B (" in n for n in names), names
        assert any(n.startswith("flatshard::all_gather ") for n in names), names
        assert any(n.startswith("flatshard::wait reduce_scatter #") for n in names), names
        assert "flatshard::optimizer step" in names, names
        if stage == 3:
            assert any(n.startswith("flatshard::gather unit 1 (blocks.") for n in names), names
            assert any(n.startswith("flatshard::wait unit ") for n in names), names


def _traced_checkpoint(path: str) -> list[str]:
    model = flatshard.shard(TiedGPT(), stage=2)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = SyntheticCorpus(64, 16).batch(0, dist.get_rank(), 4)
    model(x, y).backward()
    opt.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        flatshard.save_checkpoint(path, model, opt, extra={"step": 1})
        flatshard.load_checkpoint(path, model, opt)
    return [e.name for e in prof.events() if e.name.startswith("flatshard::")]


def test_a_trace_names_each_step_of_a_save_and_a_load(tmp_path):
    """[Note: checkpoint pipelines]: each step once, in pipeline order."""
    steps = [f"flatshard::save {s}" for s in ("agree", "collect", "write", "seal")]
    steps += [f"flatshard::load {s}" for s in ("check", "read", "apply", "restore")]
    for names in run_distributed(_traced_checkpoint, 2, str(tmp_path / "ckpt")):
        assert [n for n in names if n in steps] == steps, names


def test_no_range_is_made_without_a_profiler():
    assert trace.span("all_gather {}", 3) is trace.span("wait {}", "x")  # (the shared no-op)
