"""Params without a grad keep their values and optimizer state through a step.

The reasoning is [Note: params without a grad] below."""

# [Note: params without a grad]
#
# A torch optimizer skips a param whose ``.grad`` is None: no update, no weight decay, no
# change to its state. flatshard's inner optimizer steps flat runs that hold many params, so
# a param frozen after ``shard()`` (``requires_grad_(False)`` mid-run), or whose grad was set
# to None, would still move under momentum and weight decay. So:
#
# * **Which params have a grad** follows torch under DDP with ``find_unused_parameters=True``
#   (and FSDP2): at the end of a synced backward a param gets its ``.grad`` if a grad reached
#   it on some rank since the last synced backward (a param unused here is reduced with the
#   other ranks' grads), or if it had one already; a param no rank used (an unused head, a
#   param frozen through the backward) keeps None (``GradViews.attach``). Every rank decides
#   alike: which params each rank used is one MAX all-reduce of a flag a param, after the
#   grad reductions (``GradUsage.unused_everywhere``; DDP pays the same one only when told
#   to find unused params, and errors on them otherwise). Under ``no_sync`` a param has a
#   grad where one reached it on this rank, as under DDP.
# * **A ``zero_grad`` that bypassed flatshard's** (``nn.Module.zero_grad`` of torch.compile's
#   wrapper, of a module holding the sharded one: every ``.grad`` set to None, flatshard's sums
#   left) is taken as one before the next forward or step (``GradSync.without_grads``); some
#   ``.grad`` set to None while others were kept, then a forward, is refused by name.
# * **The step holds them back.** Before the inner step their pieces of the runs, and the
#   same elements of every state tensor shaped like the run, are copied aside; after it they
#   are put back (state that did not exist before the step is put back as zeros: what Adam's
#   moments and SGD's momentum start from). A run made only of such params keeps its whole
#   state, its step count included, exactly as torch would.
# * **One difference is left**: a run shared with params that did step counts the step in
#   its one ``step`` entry, which Adam's bias correction reads. A param that steps again
#   later would then be corrected as if it had stepped throughout; ``DistributedOptimizer``
#   warns when that happens, naming the params. Params that freeze and unfreeze in a param
#   group of their own have runs of their own: exact.
# * **A zero grad is a grad.** ``zero_grad(set_to_none=False)`` keeps zero grads, which step
#   (momentum and weight decay move the param), as in torch.

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from flatshard.optim.shards import BufferShards


class HeldBack:
    """Holds params without a grad through the inner optimizer's steps, and remembers those
    whose step count moved with their run's."""

    def __init__(self) -> None:
        self.lagging: set[str] = set()  # held in a shared run that counts steps

    @contextmanager
    def step(
        self, inner: torch.optim.Optimizer, shards: Sequence[BufferShards], names: list[str]
    ) -> Iterator[None]:
        """Around ``inner.step()``: the params named keep their values and state."""
        held = frozenset(names)
        self._warn_resumed(held)
        if not held:
            yield
            return
        saved = [
            (tensor, pieces, whole, _save(inner, tensor, list(pieces.values()), whole))
            for s in shards
            for tensor, pieces, whole in s.held_pieces(held)
        ]
        yield
        for tensor, pieces, whole, before in saved:
            if _restore(inner, tensor, list(pieces.values()), whole, before):
                self.lagging.update(pieces)

    def _warn_resumed(self, held: frozenset[str]) -> None:
        resumed = sorted(self.lagging - held)
        if not resumed:
            return
        self.lagging -= set(resumed)
        warnings.warn(
            f"params {resumed[:4]}{' ...' if len(resumed) > 4 else ''} step again after steps without "
            "a grad; they kept their values and moments, but share an optimizer run with params that "
            "stepped, so its step count (which Adam's bias correction reads) counted those steps too. "
            "Put params you freeze and unfreeze in a param group of their own to step them exactly as "
            "torch does",
            RuntimeWarning,
            stacklevel=4,
        )


def _save(inner: torch.optim.Optimizer, tensor: torch.Tensor, pieces: list[slice], whole: bool) -> Any:
    """What the held pieces are before the step: the values, and the state (all of it for a
    whole run; else the pieces of each tensor shaped like the run); None where absent."""
    state = inner.state.get(tensor) or None  # (state is a defaultdict: no entry made)
    flat = tensor.detach().view(-1)
    values = [flat[p].clone() for p in pieces]
    if whole:
        kept = (
            None if state is None else {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        )
        return values, kept
    moments = (
        None
        if state is None
        else {k: [_flat(v)[p].clone() for p in pieces] for k, v in _shaped(state, tensor)}
    )
    return values, moments


def _restore(
    inner: torch.optim.Optimizer, tensor: torch.Tensor, pieces: list[slice], whole: bool, before: Any
) -> bool:
    """Put the held pieces back; whether the run keeps a step count."""
    values, kept = before
    flat = tensor.detach().view(-1)
    for p, v in zip(pieces, values, strict=True):
        flat[p].copy_(v)
    state = inner.state.get(tensor)
    if state is None:
        return False
    if whole:  # (in place: a grouped optimizer shares this dict with its sub-optimizer)
        state.clear()
        state.update(kept or {})
        return False
    for key, value in _shaped(state, tensor):
        for i, p in enumerate(pieces):
            if kept is None or key not in kept:
                _flat(value)[p].zero_()
            else:
                _flat(value)[p].copy_(kept[key][i])
    return "step" in state  # (shared with params that stepped: it counted this step)


def _shaped(state: dict[str, Any], tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The state tensors holding one element per element of the run."""
    return [
        (k, v) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == tensor.numel()
    ]


def _flat(value: torch.Tensor) -> torch.Tensor:
    return value.detach().view(-1)
