"""Runs that train a tensor-parallel model (the toolkit's Llama with torchtitan's plan, or a
``transformers`` Llama with its own) as TP x DP under flatshard beside the same model in one
process."""

from __future__ import annotations

import contextlib
import copy
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import flatshard
from flatshard.toolkit.models.hf import apply_tensor_parallel_plan, lm_loss, tiny_model
from flatshard.toolkit.models.llama import Llama, LlamaConfig, parallelize

CFG = LlamaConfig()
VOCAB, SEQ = CFG.vocab_size, CFG.seq_len


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every param in full (a DTensor gathered over tp)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def hf_llama(vocab_size: int = VOCAB) -> nn.Module:
    """A tiny ``transformers`` Llama from its config (seed 0: the same on every rank)."""
    torch.manual_seed(0)
    return tiny_model("llama", vocab_size=vocab_size, seq_len=SEQ)


MODELS = {
    "tiny": (Llama, parallelize),
    # (width 256: compiled at stage 3 with a block gathered again for backward, a norm's
    # local shard saved as a view of its bucket failed here, not at the default width 32)
    "wide": (partial(Llama, LlamaConfig(dim=256, n_heads=8)), parallelize),
    "hf": (hf_llama, apply_tensor_parallel_plan),
    # (65 tokens: the embeddings and the head split unevenly over 2 tp ranks, 33 and 32 rows)
    "hf-odd-vocab": (partial(hf_llama, VOCAB + 1), apply_tensor_parallel_plan),
}


