"""Shared pieces of the parity tests: a small transformer with every awkward feature, and
a loop that trains it side by side with a torch DDP reference."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.data import SyntheticCorpus
from flatshard.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=True)


class AwkwardGPT(GPT):
    """GPT with tied embeddings, a frozen param and a param that forward never uses."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.unused = nn.Parameter(torch.randn(7, 3))
        self.blocks[0].ln1.weight.requires_grad_(False)


@torch.no_grad()
def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference, relative to the reference tensor's largest value."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def train_side_by_side(
    shard_kwargs: dict,
    *,
    steps: int = 5,
    accum: int = 2,
    batch: int = 4,
    make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    model_cls=AwkwardGPT,
) -> dict:
    """Train flatshard and torch DDP copies of one model on the same data; report diffs."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = model_cls()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(model, find_unused_parameters=True, **shard_kwargs)
    opt_ref = make_optimizer(reference.parameters())
    opt = make_optimizer(ours.parameters())
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    losses, loss_diffs, param_diffs = [], [], []
    for step in range(steps):
        for micro in range(accum):
            x, y = corpus.batch(step * accum + micro, rank, batch)
            last = micro == accum - 1
            with nullcontext() if last else reference.no_sync():
                loss_ref = reference(x, y) / accum
                loss_ref.backward()
            with nullcontext() if last else ours.no_sync():
                loss = ours(x, y) / accum
                loss.backward()
            loss_diffs.append(abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
            losses.append(loss.item())
        for (name, p), p_ref in zip(ours.named_parameters(), reference.module.parameters(), strict=True):
            if (p.grad is None) != (p_ref.grad is None):
                raise AssertionError(f"step {step}: {name}.grad is None for only one of them")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        param_diffs.append(
            max(
                max_rel_diff(p, q)
                for p, q in zip(ours.parameters(), reference.module.parameters(), strict=True)
            )
        )
    return {"losses": losses, "loss_diffs": loss_diffs, "param_diffs": param_diffs}
