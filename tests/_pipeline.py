"""Runs that train the toolkit's Llama cut into pipeline chunks (``pipeline_chunk``) as
PP x DP, each chunk sharded by flatshard over dp and driven by a ``torch.distributed.pipelining``
schedule through flatshard's ``PipelineStage``, beside the whole model in one process."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage as TorchPipelineStage,
)
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

import flatshard
from flatshard.hosts.pipelining import PipelineStage
from flatshard.toolkit.models.llama import Llama, LlamaConfig, lm_loss, parallelize, pipeline_chunk

CFG = LlamaConfig(n_layers=4)
LR, MAX_NORM = 0.5, 0.5
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}


def batches(steps: int, batch: int, cfg: LlamaConfig = CFG) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (steps, batch, cfg.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def reference(steps: int, batch: int, cfg: LlamaConfig = CFG) -> dict:
    """The whole Llama of ``cfg`` in one process on the whole batch: each step's loss and
    (clipped) grad norm, and the params at the end."""
    torch.manual_seed(0)
    model = Llama(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out: dict = {"loss": [], "norm": []}
    for idx, targets in batches(steps, batch, cfg):
        loss = model(idx, targets)
        loss.backward()
        out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def mesh_and_chunks(schedule: str, stage: int, stage_class=PipelineStage, pp: int = 2, **opt_kwargs):
    """This rank's chunks of the Llama (one, or two for the interleaved schedules) sharded at
    ``stage`` over dp, with their optimizers and pipeline stages, on a (pp, dp) mesh."""
    mesh = init_device_mesh("cpu", (pp, dist.get_world_size() // pp), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    per_rank = 2 if schedule in ("interleaved", "zero-bubble") else 1
    torch.manual_seed(0)
    whole = Llama(CFG)
    models, optimizers, stages = [], [], []
    for k in range(per_rank):
        index = pp_rank + pp * k  # (interleaved: rank 0 runs chunks 0 and 2, rank 1 chunks 1 and 3)
        chunk = pipeline_chunk(whole, index, pp * per_rank)
        model = flatshard.shard(chunk, stage=stage, group=mesh["dp"])
        models.append(model)
        opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9, **opt_kwargs)
        optimizers.append(opt)
        pp_group = mesh["pp"].get_group()
        stages.append(stage_class(model, index, pp * per_rank, torch.device("cpu"), group=pp_group))
    return mesh, models, optimizers, stages


def train_pipelined(schedule: str, stages: list[int], steps: int = 3, batch: int = 4, micro: int = 2) -> dict:
    """At each of ``stages``: the Llama as PP2 x DP(rest) under ``schedule``, clipped by the
    chunks' optimizers or by torch's ``get_total_norm`` summed over pp (torchtitan's recipe),
    in turn (``_clip``). Per stage: each step's loss and norm (the last pipeline
    stage's mean over dp; None elsewhere), every param's largest difference from the one-process
    run relative to its largest value, and the reductions each chunk issued per step."""
    return {stage: _train(schedule, stage, steps, batch, micro) for stage in stages}


def _train(schedule: str, stage: int, steps: int, batch: int, micro: int) -> dict:
    mesh, models, optimizers, stages = mesh_and_chunks(schedule, stage)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    run = _schedule(schedule, stages, micro)
    out: dict = {"loss": [], "norm": [], "reductions": []}
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    for step, (idx, targets) in enumerate(batches(steps, batch)):
        before = [_reductions(m) for m in models]
        losses: list[torch.Tensor] = []
        run.step(idx[mine], target=targets[mine], losses=losses)
        out["reductions"].append([_reductions(m) - b for m, b in zip(models, before, strict=True)])
        norm = _clip(step, models, optimizers, mesh)
        for o in optimizers:
            o.step()
            o.zero_grad()
        out["norm"].append(float(norm))
        out["loss"].append(_mean_loss(losses, mesh, dp))
    out["params"] = _full_params(models, stage)
    return out


def _clip(step: int, models, optimizers, mesh) -> torch.Tensor:
    """Step 0: each chunk's optimizer clips (the first clips every local chunk, the others find
    the norm within bounds); step 1: torchtitan's recipe; step 2: the first chunk's only."""
    if step % 3 == 0:
        norms = [o.clip_grad_norm_(MAX_NORM) for o in optimizers]
        return norms[0]
    if step % 3 == 1:
        return _torchtitan_clip(models, mesh)
    return optimizers[0].clip_grad_norm_(MAX_NORM)


def _schedule(name: str, stages, micro: int):
    cls = SCHEDULES[name]
    return cls(stages if len(stages) > 1 else stages[0], micro, loss_fn=lm_loss)


def _reductions(model) -> int:
    calls = model.comm_stats.calls
    return calls["reduce_scatter"] if model.flatshard_state.policy.shards_grads else calls["all_reduce"]


def _torchtitan_clip(models, mesh) -> torch.Tensor:
    """torchtitan's clip for FSDP2 + PP: the norm of every local grad (each a ShardedGrad's
    global norm over dp), summed in squares over pp, then clip with it."""
    params = [p for m in models for p in m.parameters()]
    total = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
    dist.all_reduce(total, group=mesh["pp"].get_group())
    total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    return total


def _mean_loss(losses: list[torch.Tensor], mesh, dp: int) -> float | None:
    if not losses:
        return None
    mean = torch.stack(losses).mean().detach()
    dist.all_reduce(mean, group=mesh["dp"].get_group())
    return mean.item() / dp


def _full_params(models, stage: int) -> dict[str, torch.Tensor]:
    out = {}
    for m in models:
        with m.summon_full_params() if stage == 3 else contextlib.nullcontext():
            out.update({n: p.detach().clone() for n, p in m.named_parameters()})
    return out


def torch_stage_reductions(micro: int) -> list[int]:
    """Reductions per step of a chunk at stage 2 under torch's own ``PipelineStage`` (GPipe,
    ``micro`` micro-batches): one per micro-batch, the cost flatshard's stage avoids."""
    mesh, models, _, stages = mesh_and_chunks("gpipe", 2, stage_class=TorchPipelineStage)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    run = _schedule("gpipe", stages, micro)
    idx, targets = batches(1, 8)[0]
    mine = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
    before = _reductions(models[0])
    run.step(idx[mine], target=targets[mine])
    return [_reductions(models[0]) - before]


