"""A checkpoint is one save, whole or refused ([Note: never silent] in checkpoint/directory.py).

Each case here trained wrong or lost a checkpoint without a word before: two saves to one
path at once mixed their files; a piece file of another save of the same model, or two piece
files swapped, loaded as if nothing happened; ranks given different paths each reported
success; ranks given different checkpoints loaded them; a per-rank ``extra`` value came back
as another rank's.
"""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from _checkpoints import ADAMW, build, load_step_case, save_case, train
from flatshard import CheckpointError, ChecksumError, load_checkpoint, save_checkpoint, verify_checkpoint
from flatshard.checkpoint.destination import save_lock
from flatshard.toolkit.testing import run_distributed


def test_a_save_while_another_holds_the_path_is_refused_and_the_first_survives(tmp_path):
    path = str(tmp_path / "ckpt")
    save_case(path, 0, ADAMW)
    with save_lock(path, True) as problem:  # another save is under way
        assert problem is None
        model, opt, _ = build(0, ADAMW)
        with pytest.raises(FileExistsError, match=f"another save to {path} is in progress"):
            save_checkpoint(path, model, opt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the lock is gone with its holder
    assert verify_checkpoint(path)["checked"] > 0
    assert load_step_case(path) == 3
    save_checkpoint(path, model, opt, extra={"step": 7})  # free again
    assert load_step_case(path) == 7


def _race(path: str, seed: int, rounds: int) -> list[str]:
    """One job (of 2 ranks) saving its model to ``path`` again and again."""
    model, opt, _ = build(1, ADAMW, seed=seed)
    outcomes = []
    for step in range(rounds):
        try:
            save_checkpoint(path, model, opt, extra={"seed": seed, "step": step})
            outcomes.append("saved")
        except FileExistsError as e:
            assert f"another save to {path} is in progress" in str(e), e
            outcomes.append("refused")
    return outcomes


def _race_two_jobs(path: str, rounds: int) -> list[list[list[str]]]:
    with ThreadPoolExecutor(2) as pool:  # each thread launches one job's ranks
        jobs = [pool.submit(run_distributed, _race, 2, path, seed, rounds) for seed in (1, 2)]
        return [job.result(timeout=240) for job in jobs]


def test_two_jobs_saving_to_one_path_never_mix_their_files(tmp_path):
    """Two 2-rank jobs save different models to one path 6 times each, at once: each save
    either completes or is refused on every rank of its job, and what is left is one whole
    checkpoint of one of the two models (it used to fail to load, or mix both, 17 of 20)."""
    path = str(tmp_path / "ckpt")
    results = _race_two_jobs(path, 6)
    for job in results:
        assert job[0] == job[1]  # the ranks of a job agree on every outcome
    assert any(o == "saved" for job in results for o in job[0])
    verify_checkpoint(path)
    extra = _load_extra(path)
    model, _, _ = build(1, ADAMW, seed=extra["seed"])
    reference = [p.clone() for p in model.parameters()]
    loaded, opt, _ = build(1, ADAMW, seed=99)
    load_checkpoint(path, loaded, opt)
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), reference, strict=True))


def _load_extra(path: str) -> dict:
    model, opt, _ = build(1, ADAMW)
    return load_checkpoint(path, model, opt)


def _two_saves(tmp_path, world_size: int) -> tuple[str, str]:
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run_distributed(save_case, world_size, first, 1, ADAMW)
    run_distributed(save_case, world_size, second, 1, ADAMW)  # the same model, the same values
    return first, second


def _load_error(path: str) -> str:
    model, opt, _ = build(1, ADAMW)
    try:
        load_checkpoint(path, model, opt)
    except ValueError as e:  # (CheckpointError and ChecksumError are ValueErrors)
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _fit_manifest_sizes(path: str) -> None:
    """Make the manifest's file sizes what is on disk: the case of files of equal size, where
    sizes tell nothing."""
    with open(os.path.join(path, "flatshard.json")) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        manifest["files"][name] = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(path, "flatshard.json"), "w") as f:
        json.dump(manifest, f)


def test_a_piece_file_of_another_save_is_refused_naming_it(tmp_path):
    """Two saves of one model with equal params: a piece file of one put in the other is an
    error naming it, even where its size fits."""
    first, second = _two_saves(tmp_path, 2)
    name = "__1_0.distcp"
    shutil.copy(os.path.join(second, name), os.path.join(first, name))
    _fit_manifest_sizes(first)
    with pytest.raises(ChecksumError, match=f"{first}/{name}.*another save"):
        verify_checkpoint(first)
    for error in run_distributed(_load_error, 2, first):
        assert error.startswith("ChecksumError") and name in error and "another save" in error


def test_two_piece_files_of_one_save_swapped_are_refused(tmp_path):
    """Files swapped, with the manifest's sizes made to fit (as two files of equal size would):
    every item's checksum is bound to its key and offset, so none reads as another."""
    path = str(tmp_path / "ckpt")
    run_distributed(save_case, 2, path, 1, ADAMW)
    a, b = (os.path.join(path, f"__{rank}_0.distcp") for rank in (0, 1))
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    _fit_manifest_sizes(path)
    with pytest.raises(ChecksumError, match="another save"):
        verify_checkpoint(path)
    for error in run_distributed(_load_error, 3, path):
        assert error.startswith("ChecksumError") and "distcp" in error


