"""A ``DistributedOptimizer``'s own state dict: one rank's shards of the optimizer state, the
main params and the loss scaler, bound to the layout they were saved from (checkpoints that
load at any world size go through ``flatshard.checkpoint`` instead)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from flatshard.optim.loss_scale import StaticLossScaler
from flatshard.optim.shards import BufferShards
from flatshard.wrap.module import ShardState

FORMAT = "DistributedOptimizer/1"


class RankState(dict):
    """``rank_state``'s dict. A key it lacks raises a ``KeyError`` that says what it is, so a
    torch optimizer's ``load_state_dict``, which reads ``'param_groups'``, refuses it by name
    (a plain dict would raise ``KeyError: 'param_groups'``). It pickles as a plain dict."""

    def __missing__(self, key: Any) -> Any:
        raise KeyError(
            f"{key!r}: this is a flatshard DistributedOptimizer's state dict ({FORMAT}: one rank's "
            "flat shards), not a torch optimizer's. Load it with DistributedOptimizer.load_state_dict "
            "on the same rank and layout; to move optimizer state to another world size or stage, "
            "use flatshard.save_checkpoint and flatshard.load_checkpoint"
        )

    def copy(self) -> RankState:  # (torch's load_state_dict copies first)
        return RankState(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


def rank_state(
    shards: Sequence[BufferShards],
    state: ShardState,
    inner: torch.optim.Optimizer,
    loss_scaler: StaticLossScaler | None,
    skipped_steps: int,
) -> dict[str, Any]:
    """This rank's optimizer state, loadable by the same rank of the same layout."""
    return RankState(
        {
            "flatshard": FORMAT,
            "layout": describe_layout(shards, state),
            "inner": inner.state_dict(),
            "main_params": [s.record_main for s in shards],
            "loss_scaler": None if loss_scaler is None else loss_scaler.state_dict(),
            "skipped_steps": skipped_steps,
        }
    )


def load_rank_state(
    saved: dict[str, Any],
    shards: Sequence[BufferShards],
    state: ShardState,
    inner: torch.optim.Optimizer,
    loss_scaler: StaticLossScaler | None,
) -> int:
    """Load ``rank_state``'s dict into these shards (a ``ValueError`` naming what differs
    before anything is written); return its count of skipped steps."""
    if saved.get("flatshard") != FORMAT:
        raise ValueError("not a flatshard DistributedOptimizer state dict (no 'flatshard' key)")
    mine, theirs = describe_layout(shards, state), saved["layout"]
    if mine != theirs:
        diff = [f"{k}: saved {theirs.get(k)!r}, here {mine[k]!r}" for k in mine if theirs.get(k) != mine[k]]
        raise ValueError("optimizer state was saved for another layout: " + "; ".join(diff))
    if (loss_scaler is None) != (saved["loss_scaler"] is None):
        raise ValueError("optimizer state and this optimizer disagree on whether the loss is scaled")
    state.wait_for_params()
    for s, main in zip(shards, saved["main_params"], strict=True):
        if s.record_main is not None and main is not None:
            s.record_main.copy_(main)
        else:  # (fp32 params, or saved without main params: from the params loaded before)
            s.load_main_from_params()
    inner.load_state_dict(saved["inner"])  # after the main params it may copy
    if loss_scaler is not None:
        loss_scaler.load_state_dict(saved["loss_scaler"])
    return int(saved.get("skipped_steps", 0))


def describe_layout(shards: Sequence[BufferShards], state: ShardState) -> dict[str, Any]:
    """The stage, world sizes, rank and a digest of the runs: what a rank's state is bound to."""
    digest = hashlib.sha256()
    for s in shards:
        layout = s.buffer.layout
        digest.update(repr((str(layout.dtype), [b.range for b in layout.buckets], s.runs)).encode())
    return {
        "stage": state.stage,
        "world_sizes": {key: bset.world.size for key, bset in state.sets.items()},
        "rank": shards[0].world.rank if shards else 0,
        "digest": digest.hexdigest()[:16],
    }
