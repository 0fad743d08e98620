"""Saves in the background ([Note: background saves] in checkpoint/background.py): what they
write is the step they were called at, whatever the loop does while they write; one at a time;
a failure on one rank leaves no checkpoint and is raised on every rank."""

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import flatshard
from _checkpoints import ADAMW, build, saved_entries, train
from _launched import launched
from flatshard.checkpoint import pieces, snapshot
from flatshard.checkpoint.directory import read_manifest
from flatshard.toolkit.testing import run_distributed


class _Gate:
    """Holds every write of pieces (``pieces.save``) until opened: a background save is then
    still writing while the loop runs on, whatever the machine's speed."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.real = pieces.save

    def __enter__(self) -> "_Gate":
        def held(*args, **kwargs):
            assert self.open.wait(120), "the gate was never opened"
            return self.real(*args, **kwargs)

        pieces.save = held
        return self

    def __exit__(self, *exc) -> None:
        self.open.set()
        pieces.save = self.real


def _both_ways(root: str, stages: list[int], dtype=None) -> dict:
    """At each stage: 2 steps, a blocking save to ``b<stage>`` and one in the background to
    ``a<stage>``, held until 2 more steps have changed every param and moment."""
    seen = {}
    for stage in stages:
        model, opt, sched = build(stage, ADAMW, dtype=dtype)
        train(model, opt, sched, range(2))
        blocking, background = (os.path.join(root, f"{k}{stage}") for k in "ba")
        extra = {"step": 2, "sched": sched}
        flatshard.save_checkpoint(blocking, model, opt, extra=extra)
        with _Gate() as gate:
            flatshard.save_checkpoint(background, model, opt, extra=extra, blocking=False)
            returned_first = not os.path.exists(background)
            train(model, opt, sched, range(2, 4))
            gate.open.set()
            flatshard.wait_for_checkpoint()
        extra = flatshard.load_checkpoint(background, model, opt, extra={"sched": sched})
        seen[stage] = {"returned first": returned_first, "step": extra["step"], "epoch": sched.last_epoch}
    return seen


@pytest.mark.parametrize(
    ("world_size", "stages", "dtype"), [(2, [0, 1, 2, 3], None), (3, [3], torch.bfloat16), (1, [2], None)]
)
def test_a_save_in_the_background_writes_the_step_it_was_called_at(world_size, stages, dtype, tmp_path):
    """Bit for bit what a blocking save at the same point writes (every param, main param and
    moment), though the next two steps ran while it waited to write; the call returned before
    anything was written; its ``extra`` loads back as it was then (the scheduler at epoch 2,
    not 4)."""
    results = run_distributed(_both_ways, world_size, str(tmp_path), stages, dtype, timeout=240)
    for rank in results:
        for stage, seen in rank.items():
            assert seen == {"returned first": True, "step": 2, "epoch": 2}, (stage, seen)
    for stage in stages:
        blocking, background = (saved_entries(str(tmp_path / f"{k}{stage}")) for k in "ba")
        assert blocking.keys() == background.keys() and any(k.startswith("state/") for k in blocking)
        for key, value in blocking.items():
            assert torch.equal(value, background[key]), (stage, key)


def _one_at_a_time(root: str) -> bool:
    """A second save while the first is held: it waits for the first, which is then complete."""
    model, opt, sched = build(3, ADAMW)
    train(model, opt, sched, range(1))
    first, second = os.path.join(root, "first"), os.path.join(root, "second")
    with _Gate() as gate:
        flatshard.save_checkpoint(first, model, opt, blocking=False)
        threading.Timer(0.5, gate.open.set).start()
        flatshard.save_checkpoint(second, model, opt, blocking=False)
        first_done = os.path.exists(os.path.join(first, "flatshard.json"))
    flatshard.wait_for_checkpoint()
    return first_done and os.path.exists(os.path.join(second, "flatshard.json"))


def test_a_second_save_waits_for_the_one_in_flight(tmp_path):
    assert run_distributed(_one_at_a_time, 2, str(tmp_path), timeout=120) == [True, True]


def _fails_on_rank_1(path: str) -> dict:
    """A complete checkpoint at ``path``, then a background save there whose files rank 1
    cannot write; then a blocking save there again."""
    model, opt, sched = build(2, ADAMW)
    train(model, opt, sched, range(1))
    flatshard.save_checkpoint(path, model, opt)
    old_id = read_manifest(path)["save_id"]
    train(model, opt, sched, range(1, 2))
    writer, real = dcp.FileSystemWriter, dcp.FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    if torch.distributed.get_rank() == 1:
        writer.write_data = disk_full
    try:
        flatshard.save_checkpoint(path, model, opt, blocking=False)
        try:
            flatshard.wait_for_checkpoint()
            said = ""
        except flatshard.CheckpointError as e:
            said = str(e)
    finally:
        writer.write_data = real
    kept = read_manifest(path)["save_id"] == old_id
    flatshard.save_checkpoint(path, model, opt)  # (the lock was let go)
    return {"said": said, "kept": kept, "saved again": read_manifest(path)["save_id"] != old_id}


def test_a_save_that_fails_on_one_rank_leaves_no_checkpoint_and_every_rank_says_so(tmp_path):
    path = str(tmp_path / "ckpt")
    for rank, seen in enumerate(run_distributed(_fails_on_rank_1, 2, path, timeout=120)):
        assert seen["kept"] and seen["saved again"], (rank, seen)
        assert f"the background save to {path} failed" in seen["said"], (rank, seen["said"])
        assert "No space left on device" in seen["said"], (rank, seen["said"])
    assert not os.path.exists(path + ".lock")


def _blocking_on_rank_0_only(path: str) -> str:
    model, opt, _ = build(1, ADAMW)
    try:
        flatshard.save_checkpoint(path, model, opt, blocking=torch.distributed.get_rank() == 0)
    except ValueError as e:
        return str(e)
    return ""


def test_ranks_that_disagree_on_blocking_are_refused_before_anything_is_written(tmp_path):
    """One rank's writer would wait on a group the other never made: refused on both, naming
    each rank's choice, with nothing written."""
    for said in run_distributed(_blocking_on_rank_0_only, 2, str(tmp_path / "c"), timeout=120):
        assert "blocking=True" in said and "blocking=False" in said, said
    assert os.listdir(tmp_path) == []