def _save_to_own_path(root: str) -> str:
    model, opt, _ = build(1, ADAMW)
    try:
        save_checkpoint(os.path.join(root, f"rank{dist.get_rank()}"), model, opt)
    except ValueError as e:
        return str(e)
    return "saved"


def test_ranks_given_different_paths_for_one_save_are_refused_before_writing(tmp_path):
    for message in run_distributed(_save_to_own_path, 2, str(tmp_path)):
        assert "ranks disagree on the checkpoint path of one save" in message
        assert "rank1" in message and "rank0" in message
    assert os.listdir(tmp_path) == []


def _load_own(first: str, second: str) -> str:
    return _load_error(first if dist.get_rank() == 0 else second)


def test_ranks_given_different_checkpoints_to_load_are_refused(tmp_path):
    first, second = _two_saves(tmp_path, 2)
    for message in run_distributed(_load_own, 2, first, second):
        assert message.startswith("ValueError: ranks disagree on which checkpoint to load"), message
        # (it named the two save ids only)
        assert f"{os.path.abspath(first)} on ranks [0]; {os.path.abspath(second)} on ranks [1]" in message


def _per_rank_extra(path: str, save: bool) -> dict:
    model, opt, sched = build(1, ADAMW)
    rank = dist.get_rank()
    if save:
        train(model, opt, sched, range(2))
        save_checkpoint(path, model, opt, extra={"position": 100 + rank, "step": 2, "sched": sched})
        return {}
    try:
        return load_checkpoint(path, model, opt, extra={"sched": sched})
    except CheckpointError as e:
        return {"error": str(e)}


def test_per_rank_extra_values_come_back_to_their_own_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_per_rank_extra, 3, path, True)
    loaded = run_distributed(_per_rank_extra, 3, path, False)
    assert [extra["position"] for extra in loaded] == [100, 101, 102]  # each its own, not rank 0's
    assert all(extra["step"] == 2 for extra in loaded)
    for extra in run_distributed(_per_rank_extra, 2, path, False):  # no rank here is a saved rank
        assert "extra['position'] differs between the 3 saved ranks" in extra["error"]
        assert "this job has 2 ranks" in extra["error"]


def _shared_extra(path: str, save: bool):
    model, opt, sched = build(1, ADAMW)
    if save:
        save_checkpoint(path, model, opt, extra={"step": 5, "sched": sched, "t": torch.arange(3)})
        return None
    return load_checkpoint(path, model, opt, extra={"sched": sched})


def test_extra_values_every_rank_shares_load_at_any_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_shared_extra, 3, path, True)
    for extra in [*run_distributed(_shared_extra, 2, path, False), _shared_extra(path, False)]:
        assert extra["step"] == 5 and torch.equal(extra["t"], torch.arange(3))


def test_a_user_file_named_like_the_lock_refuses_the_save_and_stays(tmp_path):
    path = str(tmp_path / "ckpt")
    with open(path + ".lock", "w") as f:
        f.write("my notes")
    model, opt, _ = build(0, ADAMW)
    with pytest.raises(FileExistsError, match=f"{path}.lock exists and is not a flatshard save lock"):
        save_checkpoint(path, model, opt)
    with open(path + ".lock") as f:
        assert f.read() == "my notes"
    assert sorted(os.listdir(tmp_path)) == ["ckpt.lock"]


def _disk_fills_on_rank_1(path: str) -> dict:
    """The second save runs out of disk on rank 1, mid-write."""
    import errno

    from torch.distributed.checkpoint import filesystem

    model, opt, sched = build(1, ADAMW)
    train(model, opt, sched, range(2))
    save_checkpoint(path, model, opt, extra={"step": 2})
    train(model, opt, sched, range(2, 3))
    if dist.get_rank() == 1:

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", "__1_0.distcp")

        filesystem._write_item = full
    try:
        save_checkpoint(path, model, opt, extra={"step": 3})
    except CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}


def test_a_disk_full_mid_save_is_named_and_the_previous_checkpoint_stays(tmp_path):
    path = str(tmp_path / "ckpt")
    for result in run_distributed(_disk_fills_on_rank_1, 2, path):
        assert result["error"] is not None
        assert "saving" in result["error"] and "rank(s) [1]" in result["error"], result
        assert "No space left on device" in result["error"], result
    assert verify_checkpoint(path)["checked"] > 0
    assert load_step_case(path) == 2  # the previous checkpoint, whole


def test_a_save_over_a_link_to_a_checkpoint_replaces_the_link_and_keeps_its_target(tmp_path):
    """The link is what this library replaces; the checkpoint it points to was written
    elsewhere and stays (the save used to succeed and then raise, leaving ``PATH.old``)."""
    target, path = str(tmp_path / "elsewhere"), str(tmp_path / "ckpt")
    save_case(target, 0, ADAMW)
    os.symlink(target, path, target_is_directory=True)
    model, opt, _ = build(0, ADAMW)
    save_checkpoint(path, model, opt, extra={"step": 7})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "elsewhere"]
    assert not os.path.islink(path)
    assert load_step_case(path) == 7 and load_step_case(target) == 3