def refusals(path: str) -> dict[str, str]:
    """What PP2 x DP1 refuses, each message by case (``"no error"`` where nothing raised);
    nothing may appear at ``path``."""
    out = {}
    for case, attempt in (
        ("checkpoint of two chunks a rank", lambda: _save_interleaved(path)),
        ("plain chunk", _plain_chunk),
        ("chunk without optimizer", _without_optimizer),
        ("loss scaling", _loss_scaling),
        ("lr differs on one rank", _lr_differs),
    ):
        try:
            attempt()
            out[case] = "no error"
        except (TypeError, ValueError, NotImplementedError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


def _step_once(schedule: str, stages, micro: int = 2) -> None:
    idx, targets = batches(1, 2)[0]
    _schedule(schedule, stages, micro).step(idx, target=targets)


def _plain_chunk() -> None:
    PipelineStage(pipeline_chunk(Llama(CFG), 0, 2), 0, 2, torch.device("cpu"))


def _save_interleaved(path: str) -> None:
    _, models, optimizers, _ = mesh_and_chunks("interleaved", 1)
    flatshard.save_checkpoint(path, models[0], optimizers[0])  # (the rank's other chunk left out)


def _without_optimizer() -> None:
    _, models, optimizers, stages = mesh_and_chunks("interleaved", 1)
    models[1].flatshard_state.optimizer = None  # (as if the second chunk's were never built)
    _step_once("interleaved", stages)
    optimizers[0].step()


def _loss_scaling() -> None:
    _, models, _, stages = mesh_and_chunks("gpipe", 0)
    models[0].flatshard_state.optimizer = None
    scaled = flatshard.DistributedOptimizer(models[0], torch.optim.SGD, lr=LR, loss_scale=1024.0)
    _step_once("gpipe", stages)
    scaled.step()


def _lr_differs() -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    chunk = flatshard.shard(pipeline_chunk(Llama(CFG), pp, 2), group=mesh["dp"])
    flatshard.DistributedOptimizer(chunk, torch.optim.SGD, lr=LR * (1 + pp))


def checkpoint_leg(
    path: str, pp: int, stage: int, save: bool, steps: int = 2, batch: int = 4, schedule: str = "gpipe"
) -> dict:
    """One leg of a run that moves between layouts: the Llama as PP ``pp`` x DP (the rest of
    the ranks) under ``schedule`` (interleaved: two chunks a rank, saved and loaded as lists),
    or (``pp`` 1) whole over every rank, at ``stage`` with SGD and momentum. ``save``: train
    ``steps`` steps, save to ``path`` in the background, train ``steps`` more while it is
    written; else load ``path`` and train the next
    ``steps``. Returns the mean losses after the save point and the full params at the save
    point (saving leg) or after loading."""
    world = dist.get_world_size()
    if pp > 1:
        mesh, models, optimizers, stages = mesh_and_chunks(schedule, stage, pp=pp)
        dp_rank, dp = mesh["dp"].get_local_rank(), world // pp
        run = _schedule(schedule, stages, 2)
    else:
        torch.manual_seed(0)
        models = [flatshard.shard(Llama(CFG), stage=stage)]
        optimizers = [flatshard.DistributedOptimizer(models[0], torch.optim.SGD, lr=LR, momentum=0.9)]
        mesh, run, dp_rank, dp = None, None, dist.get_rank(), world
    data = batches(2 * steps, batch)
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)

    def train(steps_data) -> list[float | None]:
        losses = []
        for idx, targets in steps_data:
            if run is not None:
                out: list[torch.Tensor] = []
                run.step(idx[mine], target=targets[mine], losses=out)
                losses.append(_mean_loss(out, mesh, dp))
            else:
                loss = models[0](idx[mine], targets[mine])
                loss.backward()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / dp)
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        return losses

    model, opt = (models, optimizers) if len(models) > 1 else (models[0], optimizers[0])
    if save:
        train(data[:steps])
        flatshard.save_checkpoint(path, model, opt, blocking=False)
    else:
        flatshard.load_checkpoint(path, model, opt)
    at_save = _full_params(models, stage)
    losses = train(data[steps:])
    flatshard.wait_for_checkpoint()
    return {"losses": losses, "params": at_save}