def train_tp_dp(
    stages: list[int],
    tp: int,
    model: str = "tiny",
    *,
    bf16: bool = False,
    accumulate: int = 1,
    steps: int = 4,
    batch: int = 2,
    max_norm: float = 0.5,
    compile: str | None = None,
    offload: bool | str = False,
) -> dict:
    """At each of ``stages``: ``model`` (``MODELS``) as TP x DP under flatshard
    (``DistributedOptimizer`` over SGD with momentum, grads clipped by torch's
    ``clip_grad_norm_`` on even steps and by the optimizer's on odd ones) beside the same
    model in one process on the whole batch. Per stage: each step's loss and norm
    differences, each param's largest difference relative to its largest value, the
    reference's last norm (clipping must bite: above ``max_norm``) and the number of DTensor
    params. ``bf16``: flatshard's run keeps bf16 params with fp32 main params (seeded with
    the fp32 values: ``main pieces``), the reference stays fp32. ``accumulate``: each rank's
    batch goes through in that many micro-batches, all but the last under ``no_sync()``.
    ``compile``: flatshard's model runs under ``torch.compile`` with that backend
    (``module.compile()``, so it keeps its class), the reference eagerly. ``offload``:
    ``shard(..., offload=flatshard.Offload())``, at stage 3 ``Offload(units=("",))``: the root
    unit on the host, the blocks on the device ([Note: unit homes] in planner/offload.py);
    "device" for ``offload``: the same homes, stepped on the device ([Note: streamed step])."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    build, parallel = MODELS[model]
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    run = partial(
        _train, mesh=mesh, build=build, parallel=parallel, mp=mp, accumulate=accumulate, compile=compile
    )
    where = offload if isinstance(offload, str) else "host"
    homes = {3: flatshard.Offload(units=("",), step=where)}
    return {
        stage: run(
            stage,
            steps=steps,
            batch=batch,
            max_norm=max_norm,
            offload=homes.get(stage, flatshard.Offload(step=where)) if offload else None,
        )
        for stage in stages
    }


def _train(
    stage: int,
    *,
    mesh,
    build,
    parallel,
    mp,
    accumulate: int,
    compile: str | None,
    steps: int,
    batch: int,
    max_norm: float,
    offload: flatshard.Offload | None = None,
):
    torch.manual_seed(0)
    reference = build()
    model = parallel(copy.deepcopy(reference), mesh["tp"])
    originals = {
        n: p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone()
        for n, p in model.named_parameters()
    }
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    # (compiled at stage 3: the first block freed after forward and gathered again for
    # backward, as in a deeper model, where by default two blocks stay full)
    stage3 = flatshard.Stage3(backward_prefetch="post") if compile and stage == 3 else None
    model = flatshard.shard(
        model, stage=stage, group=mesh["dp"], mixed_precision=mp, stage3=stage3, offload=offload
    )
    if compile:
        from torch._dynamo.utils import counters

        counters.clear()
        model.compile(backend=compile)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.2, momentum=0.9)
    assert offload is None or opt.host_tensors()["main_params"]  # (something lives on the host)
    mains = [
        torch.equal(main, originals[piece.name].reshape(-1)[slice(*piece.in_param)])
        for shards in opt.shards
        for piece, main in shards.main_pieces()
    ]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    out: dict = {"loss": [], "norm": []}
    for step, (idx, targets) in enumerate(batches(steps, batch * dp)):
        ref_loss = lm_loss(reference, idx, targets)
        ref_loss.backward()
        loss = _backward(model, idx, targets, dp_rank * batch, batch, accumulate)
        if step == 0:  # (the full grads summoned, as DTensors of the params' placements)
            out["grads"] = _summoned_grad_error(model, reference)
        if step % 2:
            norm = opt.clip_grad_norm_(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean_loss, group=mesh["dp"].get_group())
        out["loss"].append(abs(mean_loss.item() / dp - ref_loss.item()) / ref_loss.item())
        out["norm"].append(abs(float(norm) - ref_norm.item()) / ref_norm.item())
    with model.summon_full_params() if stage == 3 else contextlib.nullcontext():
        ours = full_values(model)
    theirs = dict(reference.named_parameters())
    out["params"] = {n: ((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max()).item() for n in ours}
    out["ref_norm"] = ref_norm.item()
    out["dtensors"] = sum(isinstance(p, DTensor) for p in model.parameters())
    out["plain"] = sum(not isinstance(p, DTensor) for p in model.parameters())
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["main pieces"] = (sum(mains), len(mains))  # (seeded with the fp32 values, all)
    if compile:  # (graphs Dynamo made: the forward did run compiled)
        out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def _summoned_grad_error(model, reference) -> float:
    """The largest difference between a grad of ``summon_full_params(with_grads=True)`` (made
    full over tp) and the one-process grad, relative to the latter's largest element."""
    theirs = dict(reference.named_parameters())
    with model.summon_full_params(with_grads=True):
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
            for n, p in model.named_parameters()
        }
    errors = [(g - theirs[n].grad).abs().max() / theirs[n].grad.abs().max() for n, g in grads.items()]
    return max(e.item() for e in errors)


