"""The newest complete checkpoint under a directory ([Note: latest checkpoint] in
checkpoint/latest.py): what a restarted job resumes from."""

import os

import pytest

import flatshard
from _checkpoints import SGD, build, train
from flatshard.checkpoint.destination import MANIFEST, PARTIAL_MARK
from flatshard.toolkit.testing import run_distributed


def _saves(root: str) -> None:
    """Steps 1-3 saved as ``step-<n>`` (the last in the background), 1 step apart."""
    model, opt, sched = build(2, SGD)
    for step in (1, 2, 3):
        train(model, opt, sched, range(step - 1, step))
        path = os.path.join(root, f"step-{step}")
        flatshard.save_checkpoint(path, model, opt, extra={"step": step}, blocking=step != 3)
    flatshard.wait_for_checkpoint()


def _resume(root: str) -> int:
    """What a restarted job does: load the newest complete checkpoint; its step."""
    model, opt, _ = build(3, SGD)
    path = flatshard.latest_checkpoint(root)
    return flatshard.load_checkpoint(path, model, opt)["step"]


def test_a_restart_resumes_from_the_newest_complete_checkpoint_skipping_torn_and_unfinished_ones(tmp_path):
    root = str(tmp_path)
    assert flatshard.latest_checkpoint(root) is None  # (a first start: nothing to resume)
    assert flatshard.latest_checkpoint(tmp_path / "none yet") is None
    run_distributed(_saves, 2, root, timeout=120)
    assert flatshard.latest_checkpoint(root) == os.path.join(root, "step-3")
    assert run_distributed(_resume, 2, root, timeout=120) == [3, 3]
    # the newest torn (a file cut short), a newer save unfinished, something else beside them
    newest = os.path.join(root, "step-3")
    shard = max((os.path.join(newest, n) for n in os.listdir(newest)), key=os.path.getsize)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    os.makedirs(os.path.join(root, "step-4.partial"))
    open(os.path.join(root, "step-4.partial", PARTIAL_MARK), "w").close()
    os.makedirs(os.path.join(root, "logs"))
    with pytest.warns(UserWarning) as said:
        assert flatshard.latest_checkpoint(root) == os.path.join(root, "step-2")
    messages = [str(w.message) for w in said]
    assert any("step-4.partial" in m and "did not finish" in m for m in messages), messages
    assert any(newest in m and "bytes" in m for m in messages), messages
    assert run_distributed(_resume, 3, root, timeout=120) == [2, 2, 2]  # (a restart may have another size)
    assert os.path.isdir(newest)  # (skipped, not deleted)


def _made(root, name: str, mark: str, age_s: float) -> str:
    """A directory as a save leaves it (``mark``: its manifest, or the unfinished mark),
    written ``age_s`` seconds ago."""
    path = os.path.join(root, name)
    os.makedirs(path)
    for entry in ("__0_0.distcp", mark):
        with open(os.path.join(path, entry), "w") as f:
            f.write("x")
    when = 1_700_000_000 - age_s
    for entry in (os.path.join(path, mark), path):
        os.utime(entry, (when, when))
    return path


def test_pruning_keeps_the_newest_complete_checkpoints_and_any_save_that_may_be_in_flight(tmp_path):
    root = str(tmp_path)
    old_unfinished = _made(root, "step-0.partial", PARTIAL_MARK, 50)
    done = [_made(root, f"step-{n}", MANIFEST, 40 - 10 * n) for n in (1, 2, 3)]
    in_flight = _made(root, "step-4.partial", PARTIAL_MARK, 0)
    os.makedirs(os.path.join(root, "logs"))  # (not a save's: never touched)
    assert flatshard.prune_checkpoints(root, keep=2) == [done[0], old_unfinished]
    assert sorted(os.listdir(root)) == ["logs", "step-2", "step-3", "step-4.partial"]
    assert flatshard.prune_checkpoints(root, keep=2) == []
    assert flatshard.prune_checkpoints(root, keep=1) == [done[1]]
    assert os.listdir(in_flight) and os.listdir(done[2])
    assert flatshard.prune_checkpoints(tmp_path / "none yet", keep=1) == []
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="keep must be"):
            flatshard.prune_checkpoints(root, keep=bad)
