"""A save killed at any moment (SIGKILL of every writing process, or of one rank while a
background save is in flight) leaves a complete checkpoint: the previous one, or the new one
if it was already in place. Each save in the loop below writes params that all equal its
step, and a background save's loop sets them to the next step as soon as the call returns,
so a checkpoint that mixed two saves, or lost part of one, would show it.
(``benchmarks/kill_saves.py`` kills background saves at 50 random moments.)"""

import os
import shutil
import signal
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import flatshard
from flatshard.toolkit.testing import RankError, run_distributed


def _build():  # 8 x 4 MB of params, sharded at stage 2 with SGD + momentum state
    torch.manual_seed(0)
    model = flatshard.shard(nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(8)]), stage=2)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    model(torch.ones(2, 1000)).sum().backward()
    opt.step()  # creates the momentum buffers
    return model, opt


def _save_forever(path: str, blocking: bool) -> None:
    """A rank that saves in a loop until it is killed; it first writes its pid."""
    rank = torch.distributed.get_rank()
    with open(f"{path}.pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    model, opt = _build()
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        flatshard.save_checkpoint(path, model, opt, extra={"step": step}, blocking=blocking)
        if step == 1:
            flatshard.wait_for_checkpoint()
        if step == 1 and rank == 0:
            open(path + ".first", "w").close()


def _wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(0.001)


def _mid_write(path: str) -> bool:
    """A later save is writing its data files."""
    partial = path + ".partial"
    try:
        return any(
            n.endswith(".distcp") and os.path.getsize(os.path.join(partial, n)) for n in os.listdir(partial)
        )
    except FileNotFoundError:
        return False


def _kill_a_save(
    tmp_path, *, mid_write: bool = False, delay: float = 0.0, blocking: bool = True, kill=(0, 1)
) -> tuple[int, list[str]]:
    """Start two ranks saving in a loop; once the first save is complete, SIGKILL the ranks
    ``kill`` when a later save is writing its data files (``mid_write``) or after ``delay`` seconds.
    Returns the step the checkpoint then holds, and what was on disk. (The ranks fork from
    the suite's forkserver, torch and flatshard already imported, rather than from a new
    interpreter: ~8 s less a test.)"""
    path = str(tmp_path / "ckpt")
    outcome: list[BaseException] = []

    def ranks() -> None:
        try:
            run_distributed(_save_forever, 2, path, blocking, timeout=300)
        except BaseException as e:  # (killed ranks: a RankError is the expected end)
            outcome.append(e)

    thread = threading.Thread(target=ranks)
    thread.start()
    try:
        _wait_for(lambda: os.path.exists(path + ".first") or not thread.is_alive(), "the first save")
        assert thread.is_alive(), f"the saving ranks died on their own: {outcome}"
        if mid_write:
            _wait_for(lambda: _mid_write(path), "a save writing its data")
        time.sleep(delay)
    finally:
        for rank in kill:
            with open(f"{path}.pid{rank}") as f:
                os.kill(int(f.read()), signal.SIGKILL)
        thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], RankError), outcome
    on_disk = sorted(n for n in os.listdir(tmp_path) if ".pid" not in n)
    model, opt = _build()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*left complete by a save that was cut off")
        step = flatshard.load_checkpoint(path, model, opt)["step"]
    for name, p in model.named_parameters():
        assert torch.all(p == step), f"{name} mixes saves: not all {step} ({on_disk})"
    momentum = [s["momentum_buffer"] for s in opt.inner.state.values()]
    assert momentum and all(torch.isfinite(m).all() for m in momentum)
    flatshard.save_checkpoint(path, model, opt, extra={"step": step})  # the next save is not stuck
    assert flatshard.load_checkpoint(path, model, opt)["step"] == step
    return step, on_disk


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, blocking):
    step, on_disk = _kill_a_save(tmp_path, mid_write=True, blocking=blocking)
    assert "ckpt.partial" in on_disk and step >= 1


@pytest.mark.parametrize("delay", [0.05, 0.17, 0.31])
def test_a_save_killed_at_any_moment_leaves_a_complete_checkpoint(tmp_path, delay):
    _kill_a_save(tmp_path, delay=delay)


@pytest.mark.parametrize("delay", [0.05, 0.23])
def test_one_rank_killed_while_a_background_save_is_in_flight_leaves_a_complete_checkpoint(tmp_path, delay):
    """The other rank's writer is then in a collective with a dead peer: it fails (no
    hang), and what is on disk is still a whole checkpoint of one step."""
    _kill_a_save(tmp_path, delay=delay, blocking=False, kill=(1,))


class _Cut(Exception):
    pass


def _cut_after(monkeypatch, steps: int) -> None:
    """``os.unlink`` and ``os.rmdir`` fail from call ``steps`` on, as if the process died there."""
    done = [0]
    for name in ("unlink", "rmdir"):
        real = getattr(os, name)

        def cut(*args, _real=real, **kwargs):
            if done[0] == steps:
                raise _Cut
            done[0] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, cut)


@pytest.mark.parametrize("what", [".old", ".partial"])
def test_a_removal_cut_off_at_any_step_leaves_what_the_next_save_accepts(tmp_path, what):
    """The replaced checkpoint (``PATH.old``) and an unfinished save (``PATH.partial``) are
    deleted file by file; a kill between any two deletions used to leave a directory the next
    save refused as a user's (rmtree deleted ``flatshard.json`` or the partial mark first)."""
    from flatshard.checkpoint.destination import MANIFEST, PARTIAL_MARK, destination_problem, remove_saved

    path = str(tmp_path / "ckpt")
    model, opt = _build()
    flatshard.save_checkpoint(path, model, opt, extra={"step": 1})
    saved = sorted(os.listdir(path))
    mark = MANIFEST if what == ".old" else PARTIAL_MARK
    extra = [] if what == ".old" else [PARTIAL_MARK, ".metadata.tmp"]  # (DCP's index being written)
    steps = len(saved) + len(extra) + 1  # every file, then the directory
    for cut in range(steps):
        shutil.copytree(path, path + what)
        for name in extra:
            open(os.path.join(path + what, name), "w").close()
        with pytest.MonkeyPatch.context() as patch:
            _cut_after(patch, cut)
            with pytest.raises(_Cut):
                remove_saved(path + what, mark)
        assert os.path.isdir(path + what), cut
        assert destination_problem(path) is None, (cut, sorted(os.listdir(path + what)))
        flatshard.save_checkpoint(path, model, opt, extra={"step": cut})
        assert sorted(os.listdir(tmp_path)) == ["ckpt"], cut
        assert flatshard.load_checkpoint(path, model, opt)["step"] == cut
