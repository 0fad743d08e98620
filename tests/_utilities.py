"""What the tests of a sharded model under torch's utilities share: a TiedGPT sharded beside
its DDP copy with SGD on both, a backward on the corpus, and one step of both sides."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT, drift_from
from flatshard.toolkit.data import SyntheticCorpus

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
GRID = [(stage, world) for stage in range(4) for world in (1, 2, 3)]


def pair(stage: int, **shard_kwargs):
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    ours = flatshard.shard(model, stage=stage, buckets=flatshard.Buckets(size=3000), **shard_kwargs)
    opt = flatshard.DistributedOptimizer(ours, torch.optim.SGD, **SGD)
    return ours, opt, reference, torch.optim.SGD(reference.parameters(), **SGD)


def backward(model, step: int, batch: int = 4) -> float:
    x, y = CORPUS.batch(step, dist.get_rank(), batch)
    loss = model(x, y)
    loss.backward()
    return loss.item()


def train_both(ours, opt, reference, opt_ref, step: int, between=None) -> float:
    """One step of both sides (``between(model)`` after each backward); the params' drift."""
    for model in (ours, reference):
        backward(model, step)
        if between is not None:
            between(model)
    for o in (opt, opt_ref):
        o.step()
        o.zero_grad()
    return drift_from(ours, reference.module)
