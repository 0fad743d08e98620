"""The snapshot of the last background save: its staged copy in host memory, from which a load
of that save reads without touching storage ([Note: save snapshots])."""

# [Note: save snapshots]
#
# A save in the background ([Note: background saves] in ``background.py``) stages this rank's
# part of the checkpoint into host buffers that the process keeps for the next save. Once the
# save is complete, that copy is exactly what the files hold (the writer wrote from it), so it
# becomes the save's *snapshot*, under the save's id, until the next save stages over it. A load of a
# checkpoint whose manifest names that save id reads from the snapshot instead of the files
# when every rank can: each rank holds a snapshot of that save, and every entry its layout
# asks for is there with the same shape, dtype and place in the param (the same world size,
# stage and model; otherwise the entries differ and every rank reads the files). At stages
# 0-2 a load reads each param whole, where a save wrote each rank's pieces of it: those are
# put together from every rank's snapshot pieces, in one all-gather a dtype on the writers' gloo
# group, when the pieces cover each param. The ranks agree in one all-gather of what each
# holds, so either all read from memory or all from storage. The load's
# other steps are the same: the manifest and the files' sizes are still checked, the
# optimizer's state still goes through its own ``load_state_dict``, and non-tensor entries
# (``extra``, RNG states) are deep-copied out, so the snapshot stays as saved.
#
# This is the roll-back of a job whose ranks all survive (a step that failed or diverged): a
# reload in host memory speed, not storage speed. A copy kept on a partner rank, to fill a
# replacement rank, is not made: under torchrun a failure restarts every rank, so no
# process outlives it to hold one; such a restart reads the files (``latest_checkpoint``).

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from flatshard.checkpoint.pieces import Piece
from flatshard.comm.world import World, all_gather_bytes, all_gather_varied

__all__ = ["drop", "restore", "take"]

_SNAPSHOT: dict[str, dict[str, Any]] = {}  # (at most one: save id -> the staged state)
_LOCK = threading.Lock()


def take(save_id: str, state: dict[str, Any]) -> None:
    """Make ``state``, the staged copy of the complete save ``save_id``, its snapshot."""
    with _LOCK:
        _SNAPSHOT.clear()
        _SNAPSHOT[save_id] = state


def drop() -> None:
    """Drop the snapshot (its buffers are about to be staged over)."""
    with _LOCK:
        _SNAPSHOT.clear()


def restore(
    save_id: str | None, request: dict[str, Any], world: World, data_world: Callable[[], World]
) -> bool:
    """Fill a load's ``request`` (this rank's layout) from the snapshot of save ``save_id``
    and return True, if every rank of ``world`` can; else return False on every rank (the
    caller reads the files). ``data_world()``: the gloo group that gathers whole params."""
    with _LOCK:
        state = _SNAPSHOT.get(save_id) if save_id else None
    mine = _held(state, request)
    shared = (
        [mine]
        if world.size == 1
        else [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode(), world)]
    )
    everyone: list[dict] = [held for held in shared if held is not None]
    needs = _to_gather(everyone) if len(everyone) == len(shared) else None
    if state is None or needs is None:
        return False
    with torch.no_grad():
        for key, want in request.items():
            if key not in needs:
                _fill_one(request, key, want, state[key])
        if needs:
            _gather_wholes(request, needs, state, everyone, data_world())
    return True


def _is_whole(want: Any) -> bool:
    """A request for a param whole (at stages 0-2 a load asks for every param so)."""
    return (
        isinstance(want, Piece) and not want.runs and want.offset == 0 and want.tensor.numel() == want.numel
    )


def _held(state: dict[str, Any] | None, request: dict[str, Any]) -> dict | None:
    """What this rank asks for whole ({key: [numel, dtype]}) and holds of it ({key: [offset,
    numel]}), or None if the snapshot cannot serve this rank's other entries."""
    if state is None:
        return None
    wholes = {key: want for key, want in request.items() if _is_whole(want)}
    if not all(_fits(want, state.get(key)) for key, want in request.items() if key not in wholes):
        return None
    held: dict[str, list[int]] = {}
    for key, want in wholes.items():
        have = state.get(key)
        if have is None:
            continue
        if not isinstance(have, Piece) or have.runs or have.tensor.dtype != want.tensor.dtype:
            return None
        held[key] = [have.offset, have.tensor.numel()]
    return {"whole": {k: [w.numel, str(w.tensor.dtype)] for k, w in wholes.items()}, "held": held}


def _to_gather(everyone: list[dict]) -> dict[str, str] | None:
    """{key: dtype} of the whole requests some rank holds only part of, in order; None if
    every rank's pieces together do not cover one of them (the same answer on every rank)."""
    needs = {}
    for held in everyone:
        for key, (numel, dtype) in held["whole"].items():
            if held["held"].get(key) != [0, numel]:
                needs[key] = (numel, dtype)
    for key, (numel, _) in needs.items():
        reached = 0
        for offset, n in sorted(held["held"][key] for held in everyone if key in held["held"]):
            if offset > reached:
                return None
            reached = max(reached, offset + n)
        if reached < numel:
            return None
    return {key: needs[key][1] for key in sorted(needs)}


def _fits(want: Any, have: Any) -> bool:
    if isinstance(want, Piece):
        return (
            isinstance(have, Piece)
            and (want.numel, want.offset, want.runs) == (have.numel, have.offset, have.runs)
            and _same_tensor(want.tensor, have.tensor)
        )
    if type(want) in (torch.Tensor, torch.nn.Parameter):
        return type(have) in (torch.Tensor, torch.nn.Parameter) and _same_tensor(want, have)
    if isinstance(want, torch.Tensor):  # (a tensor subclass: a DTensor, ...): the files
        return False
    return have is not None


def _same_tensor(want: torch.Tensor, have: torch.Tensor) -> bool:
    return want.shape == have.shape and want.dtype == have.dtype


def _fill_one(request: dict[str, Any], key: str, want: Any, have: Any) -> None:
    """One entry, as ``pieces.load`` fills it from files: tensors in place, others replaced."""
    if isinstance(want, Piece):
        want.tensor.copy_(have.tensor)
    elif isinstance(want, torch.Tensor):
        want.copy_(have)
    else:
        request[key] = copy.deepcopy(have)


def _gather_wholes(
    request: dict[str, Any], needs: dict[str, str], state: dict[str, Any], everyone: list[dict], world: World
) -> None:
    """Each whole request of ``needs`` put together from every rank's snapshot pieces: one
    all-gather a dtype."""
    for dtype in sorted(set(needs.values())):
        keys = [k for k, d in needs.items() if d == dtype]
        mine = [state[k].tensor.reshape(-1) for k in keys if k in everyone[world.rank]["held"]]
        flat = torch.cat(mine) if mine else torch.zeros(0, dtype=getattr(torch, dtype.removeprefix("torch.")))
        for held, data in zip(everyone, all_gather_varied(flat, world), strict=True):
            at = 0
            for key in keys:
                if key in held["held"]:
                    offset, numel = held["held"][key]
                    if key in request:
                        request[key].tensor[offset : offset + numel].copy_(data[at : at + numel])
                    at += numel
