"""Runs that train the toolkit's mixture-of-experts Llama under expert parallelism, alone or
folded into a TP x DP mesh, under flatshard beside the same model in one process
([Note: expert parallelism] in ``src/flatshard/wrap/plan.py``)."""

from __future__ import annotations

import contextlib
import copy
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import flatshard
from _tensor_parallel import batches, save_or_load_and_continue
from flatshard.toolkit.models.llama import Llama, LlamaConfig, parallelize
from flatshard.toolkit.models.moe import expert_parallel, is_expert

CFG = LlamaConfig(n_experts=4, top_k=2)

# name: (mesh shape, mesh dims, the dense params' dp dimension, ep, edp, tp or None)
LAYOUTS = {
    # DeepSpeed-MoE's layout: dense over all 4 ranks, experts over ep 2 x edp 2
    "ep2xedp2": ((2, 2), ("edp", "ep"), None, "ep", "edp", None),
    # TP2 x DP2, experts spread over the tp ranks (each its own slice of the sequence), copies over dp
    "tp2xdp2-ep-on-tp": ((2, 2), ("dp", "tp"), "dp", "tp", "dp", "tp"),
    # TP2 x DP2, experts spread over dp, copies over tp (the expert-dp group is the tp one)
    "tp2xdp2-ep-on-dp": ((2, 2), ("dp", "tp"), "dp", "dp", "tp", "tp"),
    # one expert a rank, no copies (checkpoints move here)
    "ep4": ((1, 4), ("edp", "ep"), None, "ep", "edp", None),
}


def train_experts(
    layout: str,
    stages: list[int],
    *,
    steps: int = 3,
    batch: int = 2,
    name_ep: bool = True,
    expert_scale: float | None = None,
    compile: str | None = None,
) -> dict:
    """At each of ``stages``: the MoE Llama in ``layout`` (``LAYOUTS``) under flatshard with
    ``Experts(edp, is_expert, expert_scale, ep=ep)`` (``name_ep`` False: without ``ep``;
    ``compile``: the forward through ``torch.compile`` with that backend), SGD with momentum,
    grads clipped by the optimizer on odd steps and by torch's ``clip_grad_norm_`` on even
    ones, beside the same model in one process on the whole batch. Per stage: each step's
    loss and norm differences, each param's largest difference relative to its largest
    value, the reference's last norm."""
    shape, dims, dp_dim, ep_dim, edp_dim, tp_dim = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    run = (mesh, dp_dim, ep_dim, edp_dim, tp_dim, steps, batch, name_ep, expert_scale, compile)
    return {stage: _train(stage, *run) for stage in stages}


def _train(
    stage, mesh, dp_dim, ep_dim, edp_dim, tp_dim, steps, batch, name_ep, expert_scale, compile
) -> dict:
    torch.manual_seed(0)
    reference = Llama(CFG)
    model = copy.deepcopy(reference)
    if tp_dim is not None:
        parallelize(model, mesh[tp_dim])
    ep_group = mesh[ep_dim].get_group()
    expert_parallel(model, ep_group)
    group = mesh[dp_dim] if dp_dim is not None else None
    dp_rank = mesh[dp_dim].get_local_rank() if dp_dim is not None else dist.get_rank()
    dp = mesh[dp_dim].size() if dp_dim is not None else dist.get_world_size()
    experts = flatshard.Experts(mesh[edp_dim], is_expert, expert_scale, ep=mesh[ep_dim] if name_ep else None)
    model = flatshard.shard(
        model, stage=stage, group=group, expert=experts, buckets=flatshard.Buckets(size=2000)
    )
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    run = torch.compile(model, backend=compile) if compile else model
    out: dict = {"loss": [], "norm": []}
    for step, (idx, targets) in enumerate(batches(steps, batch * dp)):
        ref_loss = reference(idx, targets)
        ref_loss.backward()
        mine = slice(dp_rank * batch, (dp_rank + 1) * batch)
        loss = run(idx[mine], targets[mine])
        loss.backward()
        if step % 2:
            norm = opt.clip_grad_norm_(0.5)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=group.get_group() if group is not None else None)
        out["loss"].append(abs(mean_loss.item() / dp - ref_loss.item()) / ref_loss.item())
        out["norm"].append(abs(float(norm) - ref_norm.item()) / ref_norm.item())
    with model.summon_full_params() if stage == 3 else contextlib.nullcontext():
        ours = _full_values(model, ep_group)
    theirs = dict(reference.named_parameters())
    out["params"] = {n: ((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max()).item() for n in ours}
    out["ref_norm"] = ref_norm.item()
    return out


def _full_values(model, ep_group) -> dict[str, torch.Tensor]:
    """Every param in full: a DTensor gathered over tp, experts gathered over ep."""
    values = {}
    for n, p in model.named_parameters():
        value = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        if is_expert(n, p):
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(parts, value.contiguous(), group=ep_group)
            value = torch.cat(parts)
        values[n] = value
    return values


def checkpoint_leg(
    path: str, layout: str | None, stage: int, save: bool, steps: int = 2, batch: int = 4
) -> dict:
    """One leg of a run that moves between layouts: the MoE Llama in ``layout`` (None: one
    process, every expert its own) at ``stage`` with SGD and momentum. ``save``: train
    ``steps`` steps, save to ``path``, train ``steps`` more; else load ``path`` and train the
    next ``steps``. The global batch is ``batch`` sequences a step, split over dp. Returns
    the mean losses after the save point and the full params there (experts gathered)."""
    torch.manual_seed(0)
    model = Llama(CFG)
    group = ep_group = experts = None
    dp_rank, dp = 0, 1
    if layout is not None:
        shape, dims, dp_dim, ep_dim, edp_dim, tp_dim = LAYOUTS[layout]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        if tp_dim is not None:
            parallelize(model, mesh[tp_dim])
        ep_group = mesh[ep_dim].get_group()
        expert_parallel(model, ep_group)
        experts = flatshard.Experts(mesh[edp_dim], is_expert, ep=mesh[ep_dim])
        group = mesh[dp_dim] if dp_dim is not None else None
        dp_rank = mesh[dp_dim].get_local_rank() if dp_dim is not None else dist.get_rank()
        dp = mesh[dp_dim].size() if dp_dim is not None else dist.get_world_size()
    model = flatshard.shard(model, stage=stage, group=group, expert=experts)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.2, momentum=0.9)
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    dp_group = None if group is None else group.get_group()
    values = partial(_full_values, ep_group=ep_group) if ep_group is not None else _plain_values
    return save_or_load_and_continue(
        path, model, opt, save, batches(2 * steps, batch), mine, dp_group, values
    )


def _plain_values(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
