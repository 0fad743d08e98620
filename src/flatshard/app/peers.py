"""The systems ``flatshard bench`` compares, each wired the way its users wire it.

A peer turns a fresh fp32 copy of the model into a ``Trainer``: one training step on a
batch, and, where it can be counted from outside, the model-state bytes the rank holds.
Every peer uses AdamW with the same hyperparameters; torch's own peers and DeepSpeed's use
their documented entry points (``DDP``, ``fully_shard`` per block then the root,
``ZeroRedundancyOptimizer``, ``deepspeed.initialize`` with ZeRO stage 1-3).

With a compute dtype (bf16), each peer runs mixed precision the way its users do: fp32
params (or fp32 master params) and bf16 compute. DDP and the optimizer peers use
``torch.autocast``; FSDP2 ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` (as
torchtitan); DeepSpeed its ``bf16`` mode; flatshard ``MixedPrecision(param_dtype)``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.memory import memory_report
from flatshard.planner.stage import STAGES, StagePolicy
from flatshard.units.unit_tree import find_units

ADAMW: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1}


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counted: torch.optim.Optimizer | None  # whose state memory_report counts (None: not countable)
    engine: Any = None  # a DeepSpeed engine, which runs backward and step itself
    model_state_bytes: int | None = None  # measured at the last step with measure=True
    autocast: torch.dtype | None = None  # forward under torch.autocast to this dtype

    def step(self, x: torch.Tensor, y: torch.Tensor, *, measure: bool = False) -> float:
        if self.engine is not None:
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
            return loss.item()
        if self.autocast is None:
            loss = self.model(x, y)
        else:
            with torch.autocast(x.device.type, dtype=self.autocast):
                loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        if measure and self.counted is not None:  # before zero_grad: grads in buckets count
            self.model_state_bytes = memory_report(self.model, self.counted).total
        self.optimizer.zero_grad()
        return loss.item()


Peer = Callable[[nn.Module, int | None, torch.dtype | None], Trainer]
"""(a fresh fp32 copy of the model, bucket size in elements or None, the compute dtype of
mixed precision or None) -> its trainer."""


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the modules stage 3 gathers one at a time by default (the children
    of its ``nn.ModuleList``s, or a ``transformers`` model's decoder layers)."""
    return [m for unit in find_units(model)[1:] for m in unit.modules]


def _ddp(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
    model = DDP(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    return Trainer(model, optimizer, optimizer, autocast=compute)


def _torch_zero1(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
    model = DDP(model, gradient_as_bucket_view=True)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    return Trainer(model, optimizer, optimizer.optim, autocast=compute)


def _fsdp2(reshard_after_forward: bool, offload: bool = False) -> Peer:
    """``fully_shard`` per block, then the root; ``reshard_after_forward=False`` keeps params
    unsharded between forward and backward (ZeRO-2-like); ``offload``: ``CPUOffloadPolicy``
    (sharded params, grads and so the optimizer state on the host). Its resident state is
    counted from the local shards of its DTensors."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
        pin = next(model.parameters()).device.type == "cuda"  # (a CPU run on a GPU machine pins nothing)
        where = CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy()
        reshard = reshard_after_forward
        for block in blocks(model):
            fully_shard(
                block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=where
            )
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=where)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        return Trainer(model, optimizer, optimizer)

    return wrap


def _deepspeed(stage: int, offload: bool = False) -> Peer:
    """DeepSpeed ZeRO ``stage`` with torch's AdamW as the client optimizer (on CPU with
    ``DS_ACCELERATOR=cpu``); ``offload``: ZeRO-Offload, the optimizer (and at stage 3 the
    params) on the host, stepped by DeepSpeed's own ``DeepSpeedCPUAdam`` (built on first use,
    minutes). Its model state is not countable from outside: see RSS."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        deepspeed = prepare("deepspeed-1")
        optimizer: torch.optim.Optimizer | None = torch.optim.AdamW(model.parameters(), **ADAMW)
        zero: dict = {"stage": stage}
        extra: dict = {}
        if offload:  # (DeepSpeed steps an offloaded optimizer with its CPU Adam, from the config)
            pin = next(model.parameters()).device.type == "cuda"
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
            if StagePolicy(stage).shards_params:  # (ZeRO-3's param offload)
                zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
            hyper = {**ADAMW, "betas": list(ADAMW.get("betas", (0.9, 0.999)))}
            extra["optimizer"] = {"type": "AdamW", "params": hyper}
            optimizer = None
        if bucket_size is not None:
            zero.update(reduce_bucket_size=bucket_size, allgather_bucket_size=bucket_size)
        config = {
            "train_micro_batch_size_per_gpu": 1,  # the batch is given; this only satisfies the config
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told; no other peer clips
            "steps_per_print": 2**31 - 1,
            **extra,
        }
        if compute is not None:
            if compute != torch.bfloat16:
                raise ValueError(f"the DeepSpeed peers run fp32 or bf16, not {compute}")
            config["bf16"] = {"enabled": True}
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model.parameters() if optimizer is None else None,
            config=config,
            dist_init_required=False,
        )
        return Trainer(engine.module, ds_optimizer, None, engine=engine)

    return wrap


