"""Runs that train the toolkit's Llama context-parallel (each sequence split over the ``cp``
ranks, attention gathering keys and values) as CP x DP, flatshard reducing grads over the
flattened ``dp x cp`` mesh dimension, beside the whole model in one process."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import _pipeline as pipeline_runs
import flatshard
from _pipeline import LR, MAX_NORM
from flatshard.toolkit.models.llama import Llama, LlamaConfig, context_parallel, sequence_slice

CFG = LlamaConfig()


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return pipeline_runs.batches(steps, batch, CFG)


def reference(steps: int, batch: int) -> dict:
    """The whole model in one process on the whole batch and whole sequences."""
    return pipeline_runs.reference(steps, batch, CFG)


def train_cp_dp(stages: list[int], steps: int = 3, batch: int = 4, cp_in_group: bool = True) -> dict:
    """At each of ``stages``: the Llama as CP2 x DP(rest), sharded over the flattened (dp, cp)
    dimension (``cp_in_group`` False: over dp alone, the mistake of leaving cp out), clipped by
    the optimizer on even steps and by torch's ``clip_grad_norm_`` on odd ones. Per stage:
    each step's loss (the mean over the ranks' token means) and norm, and the full params."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "cp"))
    group = mesh["dp", "cp"]._flatten() if cp_in_group else mesh["dp"]
    return {stage: _train(stage, mesh, group, steps, batch) for stage in stages}


def _train(stage: int, mesh, group, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    model = context_parallel(Llama(CFG), mesh["cp"].get_group())
    model = flatshard.shard(model, stage=stage, group=group)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    cp_rank, cp = mesh["cp"].get_local_rank(), mesh["cp"].size()
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    out: dict = {"loss": [], "norm": []}
    for step, (idx, targets) in enumerate(batches(steps, batch)):
        idx, targets = (sequence_slice(t[mine], cp_rank, cp) for t in (idx, targets))
        loss = model(idx, targets)
        loss.backward()
        if step % 2 == 0:
            norm = opt.clip_grad_norm_(MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["loss"].append(mean.item() / dist.get_world_size())
        out["norm"].append(float(norm))
    with model.summon_full_params() if stage == 3 else contextlib.nullcontext():
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
