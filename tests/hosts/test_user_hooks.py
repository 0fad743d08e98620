"""Hooks a user registers on a sharded model's params after ``shard()`` see what they see
under DDP: a post-accumulate-grad hook runs on the local, unreduced grad in ``.grad``, and
what it writes there is what is reduced ([Note: grad sync] in engine/grad_sync.py).

Tolerances ([Note: parity tolerances] in _parity.py): the local grads a hook sees are the
same fp32 computation on both sides, so their norms agree to the params' drift (exact at step
0, ~1e-7 relative after); AdamW (eps 1e-3) over 3 fp32 steps follows DDP to 1e-5 relative."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT, drift_from, step_both
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}


class HalvingHooks:
    """On block 1's params: records each grad's norm as the hook sees it, then halves it in
    place (a per-param grad transform, as users write them)."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: list[tuple[str, float]] = []
        for name, p in model.named_parameters():
            if name.startswith("blocks.1.") and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            assert param.grad is not None, name
            self.seen.append((name, float(param.grad.norm())))
            param.grad.mul_(0.5)

        return hook


def _hooked(stage: int, accumulate: int) -> dict:
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000))
    hooks, hooks_ref = HalvingHooks(ours), HalvingHooks(reference.module)
    opt = flatshard.DistributedOptimizer(ours, torch.optim.AdamW, **ADAMW)
    opt_ref = torch.optim.AdamW(reference.parameters(), **ADAMW)
    drift = []
    for step in range(3):
        for micro in range(accumulate):
            x, y = CORPUS.batch(step * accumulate + micro, dist.get_rank(), 4)
            last = micro == accumulate - 1
            with contextlib.ExitStack() as held:
                if not last:  # (accumulate: the micro-batches before the last sync nothing)
                    held.enter_context(ours.no_sync())
                    held.enter_context(reference.no_sync())
                ours(x, y).backward()
                reference(x, y).backward()
        step_both(opt, opt_ref)
        drift.append(drift_from(ours, reference.module))
    return {"drift": drift, "seen": hooks.seen, "seen_ref": hooks_ref.seen}


@pytest.mark.parametrize("stage, world_size, accumulate", [(0, 2, 1), (1, 3, 2), (2, 2, 1), (3, 3, 2)])
def test_post_accumulate_grad_hooks_see_and_change_the_local_grad_as_under_ddp(stage, world_size, accumulate):
    """Before, flatshard's own hook (registered first) had taken the grad: the user's saw None."""
    for result in run_distributed(_hooked, world_size, stage, accumulate, timeout=180):
        seen, seen_ref = result["seen"], result["seen_ref"]
        assert [n for n, _ in seen] == [n for n, _ in seen_ref] and seen, result  # (every backward)
        assert [v for _, v in seen] == pytest.approx([v for _, v in seen_ref], rel=1e-5), result
        assert max(result["drift"]) < 1e-5, result["drift"]