def _flatshard(stage: int, **options) -> Peer:
    """``flatshard.shard(model, stage=stage, **options)`` with ``DistributedOptimizer(AdamW)``
    (torch's AdamW itself at stage 0 in fp32)."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        kwargs: dict[str, Any] = dict(options)
        if bucket_size is not None:
            kwargs["buckets"] = flatshard.Buckets(size=bucket_size)
        if compute is not None:
            kwargs["mixed_precision"] = flatshard.MixedPrecision(param_dtype=compute)
        model = flatshard.shard(model, stage=stage, **kwargs)
        optimizer: torch.optim.Optimizer
        if not model.flatshard_state.policy.shards_optimizer and compute is None:
            optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        else:
            optimizer = flatshard.DistributedOptimizer(model, torch.optim.AdamW, nonfinite="step", **ADAMW)
        return Trainer(model, optimizer, optimizer)

    return wrap


def _hybrid(fraction: float, overlap: bool) -> Peer:
    """torch DDP + ``HybridDeviceOptimizer(AdamW)`` with ``fraction`` of the params on the host."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        model = DDP(model, gradient_as_bucket_view=True)
        optimizer = flatshard.HybridDeviceOptimizer(
            model.parameters(),
            offload_fraction=fraction,
            cpu_optimizer_class=torch.optim.AdamW,
            overlap=overlap,
            **ADAMW,
        )
        return Trainer(model, optimizer, optimizer, autocast=compute)

    return wrap