def planned_and_measured(stage: int, micro: int) -> dict:
    """This rank's chunk at PP2 x DP2 under GPipe with ``micro`` micro-batches: what
    ``plan_from_specs`` says of it (memory by role, bytes sent a step) and what a steady step
    measures (``memory_report``; the bytes of the schedule's step and the optimizer's, no norm
    taken: ``nonfinite="step"``, no clipping)."""
    from flatshard.planner.plan import plan_from_specs
    from flatshard.planner.stage import DEFAULT_BUCKET_SIZE
    from flatshard.wrap.specs import model_specs

    mesh, models, optimizers, stages = mesh_and_chunks("gpipe", stage, nonfinite="step")
    model, opt, run = models[0], optimizers[0], _schedule("gpipe", stages, micro)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    for idx, targets in batches(2, 4 * micro):  # (the second step is a steady one)
        opt.zero_grad()
        model.comm_stats.reset()
        mine = slice(dp_rank * 2 * micro, (dp_rank + 1) * 2 * micro)
        run.step(idx[mine], target=targets[mine])
        opt.step()
    sent = model.comm_stats.total_wire_bytes
    model.wait_for_params()
    with torch.device("meta"):
        chunk = pipeline_chunk(Llama(CFG), mesh["pp"].get_local_rank(), 2)
    specs = model_specs(chunk)
    plan = plan_from_specs(
        specs, world_size=dp, bucket_size=DEFAULT_BUCKET_SIZE, optimizer="sgd-momentum", rank=dp_rank
    )[stage]
    return {"plan": plan.as_dict(), "measured": flatshard.memory_report(model, opt).as_dict(), "sent": sent}


def train_tp_pp(stages: list[int], steps: int = 3, batch: int = 4, dp: int = 1) -> dict:
    """At each of ``stages``: each pipeline chunk of the Llama made tensor-parallel by
    torchtitan's plan, on a (pp, dp, tp) = (2, ``dp``, 2) mesh (each dp rank its slice of
    the batch), under 1F1B with 2 micro-batches, clipped by the optimizer. Per stage: each
    step's loss (the mean over dp, on the last pipeline stage) and norm, and the chunk's
    params gathered in full over tp."""
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, dp, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        chunk = parallelize(pipeline_chunk(Llama(CFG), pp, 2), mesh["tp"])
        model = flatshard.shard(chunk, stage=stage, group=mesh["dp"])
        opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
        pipeline = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        run = Schedule1F1B(pipeline, 2, loss_fn=lm_loss)
        r: dict = {"loss": [], "norm": []}
        for idx, targets in batches(steps, batch):
            losses: list[torch.Tensor] = []
            run.step(idx[mine], target=targets[mine], losses=losses)
            r["norm"].append(opt.clip_grad_norm_(MAX_NORM).item())
            opt.step()
            opt.zero_grad()
            r["loss"].append(_mean_loss(losses, mesh, dp))
        with model.summon_full_params() if stage == 3 else contextlib.nullcontext():
            r["params"] = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()
            }
        r["dtensors"] = sum(isinstance(p, DTensor) for p in model.parameters())
        out[stage] = r
    return out
