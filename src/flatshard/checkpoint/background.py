"""Saves written in the background: this rank's part of a checkpoint copied into host buffers
kept for the next save, then written by a thread while training goes on ([Note: background
saves])."""

# [Note: background saves]
#
# ``save_checkpoint(..., blocking=False)`` runs a save's first two steps ([Note: checkpoint
# pipelines] in ``directory.py``) in the caller, **agree** and **collect**, and stages what it
# collected: every tensor (a piece of a param's or a main param's shard, an optimizer state
# entry, a quantized moment's codes) is copied into a host buffer this process keeps for the
# next save of the same entry (pinned where the tensor is on CUDA), every other value
# (``extra``, RNG states, param groups) deep-copied. Then it returns; a thread writes and
# seals. Invariants:
#
# * **The staged copy is one step's.** Collect waits for the params' gathers in flight (as a
#   blocking save does), and the copies are made before the call returns, so nothing the
#   loop does next (a step, a gather, a load into the model) reaches what is written: a save
#   in the background writes the files a blocking save at the same point writes, but for its
#   save id.
# * **Its collectives never meet the loop's.** The writer's barriers and DCP's collectives run
#   on a gloo group of their own over the same ranks, with the job's deadline, created by the
#   caller (group creation is collective, and must happen in the same order on every rank).
# * **At most one save in flight per process.** The next ``save_checkpoint`` or
#   ``load_checkpoint``, and ``wait_for_checkpoint()``, wait for it first; so does the
#   interpreter's exit (the writer is not a daemon thread). ``PATH.lock`` stays held by rank
#   0's writer until the checkpoint is sealed. A failed save that no call waited for before
#   the interpreter's exit is reported on stderr then.
# * **Visible only when complete, on every rank's word.** The writer runs the blocking save's
#   write and seal: DCP gathers every rank's write errors and raises them on every rank, and
#   rank 0 seals (manifest, rename into place) only after every rank's files are written. A
#   save that fails anywhere leaves no checkpoint at ``PATH`` (an older one stays), and the
#   next call above raises ``CheckpointError`` on every rank, naming the path and the cause.
#
# Staging costs host memory for one copy of the rank's part; it is the price of not stopping
# the loop for the write (DCP's ``async_save`` pays the same).

from __future__ import annotations

import atexit
import contextlib
import copy
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from flatshard.checkpoint import snapshot
from flatshard.checkpoint.pieces import Piece
from flatshard.comm.world import World, made_group
from flatshard.errors import CheckpointError

__all__ = ["stage", "start", "wait_for_checkpoint", "writer_world"]

_BUFFERS: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
_LOCK = threading.Lock()
_IN_FLIGHT: list[_Save] = []


class _Save:
    """One save being written: its thread, its path, and what went wrong, if anything."""

    def __init__(
        self, path: str, write: Callable[[], None], held: contextlib.ExitStack, snap: tuple[str, dict]
    ) -> None:
        self.path = path
        self.error: BaseException | None = None
        self._write, self._held, self._snap = write, held, snap
        self.thread = threading.Thread(target=self._run, name=f"flatshard-save {path}", daemon=False)

    def _run(self) -> None:
        try:
            with self._held:
                self._write()
            snapshot.take(*self._snap)  # (complete: what the files hold, [Note: save snapshots])
        except BaseException as e:  # (kept, raised by the caller's next call)
            self.error = e


def wait_for_checkpoint() -> None:
    """Wait for this process's save in the background, if one is in flight (every rank calls
    this, or the next ``save_checkpoint`` or ``load_checkpoint`` does it), and raise
    ``CheckpointError`` if it failed: no checkpoint was made at its path."""
    with _LOCK:
        saves, _IN_FLIGHT[:] = list(_IN_FLIGHT), []
    for save in saves:
        save.thread.join()
        if save.error is not None:
            raise CheckpointError(
                f"the background save to {save.path} failed, so no checkpoint was made there: "
                f"{type(save.error).__name__}: {save.error}"
            ) from save.error


@atexit.register
def _report_unwaited_failures() -> None:
    """At exit (after the interpreter waited for the writer threads), say on stderr that a
    save nobody waited for failed: no later call would raise it."""
    for save in _IN_FLIGHT:
        if save.error is not None:
            print(
                f"flatshard: the background save to {save.path} failed, so no checkpoint was made there: "
                f"{type(save.error).__name__}: {save.error}",
                file=sys.stderr,
                flush=True,
            )


def start(
    path: str, write: Callable[[], None], held: contextlib.ExitStack, save_id: str, staged: dict[str, Any]
) -> None:
    """Run ``write`` in a thread of its own, then close ``held`` (the save's lock); once it
    wrote save ``save_id``, its ``staged`` state is its snapshot ([Note: save snapshots])."""
    save = _Save(path, write, held, (save_id, staged))
    with _LOCK:
        _IN_FLIGHT.append(save)
    save.thread.start()


def writer_world(world: World) -> World:
    """``world``'s ranks on a gloo group of the writers' own (made once per job and rank list,
    here in the caller: every rank of ``world`` calls this at the same point)."""
    if world.group is None:
        return world
    return World(made_group("writer", world, "gloo", world.timeout), world.rank, world.size, world.timeout)


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` (what a rank writes) that nothing the loop does next can change:
    each tensor, in a ``Piece`` or not, copied into a host buffer kept for the next save of
    the same key, dtype and size; everything else deep-copied."""
    snapshot.drop()  # (its buffers are staged over now)
    out: dict[str, Any] = {}
    devices: set[torch.device] = set()
    for key, value in state.items():
        if isinstance(value, Piece):
            out[key] = value._replace(tensor=_staged(key, value.tensor, devices))
        elif type(value) in (torch.Tensor, torch.nn.Parameter):
            out[key] = _staged(key, value, devices)
        else:  # (a tensor subclass, such as a DTensor, copies itself)
            out[key] = copy.deepcopy(value)
    for device in devices:  # (the copies to pinned buffers, on each tensor's device, before the writer reads)
        torch.cuda.current_stream(device).synchronize()
    return out


def _staged(key: str, tensor: torch.Tensor, devices: set[torch.device]) -> torch.Tensor:
    """``tensor``'s values in this process's host buffer for ``key`` (made on first use); a
    CUDA tensor's device joins ``devices``, whose streams the copy is queued on."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        devices.add(tensor.device)
    shape_key = (key, tensor.dtype, tensor.numel())
    buffer = _BUFFERS.get(shape_key)
    if buffer is None:
        pin = tensor.device.type == "cuda"
        buffer = _BUFFERS[shape_key] = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=pin)
    buffer.copy_(tensor.reshape(-1), non_blocking=tensor.device.type == "cuda")
    return buffer.view(tensor.shape)