def _owner(bucket_cap_bytes: int) -> Peer:
    """torch DDP + ``OwnerShardedOptimizer(AdamW)``; ``bucket_cap_bytes=0``: one broadcast per param."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        model = DDP(model, gradient_as_bucket_view=True)
        optimizer = flatshard.OwnerShardedOptimizer(
            model.parameters(), torch.optim.AdamW, bucket_cap_bytes=bucket_cap_bytes, **ADAMW
        )
        return Trainer(model, optimizer, optimizer, autocast=compute)

    return wrap


# -- Muon on the blocks' matrices, AdamW on the rest (embeddings, norms, biases, head) --------
MUON: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """Muon's params in the usual recipe: the blocks' 2-D weights."""
    return param.ndim == 2 and name.startswith("blocks.")


def _muon_groups(model: nn.Module, muon: type = torch.optim.Muon) -> list[dict]:
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters() if p.requires_grad]
    mats = [p for n, p in named if is_hidden_matrix(n, p)]
    return [
        {"params": mats, "optimizer_class": muon, **MUON},
        {"params": [p for n, p in named if not is_hidden_matrix(n, p)]},
    ]


def _ddp_muon(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
    """torch DDP, then torch's Muon and AdamW over the full params on every rank (one
    ``GroupedOptimizer``, which only hands each group to its torch class)."""
    model = DDP(model, gradient_as_bucket_view=True)
    groups = _muon_groups(model)
    optimizer = flatshard.GroupedOptimizer(
        groups, [g.pop("optimizer_class", torch.optim.AdamW) for g in groups], ADAMW
    )
    return Trainer(model, optimizer, optimizer, autocast=compute)


class FullTensorMuon(torch.optim.Optimizer):
    """Muon over FSDP2's sharded params the way its users write it: each step every rank
    gathers each matrix and its grad (``full_tensor()``), runs torch's Muon on the whole
    matrix (its state is whole too, on every rank) and keeps its own rows."""

    def __init__(self, params, **hyper) -> None:
        super().__init__(params, {})
        self.full = [p.full_tensor().detach().clone() for g in self.param_groups for p in g["params"]]
        self.inner = torch.optim.Muon(self.full, **hyper)

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        for p, full in zip(params, self.full, strict=True):
            full.grad = p.grad.full_tensor()
        self.inner.step()
        rank, size = dist.get_rank(), dist.get_world_size()
        for p, full in zip(params, self.full, strict=True):
            local = p.to_local()
            local.copy_(full.chunk(size, dim=0)[rank][: local.shape[0]])


def _fsdp2_muon(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
    trainer = _fsdp2(False)(model, bucket_size, compute)
    mats, rest = _muon_groups(trainer.model)
    muon = FullTensorMuon(mats.pop("params"), **MUON)
    adamw = torch.optim.AdamW(rest["params"], **ADAMW)
    optimizer = _Both(muon, adamw)
    return Trainer(trainer.model, optimizer, None)


class _Both(torch.optim.Optimizer):
    """Two optimizers stepped as one (the training loop calls one step and one zero_grad)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def _flatshard_muon(stage: int) -> Peer:
    """``shard(model, stage, whole_params=<the matrices>)`` and one ``DistributedOptimizer``
    with a Muon group and an AdamW group."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        kwargs: dict[str, Any] = (
            {} if bucket_size is None else {"buckets": flatshard.Buckets(size=bucket_size)}
        )
        if compute is not None:
            kwargs["mixed_precision"] = flatshard.MixedPrecision(param_dtype=compute)
        model = flatshard.shard(model, stage=stage, whole_params=is_hidden_matrix, **kwargs)
        optimizer = flatshard.DistributedOptimizer(
            model, torch.optim.AdamW, params=_muon_groups(model), nonfinite="step", **ADAMW
        )
        return Trainer(model, optimizer, optimizer)

    return wrap


def prepare(name: str):
    """Import what peer ``name`` needs beyond torch (before memory is measured, so that no
    peer's RSS counts its imports); the DeepSpeed module for DeepSpeed's peers."""
    if name.startswith("deepspeed"):  # (the bench's ranks run on the host, gloo: a GPU machine's too)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        return deepspeed
    return None


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _block_compiled(peer: Peer) -> Peer:
    """``peer`` with each block compiled (inductor) before it wraps the model: torchtitan's
    recipe for FSDP2, and the one flatshard's hooks keep graph-break free at every stage."""

    def wrap(model: nn.Module, bucket_size: int | None, compute: torch.dtype | None) -> Trainer:
        for block in blocks(model):
            block.compile()
        return peer(model, bucket_size, compute)

    return wrap


DEEPSPEED_PEERS: dict[str, Peer] = {f"deepspeed-{s}": _deepspeed(s) for s in (1, 2, 3)}
STAGE_PEERS: dict[str, Peer] = {
    "ddp": _ddp,
    "torch-zero1": _torch_zero1,
    "fsdp2": _fsdp2(False),
    "fsdp2-zero3": _fsdp2(True),
    **{f"flatshard-{s}": _flatshard(s) for s in STAGES},
    "flatshard-3-no-reshard": _flatshard(
        3, stage3=flatshard.Stage3(reshard_after_forward=False)
    ),  # as "fsdp2"
}
OPTIMIZER_PEERS: dict[str, Peer] = {
    "ddp": _ddp,
    "torch-zero1": _torch_zero1,
    "owner": _owner(25 * 2**20),
    "owner-per-param": _owner(0),
    "hybrid-0.5": _hybrid(0.5, overlap=True),
    "hybrid-1.0": _hybrid(1.0, overlap=True),
    "hybrid-1.0-sync": _hybrid(1.0, overlap=False),
}
OFFLOAD_PEERS: dict[str, Peer] = {  # (not run by default)
    "fsdp2-zero3-offload": _fsdp2(True, offload=True),
    "deepspeed-3-offload": _deepspeed(3, offload=True),
    **{f"flatshard-{s}+offload": _flatshard(s, offload=flatshard.Offload()) for s in (1, 3)},
    # ([Note: streamed step]: the same homes, the step on the device)
    **{
        f"flatshard-{s}+offload-device": _flatshard(s, offload=flatshard.Offload(step="device"))
        for s in (1, 3)
    },
}
COMPILED_PEERS: dict[str, Peer] = {  # (not run by default: inductor compiles in every peer process)
    f"{name}+compile": _block_compiled(STAGE_PEERS[name])
    for name in ("ddp", "fsdp2", "flatshard-0", "flatshard-1", "flatshard-2", "flatshard-3")
}
MUON_PEERS: dict[str, Peer] = {  # (not run by default)
    "ddp+muon": _ddp_muon,
    "fsdp2+muon": _fsdp2_muon,
    **{f"flatshard-{s}+muon": _flatshard_muon(s) for s in (1, 2, 3)},
}
RING_UNITS: dict[str, tuple[int, int]] = {
    "ddp": (2, 0),  # an all-reduce of the grads
    "torch-zero1": (2, 1),  # an all-reduce of the grads, the owners' params broadcast
    "fsdp2": (1, 1),  # a reduce-scatter of the grads, a gather of the params for forward
    "fsdp2-zero3": (1, 2),  # ... and again for backward
    "deepspeed-1": (1, 1),
    "deepspeed-2": (1, 1),
    "deepspeed-3": (1, 2),
    "flatshard-0": (2, 0),
    "flatshard-1": (1, 1),
    "flatshard-2": (1, 1),
    "flatshard-3": (1, 2),
    "flatshard-3-no-reshard": (1, 1),
    "fsdp2-zero3-offload": (1, 2),
    "deepspeed-3-offload": (1, 2),
    "flatshard-1+offload": (1, 1),
    "flatshard-3+offload": (1, 2),
    "flatshard-1+offload-device": (1, 1),
    "flatshard-3+offload-device": (1, 2),
}
"""What a peer's algorithm must send per step, in ring collectives over all the grads and
all the params: (grad units, param units); a unit moves (N - 1) / N of those bytes per rank
(an all-reduce is two)."""


def theory_bytes(peer: str, world_size: int, grad_bytes: int, param_bytes: int) -> int | None:
    """The bytes one rank of ``peer`` must send per step by ``RING_UNITS`` (None: not listed)."""
    if peer not in RING_UNITS:
        return None
    grads, params = RING_UNITS[peer]
    return (grads * grad_bytes + params * param_bytes) * (world_size - 1) // world_size


PEERS: dict[str, Peer] = {
    **STAGE_PEERS,
    **DEEPSPEED_PEERS,
    **OPTIMIZER_PEERS,
    **OFFLOAD_PEERS,
    **COMPILED_PEERS,
    **MUON_PEERS,
}


def default_peers() -> list[str]:
    """DDP, the torch peers, DeepSpeed ZeRO-1/2/3 when installed, flatshard's stages."""
    torch_peers = [name for name in STAGE_PEERS if not name.startswith("flatshard")]
    ours = [name for name in STAGE_PEERS if name.startswith("flatshard")]
    return torch_peers + (list(DEEPSPEED_PEERS) if deepspeed_installed() else []) + ours
