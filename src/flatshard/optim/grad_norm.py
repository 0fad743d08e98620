"""The ``DistributedOptimizer``'s global grad norm: every grad element of the model counted
once, over the data-parallel worlds and, in a tensor-parallel model, the tp dimension
([Note: tensor-parallel params] in ``engine/tensor_parallel.py``)."""

from __future__ import annotations

import torch

from flatshard.comm.collectives import all_reduce
from flatshard.comm.world import World
from flatshard.engine.grad_view import norm_chunks
from flatshard.engine.tensor_parallel import TensorParallel, check_alike_over_tp
from flatshard.optim.agreement import SettingsCheck
from flatshard.optim.shards import BufferShards
from flatshard.wrap.module import ShardState


def check_max_norm(max_norm: object) -> None:
    """A number >= 0 (inf: no clipping), as torch's own optimizers check their arguments: a
    NaN would make every param NaN, a negative one reverse the update."""
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping), got {max_norm!r}")


def global_norm_sq(
    state: ShardState, shards: list[BufferShards], settings: SettingsCheck, inner: torch.optim.Optimizer
) -> tuple[torch.Tensor, tuple[torch.Tensor, World] | None]:
    """Squared 2-norm of every grad element of the model, counted once (fp64, 0-d), and the
    settings digests that rode on its all-reduce with its world (None without one).

    Shards are unique within their world; a replicated (stage 0) buffer is held whole by
    each of its world's ranks, so its share is divided by that world's size before the sum
    over the main world. A model whose only world is replicated needs no communication over
    it. Experts told their expert-parallel group are summed over their own group and it
    instead ([Note: expert parallelism] in ``wrap/plan.py``). In a tensor-parallel model
    the squares of the params tp splits are summed over tp too; the others are alike on
    every tp rank and counted once.
    """
    worlds = [bset.world for bset in state.sets.values()]
    world = worlds[0]
    device = shards[0].buffer.device if shards else torch.device("cpu")
    local_only = len(worlds) == 1 and not state.policy.shards_optimizer
    tp = state.grad_sync.tensor_parallel
    kinds = 1 if tp is None else 2  # (not split over tp[, split])
    spread = state.grad_sync.experts
    experts = spread if spread is not None and not spread.in_main else None
    apart = {id(b) for b in state.sets["expert"].buffers} if experts is not None else set()
    sums = torch.zeros(kinds, dtype=torch.float64, device=device)
    expert_sums = torch.zeros(kinds, dtype=torch.float64, device=device)
    for s in shards:
        replicas = 1 if (local_only or state.policy.shards_optimizer) else s.world.size
        share = _squares(s, tp)[:kinds] / replicas
        if id(s.buffer) in apart:
            expert_sums += share
        else:
            sums += share
    riding = None
    if not local_only:
        carried = torch.cat([sums, settings.riding(inner, device)])
        all_reduce(carried, world, stats=state.stats).wait()
        sums, riding = carried[:kinds], (carried[kinds:], world)
    if experts is not None:
        for over in (experts.world, experts.over):
            if over.size > 1:
                all_reduce(expert_sums, over, stats=state.stats).wait()
        sums = sums + expert_sums
    if tp is not None and tp.world.size > 1:
        sums = _over_tp(sums, tp, state)
    return sums.sum(), riding


def _over_tp(sums: torch.Tensor, tp: TensorParallel, state: ShardState) -> torch.Tensor:
    """``(replicated, split)`` squares: the split ones summed over tp, the replicated ones
    checked alike on every tp rank (their mean, the same number on every rank)."""
    carried = torch.stack([sums[1], sums[0], sums[0].square()])
    all_reduce(carried, tp.world, stats=state.stats).wait()
    split, total, total_sq = carried
    check_alike_over_tp(total, total_sq, tp)
    return torch.stack([total / tp.world.size, split])


def _squares(shards: BufferShards, tp: TensorParallel | None) -> torch.Tensor:
    """(sum of squares of the grads tp does not split, of those it splits) on this rank: the
    shards at once without tensor parallelism, else their pieces of each kind."""
    grads = shards.grad_shards()
    out = torch.zeros(2, dtype=torch.float64, device=shards.buffer.device)
    if not grads:
        return out
    wide = torch.promote_types(grads[0].dtype, torch.float32)  # (fp64 grads stay fp64)
    kinds = (grads, []) if tp is None else shards.grad_pieces(tp.split)
    for i, pieces in enumerate(kinds):
        if pieces:
            norms = torch._foreach_norm(norm_chunks(pieces), 2, dtype=wide)  # (NORM_CHUNK elements each)
            out[i] = torch.stack(norms).double().square().sum().to(out.device)  # (grads on the host too)
    return out