def after_to_and_load(stage: int) -> dict:
    """A TP2 model sharded at ``stage`` takes ``.to(float32)``, ``.to("cpu")`` and a state
    dict of halved values (DTensors, as its own ``state_dict()`` gives) after a step; the
    same model in one process loads the same values. Per step the loss difference, then the
    largest param difference."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = Llama()
    model = flatshard.shard(parallelize(copy.deepcopy(reference), mesh["tp"]), stage=stage, group=mesh["dp"])
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    losses = []
    for step, (idx, targets) in enumerate(batches(3, 2)):
        if step == 1:
            model.to(torch.float32)
            model.to("cpu")
            with model.summon_full_params() if stage == 3 else contextlib.nullcontext():  # (stage 3: shards)
                halved = {k: v.detach() * 0.5 for k, v in model.state_dict().items()}
            model.load_state_dict(halved)
            reference.load_state_dict({k: v.detach() * 0.5 for k, v in reference.state_dict().items()})
        loss, ref_loss = model(idx, targets), reference(idx, targets)
        for value, optimizer in ((loss, opt), (ref_loss, ref_opt)):
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(abs(loss.item() - ref_loss.item()) / ref_loss.item())
    with model.summon_full_params() if stage == 3 else contextlib.nullcontext():
        ours = full_values(model)
    return {
        "loss": losses,
        "params": max((ours[n] - p).abs().max().item() for n, p in reference.named_parameters()),
    }


def _backward(model, idx, targets, start: int, batch: int, accumulate: int) -> torch.Tensor:
    """Backward of this rank's ``batch`` sequences from ``start`` in ``accumulate``
    micro-batches (all but the last under ``no_sync()``); returns their mean loss."""
    micro, total = batch // accumulate, torch.zeros(())
    for m in range(accumulate):
        part = slice(start + m * micro, start + (m + 1) * micro)
        with model.no_sync() if m < accumulate - 1 else contextlib.nullcontext():
            value = lm_loss(model, idx[part], targets[part]) / accumulate
            value.backward()
        total += value.detach()
    return total


def checkpoint_leg(path: str, tp: int, stage: int, save: bool, steps: int = 2, batch: int = 4) -> dict:
    """One leg of a run that moves between layouts: the Llama as TP ``tp`` x DP (the rest of
    the ranks; ``tp`` 0: the plain model, no DTensor) at ``stage`` with SGD and momentum.
    ``save``: train ``steps`` steps on the first batches, save to ``path``, then train the next
    ``steps``; else load ``path`` and train the next ``steps``. The global batch is
    ``batch`` sequences a step, split over dp. Returns the mean losses after the save point,
    and the full params at the save point (saving leg) or after loading."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Llama()
    if tp:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        model, group = parallelize(model, mesh["tp"]), mesh["dp"]
        dp_rank, dp = mesh["dp"].get_local_rank(), world // tp
    else:
        group, dp_rank, dp = None, dist.get_rank(), world
    model = flatshard.shard(model, stage=stage, group=group)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.2, momentum=0.9)
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    dp_group = None if group is None else group.get_group()
    return save_or_load_and_continue(
        path, model, opt, save, batches(2 * steps, batch), mine, dp_group, full_values
    )


def save_or_load_and_continue(path, model, opt, save: bool, data, mine: slice, dp_group, values) -> dict:
    """``save``: train on the first half of ``data`` (this rank's ``mine`` of each batch),
    save to ``path`` in the background (written while the second half trains); else load it.
    Then train on the second half. Returns the mean losses over dp of the second half and
    ``values(model)`` at the save point (gathered at stage 3)."""
    steps = len(data) // 2
    if save:
        for idx, targets in data[:steps]:
            model(idx[mine], targets[mine]).backward()
            opt.step()
            opt.zero_grad()
        flatshard.save_checkpoint(path, model, opt, blocking=False)
    else:
        flatshard.load_checkpoint(path, model, opt)
    stage3 = model.flatshard_state.policy.gathers_units
    with model.summon_full_params() if stage3 else contextlib.nullcontext():
        at_save_point = values(model)
    dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    losses = []
    for idx, targets in data[steps:]:
        loss = model(idx[mine], targets[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / dp)
    flatshard.wait_for_checkpoint()
    return {"losses": losses, "params": at_save_point}


def gathered_state(path: str, stage: int, precision: str = "bf16") -> dict:
    """An HF Llama at TP2 x DP1, ``stage``, bf16 params with fp32 main params (or fp32
    params, their own record), after one step: ``full_state_dict()`` and
    ``save_pretrained(path)``. Rank 0 returns the state dict, whether each entry rounds to the
    param gathered in full, and the model read back by ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tensor_parallel_plan(hf_llama(), mesh["tp"])
    bf16 = flatshard.MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None
    model = flatshard.shard(model, stage=stage, group=mesh["dp"], mixed_precision=bf16)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.2)
    idx, targets = batches(1, 2)[0]
    lm_loss(model, idx, targets).backward()
    opt.step()
    state = model.full_state_dict()
    with model.summon_full_params() if stage == 3 else contextlib.nullcontext():
        params = full_values(model)  # (the bf16 params, gathered in full)
    flatshard.save_pretrained(model, path)
    if dist.get_rank() != 0:
        return {}
    rounds = {n: torch.equal(state[n].to(params[n].dtype), params[n]) for n in params}
    read = AutoModelForCausalLM.from_pretrained(path).state_dict()
    return {"state": state, "rounds": rounds, "read": {k: v.clone() for k, v in read.items()}}
