"""A load of the last background save reads this process's snapshot of it, not the files, when every
rank holds it for the same layout ([Note: save snapshots] in checkpoint/snapshot.py): the same
values as reading the files, to the bit; every other case reads the files."""

import os

import pytest
import torch

import flatshard
from _checkpoints import ADAMW, build, params_of, train
from flatshard.checkpoint import pieces, snapshot
from flatshard.toolkit.testing import run_distributed


class _CountedReads:
    """Counts the loads that read files (``pieces.load``)."""

    def __enter__(self) -> list[str]:
        self.real, self.reads = pieces.load, []

        def counted(state, path, **kwargs):
            self.reads.append(os.path.basename(path))
            return self.real(state, path, **kwargs)

        pieces.load = counted
        return self.reads

    def __exit__(self, *exc) -> None:
        pieces.load = self.real


def _values(model, opt) -> list[torch.Tensor]:
    """Every param (whole) and this rank's optimizer state tensors, copied."""
    out = params_of(model)
    for state in opt.inner.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _roll_back(root: str, stage: int, dtype) -> dict:
    """Save in the background at step 2, train 2 more steps while it writes, then roll back:
    from the snapshot, then (the snapshot dropped) from the files."""
    model, opt, sched = build(stage, ADAMW, dtype=dtype)
    train(model, opt, sched, range(2))
    path = os.path.join(root, f"s{stage}")
    flatshard.save_checkpoint(path, model, opt, extra={"step": 2, "sched": sched}, blocking=False)
    train(model, opt, sched, range(2, 4))
    with _CountedReads() as reads:
        extra = flatshard.load_checkpoint(path, model, opt, extra={"sched": sched})
        from_memory, epoch = _values(model, opt), sched.last_epoch
        after_memory = train(model, opt, sched, range(2, 3))
        snapshot.drop()
        flatshard.load_checkpoint(path, model, opt, extra={"sched": sched})
        from_files = _values(model, opt)
        after_files = train(model, opt, sched, range(2, 3))
    same = len(from_memory) == len(from_files) and all(map(torch.equal, from_memory, from_files))
    return {
        "reads": reads,
        "step": extra["step"],
        "epoch": epoch,
        "same": same and after_memory == after_files,
    }


@pytest.mark.parametrize(
    ("world_size", "stage", "dtype"),
    [(2, 0, None), (2, 2, None), (3, 1, torch.bfloat16), (3, 3, None), (1, 1, None)],
)
def test_rolling_back_to_the_last_background_save_reads_memory_as_the_files(
    world_size, stage, dtype, tmp_path
):
    for seen in run_distributed(_roll_back, world_size, str(tmp_path), stage, dtype, timeout=180):
        # (only the load after the snapshot was dropped read files)
        assert seen == {"reads": [f"s{stage}"], "step": 2, "epoch": 2, "same": True}, seen


def _elsewhere(root: str) -> dict:
    """Loads the snapshot cannot serve: another layout; a rank without one; a save
    after it (the copy is the newest save's); a blocking save (it stages nothing)."""
    model, opt, sched = build(2, ADAMW)
    train(model, opt, sched, range(2))
    first, second, third = (os.path.join(root, n) for n in ("first", "second", "third"))
    flatshard.save_checkpoint(first, model, opt, blocking=False)
    flatshard.wait_for_checkpoint()
    other, other_opt, _ = build(3, ADAMW)
    with _CountedReads() as reads:
        flatshard.load_checkpoint(first, other, other_opt)  # (stage 3: other entries)
        if torch.distributed.get_rank() == 1:
            snapshot.drop()
        flatshard.load_checkpoint(first, model, opt)  # (rank 1 has none: every rank reads)
        flatshard.save_checkpoint(second, model, opt, blocking=False)
        flatshard.load_checkpoint(first, model, opt)  # (the snapshot is second's now)
        flatshard.load_checkpoint(second, model, opt)  # (from memory)
        flatshard.save_checkpoint(third, model, opt)
        flatshard.load_checkpoint(third, model, opt)
    return {"reads": reads}


def test_a_load_the_snapshot_cannot_serve_reads_the_files_on_every_rank(tmp_path):
    for seen in run_distributed(_elsewhere, 2, str(tmp_path), timeout=180):
        assert seen["reads"] == ["first", "first", "first", "third"], seen