def test_blocking_must_be_a_bool():
    with pytest.raises(TypeError, match="blocking must be True or False, got 'no'"):
        flatshard.save_checkpoint("/nonexistent", torch.nn.Linear(2, 2), blocking="no")


_SAVE_AND_EXIT = """
import os, sys, torch, torch.distributed as dist
import flatshard
from flatshard.toolkit.models import GPT, PRESETS
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = flatshard.shard(GPT(PRESETS["tiny"]), stage=3)
opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
if sys.argv[2:] == ["fail"] and dist.get_rank() == 1:  # (its disk is full)
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    import flatshard.checkpoint.pieces
    flatshard.checkpoint.pieces.save = full
flatshard.save_checkpoint(sys.argv[1], model, opt, extra={"rank": dist.get_rank()}, blocking=False)
print("returned", os.path.exists(sys.argv[1]))
"""


def test_a_script_that_ends_with_a_save_in_flight_leaves_it_complete(tmp_path):
    """A script run as torchrun runs it, whose last call is a save in the background: the
    interpreter's exit waits for the writer (not a daemon thread), so the checkpoint is whole."""
    path = str(tmp_path / "last")
    _, procs = launched(_SAVE_AND_EXIT, 2, path)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-3000:] for p in procs]
    assert all("returned" in p.stdout for p in procs)
    assert flatshard.verify_checkpoint(path)["files"] > 0
    assert read_manifest(path)["world_size"] == 2


def test_a_script_whose_last_save_fails_in_the_background_says_so_on_exit(tmp_path):
    """No call is left to raise the writer's failure: the exit reports it on every rank."""
    path = str(tmp_path / "last")
    _, procs = launched(_SAVE_AND_EXIT, 2, path, "fail")
    for p in procs:
        assert f"the background save to {path} failed" in p.stderr, p.stderr[-3000:]
    assert not os.path.exists(path)


def _joins_twice(root: str) -> list[int]:
    """A job that saves in the background, leaves the process group and joins a new one (a
    fresh store) in the same process, then saves in the background again: the writers' group
    of the first job is gone with it, and the second save makes its own."""
    steps = []
    for attempt in range(2):
        if attempt == 1:
            rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
            torch.distributed.destroy_process_group()
            store = f"file://{os.path.join(root, 'store')}"
            torch.distributed.init_process_group("gloo", init_method=store, rank=rank, world_size=size)
        model, opt, sched = build(2, ADAMW)
        train(model, opt, sched, range(attempt + 1))
        path = os.path.join(root, f"job{attempt}")
        flatshard.save_checkpoint(path, model, opt, extra={"step": attempt + 1}, blocking=False)
        flatshard.wait_for_checkpoint()
        snapshot.drop()  # (read the files)
        steps.append(flatshard.load_checkpoint(path, model, opt)["step"])
    return steps


def test_a_process_that_joins_a_new_group_saves_in_the_background_again(tmp_path):
    assert run_distributed(_joins_twice, 2, str(tmp_path), timeout=120, reuse=False) == [[1, 2], [1, 2]]
