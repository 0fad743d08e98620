"""Stage 3 follows torch DDP + the same torch optimizer (and torch FSDP2).

Same harness as the stage 0-2 parity tests (tolerances: [Parity tolerances] in
docs/design.md); the units are the transformer blocks and the root.
"""

import pytest
import torch

from _parity import decay_groups, train_optimizer_side_by_side
from flatshard.testing import run_distributed

SGD = {"optimizer_class": torch.optim.SGD, "opt_kwargs": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}


def _check(result, *, params: float, loss: float = 1e-5, norm: float = 1e-5) -> None:
    assert max(result["loss_diffs"]) < loss, result["loss_diffs"]
    assert max(result["param_diffs"]) < params, result["param_diffs"]
    assert max(result["norm_diffs"], default=0.0) < norm, result["norm_diffs"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_sgd_groups_schedule_clip_accumulation(world_size, reshard_after_forward):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": 3, "bucket_size": 3000, "reshard_after_forward": reshard_after_forward},
        **SGD,
        groups=decay_groups,
        schedule=True,
        clip=0.5,
    )
    _check(result, params=1e-5)
