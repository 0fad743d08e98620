"""Hooks a user registers on a sharded model's params after ``shard()`` see what they see
under DDP: a post-accumulate-grad hook runs on the local, unreduced grad in ``.grad``, and
what it writes there is what is reduced; a tensor hook (``register_hook``) sees each
backward's local grad and what it returns is accumulated ([Note: grad sync] in engine/grad_sync.py).

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
                self.register(name, p)

    def register(self, name: str, p: nn.Parameter) -> None:
        p.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            assert param.grad is not None, name
            self.seen.append((name, float(param.grad.norm())))
            param.grad.mul_(0.5)

        return hook


class HalvingTensorHooks(HalvingHooks):
    """The same through ``Tensor.register_hook``: the hook sees each backward's grad before it
    is accumulated into ``.grad``, and returns the halved one."""

    def register(self, name: str, p: nn.Parameter) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.seen.append((name, float(grad.norm())))
            return grad * 0.5

        p.register_hook(hook)


HOOKS = {"post_accumulate": HalvingHooks, "tensor": HalvingTensorHooks}


def _hooked(stage: int, accumulate: int, kind: str = "post_accumulate") -> dict:
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000))
    hooks, hooks_ref = HOOKS[kind](ours), HOOKS[kind](reference.module)
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


@pytest.mark.parametrize(
    "stage, world_size, accumulate, kind",
    [
        (0, 2, 1, "post_accumulate"),
        (1, 3, 2, "post_accumulate"),
        (2, 2, 1, "post_accumulate"),
        (3, 3, 2, "post_accumulate"),
        (2, 2, 1, "tensor"),
        (3, 3, 2, "tensor"),
    ],
)
def test_grad_hooks_see_and_change_the_local_grad_as_under_ddp(stage, world_size, accumulate, kind):
    """Post-accumulate-grad hooks: before, flatshard's own hook (registered first) had taken
    the grad, so the user's saw None. Tensor hooks run before any accumulation, where
    flatshard does not reach (their case guards it)."""
    for result in run_distributed(_hooked, world_size, stage, accumulate, kind, timeout=180):
        seen, seen_ref = result["seen"], result["seen_ref"]
        assert [n for n, _ in seen] == [n for n, _ in seen_ref] and seen, result  # (every backward)
        assert [v for _, v in seen] == pytest.approx([v for _, v in seen_ref], rel=1e-5), result
        assert max(result["drift"]) < 1e-5, result["drift"]


def _renaming_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state-dict post hook as exporters write them: renames keys, adds an entry of its own."""
    for key in [k for k in state_dict if k.startswith(prefix + "ln1.")]:
        state_dict[key.replace(".ln1.", ".norm1.")] = state_dict.pop(key)
    state_dict[prefix + "format"] = torch.tensor(2)


def _reading_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """One that reads a value (a derived entry)."""
    state_dict[prefix + "fc_sum"] = state_dict[prefix + "fc.weight"].sum()


def _state_dict_hooks() -> dict:
    out: dict = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = TiedGPT()
        reference = copy.deepcopy(model)
        ours = flatshard.shard(model, stage=stage)
        for m in (ours, reference):
            m.blocks[0].register_state_dict_post_hook(_renaming_hook)
        full, expected = ours.full_state_dict(), reference.state_dict()
        if dist.get_rank() == 0:
            out[stage] = list(full) == list(expected) and all(torch.equal(full[k], expected[k]) for k in full)
        if stage == 3:
            for m in (ours, reference):
                m.blocks[1].register_state_dict_post_hook(_reading_hook)
            with pytest.raises(flatshard.ShardedParamError, match=r"blocks\.1\.fc\.weight"):
                ours.full_state_dict()
            with ours.summon_full_params(writeback=False):
                inside = ours.state_dict()
            expected = reference.state_dict()
            out["inside summon"] = list(inside) == list(expected) and all(
                torch.equal(inside[k], expected[k]) for k in inside
            )
    return out


def test_full_state_dict_runs_state_dict_hooks():
    """A state-dict post hook registered after ``shard()`` shapes ``full_state_dict()`` as it
    shapes the unsharded model's ``state_dict()`` (the same keys and values, bit for bit), at
    stages 0-3 on 3 ranks; at stage 3 a hook that reads a value is refused by name, and runs
    inside ``summon_full_params()``."""
    results = run_distributed(_state_dict_hooks, 3, timeout=120)
    assert results[0] == {0: True, 1: True, 2: True, 3: True, "inside summon": True}, results[0]
