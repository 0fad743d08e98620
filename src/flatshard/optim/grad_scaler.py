"""``ShardedGradScaler``: ``torch.amp.GradScaler`` whose inf check spans every rank.

The reasoning is [Note: grad scaler] below."""

# [Note: grad scaler]
#
# torch's ``GradScaler`` checks the grads of the optimizer it drives for inf and NaN, divides
# them by the scale, and skips ``step`` and backs the scale off when it found any. Over a
# sharded model each rank holds only its shard of the grads, so an overflow in one rank's
# shard is seen by that rank alone: it would skip while the others step, and the ranks'
# scales would part. ``ShardedGradScaler`` is the same class with one change: for a
# ``DistributedOptimizer`` the check is the optimizer's global grad norm (the one all-reduce
# its step takes anyway), so every rank finds the same thing and moves its scale alike, and
# unscaling is one multiply of the grad shards. Other optimizers are checked as torch checks
# them.
#
# A plain ``GradScaler`` driving a ``DistributedOptimizer`` is refused at ``scaler.step``
# before anything is stepped: the optimizer declares ``_step_supports_amp_scaling``, so torch
# hands it the inf check it made, and one not made here was this rank's alone.

from __future__ import annotations

import torch

from flatshard.optim.distributed import DistributedOptimizer


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments, same use) for a ``DistributedOptimizer``:
    ``scaler.scale(loss).backward()``, optionally ``scaler.unscale_(optimizer)`` and a clip,
    ``scaler.step(optimizer)``, ``scaler.update()``; see [Note: grad scaler]."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if not isinstance(optimizer, DistributedOptimizer):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        optimizer.unscale_grads_(inv_scale, found_inf)
        return {found_inf.device: found_inf}
