"""Ranks out of step end in a ``DesyncError`` naming where each rank is, within the deadline
([Note: deadlines] in ``comm/deadline.py``). Each case used to hang until the process
group's timeout (here the harness's 60 s, which would fail the run as a timeout)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import flatshard
from _launched import launched
from _parity import CFG
from flatshard.comm.collectives import choose_impl
from flatshard.comm.world import resolve_world
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT
from flatshard.toolkit.testing import run_distributed

DEADLINE = 2.0


def _out_of_step(stage: int, case: str, path: str) -> dict:
    """Three steps, except: ``extra_step`` rank 1 runs two (uneven inputs); ``skip_backward``
    rank 1 skips step 2's backward; ``save`` each rank saves at another step. Returns what
    happened on this rank."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = flatshard.shard(GPT(CFG), stage=stage, timeout=DEADLINE, buckets=flatshard.Buckets(size=3000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    steps = 2 if case == "extra_step" and rank == 1 else 3
    start = time.monotonic()
    try:
        for step in range(steps):
            loss = model(*corpus.batch(step, rank, 4))
            if not (case == "skip_backward" and rank == 1 and step == 1):
                loss.backward()
            if case == "save" and step == rank:
                flatshard.save_checkpoint(path, model, opt)
            opt.step()
            opt.zero_grad()
    except flatshard.DesyncError as e:
        return {"error": str(e), "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


@pytest.mark.parametrize("case", ["extra_step", "skip_backward", "save"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_out_of_step_raise_a_desync_error_naming_every_rank(stage, case, tmp_path):
    results = run_distributed(_out_of_step, 2, stage, case, str(tmp_path / "ckpt"), timeout=60)
    errors = [r["error"] for r in results if r["error"] is not None]
    assert errors, results  # no rank trains on as if nothing happened
    for r in results:
        assert r["after"] < DEADLINE + 3, results  # the deadline, plus reading the positions
    for error in errors:
        # (at stage 3 a rank that skips a backward meets the other's backward at the agreement
        # on its next forward: [Note: gather entries])
        agreed = r"is about to run a (forward|backward) .*at stage 3, but not every rank"
        assert re.search(rf"(did not complete within its deadline of 2 s|failed after \d|{agreed})", error), (
            error
        )
        assert "Where each rank is" in error, error
        # (rank 0 may have exited by the time the other reads positions: both raise at once at
        # stage 3's gather-entry agreement)
        assert re.search(r"rank 0: (step|exited)", error) and "rank 1: " in error, error
    if case == "extra_step":  # rank 1 left the loop: rank 0 is told so
        assert results[1]["error"] is None
        assert "rank 1: exited after 2 steps" in results[0]["error"], results[0]["error"]
        assert "rank 0: step 3, " in results[0]["error"]
    if case == "save":  # rank 0 saves in step 1 while rank 1 is still training in it
        assert all(r["error"] is not None for r in results), results
        assert "rank 0: step 1, save_checkpoint, waiting" in errors[1], errors[1]
        assert not (tmp_path / "ckpt").exists()


def _uneven_micro_batches() -> dict:
    """Stage 3, three steps of gradient accumulation: rank 1 runs one more no_sync
    micro-batch a step than rank 0 (each forward gathers at stage 3)."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = flatshard.shard(GPT(CFG), stage=3, timeout=DEADLINE)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    try:
        for step in range(3):
            for micro in range(2 + rank):
                with model.no_sync():
                    model(*corpus.batch(10 * step + micro, rank, 2)).backward()
            model(*corpus.batch(10 * step + 9, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
    except flatshard.DesyncError as e:
        return {"error": str(e)}
    return {"error": None}


def test_ranks_running_different_numbers_of_micro_batches_are_told_so():
    """Under no_sync each stage-3 forward still gathers, so a rank with one more micro-batch
    falls out of step. The error named positions only; it now says how many forwards each
    rank began in the step, and what to do."""
    results = run_distributed(_uneven_micro_batches, 2, timeout=60)
    errors = [r["error"] for r in results if r["error"] is not None]
    assert errors, results
    for error in errors:
        assert "the ranks began different numbers of forwards in this step" in error, error
        assert "give every rank the same number of micro-batches" in error, error


def _skip_a_backward(stage: int, native: bool) -> dict:
    """Rank 1 skips step 2's backward; what each rank's error says and the collectives'
    implementations this world chose (``native``: the backend's own reduce-scatter and
    all-gather, chosen in this rank: the harness's processes do not see the test's env)."""
    if native:
        os.environ["FLATSHARD_REDUCE_SCATTER"] = "reduce_scatter_tensor"
        os.environ["FLATSHARD_ALL_GATHER"] = "all_gather_into_tensor"
    result = _out_of_step(stage, "skip_backward", "")
    world = resolve_world(None)
    result["impls"] = [
        choose_impl(world, op, 4096, torch.device("cpu")) for op in ("reduce_scatter", "all_gather")
    ]
    return result


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("how", ["cpu:gloo", "native ops"])
def test_the_deadline_holds_for_a_per_device_backend_and_the_native_ops(stage, how):
    """A group made with ``"cpu:gloo"`` (the form of ``"cpu:gloo,cuda:nccl"``) takes gloo's
    implementations, and the native reduce-scatter and all-gather carry the deadline too:
    each case hung until the harness gave up (the native ops had no per-op timeout, and the
    backend string picked them for gloo; seen first with CUDA tensors over gloo on a GPU)."""
    native = how == "native ops"
    results = run_distributed(
        _skip_a_backward, 2, stage, native, backend="gloo" if native else how, timeout=60
    )
    errors = [r["error"] for r in results if r["error"] is not None]
    assert errors, results
    for r in results:
        assert r["after"] < DEADLINE + 3, results
    for error in errors:
        # (rank 0 may have exited by the time the other reads positions: both raise at once at
        # stage 3's gather-entry agreement)
        assert "Where each rank is" in error and re.search(r"rank 0: (step|exited)", error), error
        assert "rank 1: " in error, error
    expected = (
        ["all_to_all", "broadcast"]
        if how == "cpu:gloo"
        else ["reduce_scatter_tensor", "all_gather_into_tensor"]
    )
    assert results[0]["impls"] == expected


def _uneven(stage: int, batches: list[int]) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = flatshard.shard(GPT(CFG), stage=stage, timeout=DEADLINE, buckets=flatshard.Buckets(size=3000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    mine = [corpus.batch(step, rank, 4) for step in range(batches[rank])]
    steps = 0
    for x, y in flatshard.even_batches(mine, model):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    with model.summon_full_params() if stage == 3 else torch.no_grad():
        params = [p.detach().clone() for p in model.parameters()]
    return {"steps": steps, "params": params}


@pytest.mark.parametrize("stage", [0, 3])
def test_even_batches_stops_every_rank_at_the_shortest_ranks_end(stage):
    out = run_distributed(_uneven, 3, stage, [5, 3, 4], timeout=60)
    assert [r["steps"] for r in out] == [3, 3, 3]
    for r in out[1:]:  # and the ranks still agree on the params they trained
        assert all(torch.equal(a, b) for a, b in zip(r["params"], out[0]["params"], strict=True))


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "10", True])
def test_a_timeout_that_is_not_a_positive_duration_is_refused(bad):
    with pytest.raises(ValueError, match=rf"timeout must be a positive .* got {bad!r}"):
        flatshard.shard(torch.nn.Linear(2, 2), timeout=bad)


_RANK_0_DIES = """
import os, signal, sys, torch, torch.distributed as dist
import flatshard
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig
torch.set_num_threads(1)
rank, stage = int(os.environ["RANK"]), int(sys.argv[1])
dist.init_process_group("gloo")  # env://: rank 0 hosts the store, as without torchrun's agent
cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
torch.manual_seed(0)
model = flatshard.shard(GPT(cfg), stage=stage, buckets=flatshard.Buckets(size=3000), timeout=2.0)
opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
corpus = SyntheticCorpus(64, 16)
try:
    for step in range(3):
        if step == 1 and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # gone without a word: nothing published
        model(*corpus.batch(step, rank, 4)).backward()
        opt.step()
        opt.zero_grad()
except flatshard.DesyncError as e:
    print(e)
    sys.exit(3)
"""


def test_when_rank_0_dies_the_error_names_it(tmp_path):
    """Without torchrun's agent, rank 0 hosts the job's store, which the positions are read
    from: its death used to leave every rank 'no position published', naming nobody, and
    then rank 0 'unknown: the job's store does not answer'. (Stage 3: its first wait is a
    unit's gather; how each stage's waits give up is tested above, in the ranks kept.)"""
    port, procs = launched(_RANK_0_DIES, 2, "3")
    assert procs[0].returncode == -9
    assert procs[1].returncode == 3, procs[1].stderr
    error = procs[1].stdout
    assert "stopped answering: the process that hosts it, rank 0, has exited" in error, error
    assert "rank 0: gone: it hosts the job's store" in error, error  # (it said "rank 0: unknown")
    assert f"127.0.0.1:{port}" in error, error


def _stalls_inside_the_save(path: str) -> dict:
    """Rank 1 stalls where torch.distributed.checkpoint plans the save (as a SIGSTOPped rank
    would), after flatshard's own checks passed: rank 0 waits in DCP's collectives."""
    from flatshard.checkpoint import pieces

    torch.manual_seed(0)
    model = flatshard.shard(GPT(CFG), stage=1, timeout=DEADLINE, buckets=flatshard.Buckets(size=3000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    if dist.get_rank() == 1:
        plan = pieces.PieceSavePlanner.create_local_plan

        def stalled(self):
            time.sleep(3 * DEADLINE)
            return plan(self)

        pieces.PieceSavePlanner.create_local_plan = stalled
    start = time.monotonic()
    try:
        flatshard.save_checkpoint(path, model, opt)
    except (flatshard.DesyncError, flatshard.CheckpointError) as e:
        return {"error": f"{type(e).__name__}: {e}", "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


def test_a_rank_stalled_inside_a_save_is_a_desync_error_within_the_deadline(tmp_path):
    """DCP's own collectives used to wait for the process group's timeout (30 minutes)."""
    rank0, _ = run_distributed(_stalls_inside_the_save, 2, str(tmp_path / "ckpt"), timeout=60)
    assert rank0["error"] is not None and rank0["error"].startswith("DesyncError"), rank0
    assert "torch.distributed.checkpoint" in rank0["error"], rank0
    assert rank0["after"] < 2 * DEADLINE + 2, rank0
    assert not (tmp_path / "ckpt").exists()


def _gathers_alone(stage: int, call: str) -> dict:
    """Rank 0 alone gathers full params in step 2 (``summon_full_params``, with grads, or
    ``full_state_dict``): every other rank trains on, clipping as usual."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = flatshard.shard(GPT(CFG), stage=stage, timeout=DEADLINE, buckets=flatshard.Buckets(size=3000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    start = time.monotonic()
    try:
        for step in range(3):
            model(*corpus.batch(step, rank, 4)).backward()
            if step == 1 and rank == 0 and call == "full_state_dict":
                model.full_state_dict()
            elif step == 1 and rank == 0:
                with model.summon_full_params(with_grads=call == "with_grads"):
                    pass
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    except flatshard.DesyncError as e:
        return {"error": str(e), "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


@pytest.mark.parametrize(
    "stage, call, world_size", [(3, "summon_full_params", 3), (3, "full_state_dict", 2), (1, "with_grads", 2)]
)
def test_full_params_gathered_on_one_rank_are_a_desync_error(stage, call, world_size):
    """A gather of full params on one rank (a print of the weights under ``if rank == 0``)
    while the others train on: every rank raises within the deadline naming where each is
    (it was reported to end in gloo's SIGABRT, which kills the job with no word)."""
    results = run_distributed(_gathers_alone, world_size, stage, call, timeout=60)
    for r in results:
        assert r["error"] is not None and r["after"] < DEADLINE + 3, results
        assert "Where each rank is" in r["error"] and "rank 1: step 2" in r["error"], r["error"]
    where = "after backward" if call == "with_grads" else "gathering full params"
    assert f"rank 0: step 2, {where}" in results[0]["error"], results[0]["error"]


def _one_rank_gathers(call: str) -> str:
    """Rank 0 alone calls ``summon_full_params()`` or ``wait_for_params()`` at stage 3 after a
    step; the other trains on."""
    import datetime

    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    torch.manual_seed(0)
    model = flatshard.shard(GPT(CFG), stage=3, timeout=datetime.timedelta(seconds=30))
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    try:
        for step in range(3):
            if step == 1 and dist.get_rank() == 0:
                if call == "summon_full_params":
                    with model.summon_full_params():
                        pass
                else:
                    model.wait_for_params()
            x, y = corpus.batch(step, dist.get_rank(), 4)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    except flatshard.DesyncError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("call", ["summon_full_params", "wait_for_params"])
def test_one_rank_gathering_alone_at_stage_3_is_a_desync_error_on_every_rank(call):
    """The other rank died of gloo's SIGABRT ("Received data size doesn't match expected
    size") before any deadline: the two gathers differed in size ([Note: gather entries])."""
    messages = run_distributed(_one_rank_gathers, 2, call, timeout=120, reuse=False)
    for message in messages:
        assert "at stage 3, but not every rank of its data-parallel group is" in message, message
        # (both ranks raise at the agreement at once: either may have exited when the other reads)
        assert re.search(r"rank 0: (step 2|exited)", message) and "rank 1: " in message, message
    if call == "summon_full_params":
        assert messages[0].startswith("rank 0 is about to gather full params (summon_full_params)"), messages
    else:
        assert "rank 0 is about to run a forward with units [] gathered" in messages[0], messages
