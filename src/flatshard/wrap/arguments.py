"""What ``shard()`` refuses before it touches the model: arguments of the wrong type or
range, a module already sharded or under another data-parallel wrapper, params on devices
it cannot use. Each refusal names the value ([Note: never silent] in ``errors.py``)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from flatshard.planner.stage import Buckets
from flatshard.wrap.module import ShardedModule


def bucket_options(buckets: Buckets | None) -> Buckets:
    """``shard()``'s ``buckets``, checked (default: ``Buckets()``)."""
    if buckets is not None and not isinstance(buckets, Buckets):
        raise TypeError(f"buckets must be a flatshard.Buckets, got {type(buckets).__name__}")
    return buckets or Buckets()


def check_arguments(module, grad_scale) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedModule):
        raise ValueError(f"{type(module).__name__} is already sharded")
    check_grad_scale(grad_scale, "grad_scale")
    _check_not_wrapped(module)


def check_grad_scale(grad_scale: object, what: str) -> None:
    if grad_scale is not None and (
        isinstance(grad_scale, bool)
        or not isinstance(grad_scale, numbers.Real)
        or not (math.isfinite(grad_scale) and float(grad_scale) > 0)
    ):
        raise ValueError(f"{what} must be a positive finite number or None, got {grad_scale!r}")


def check_flags(**flags: object) -> None:
    """Options that are switches take a bool: a string such as ``"no"`` is truthy."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_not_wrapped(module: nn.Module) -> None:
    """A module already under DDP or FSDP would be synced twice, or (DDP at stage 0) have its
    flat views replaced under it so that no step reaches the params: refuse it."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers = (DistributedDataParallel, DataParallel, FullyShardedDataParallel, FSDPModule)
    for name, sub in module.named_modules():
        if isinstance(sub, ShardedModule):
            raise ValueError(
                f"submodule {name!r} is already sharded by flatshard.shard(): shard the whole model once. "
                "For FSDP2's one fully_shard per block, shard the root at stage 3 with "
                "stage3=flatshard.Stage3(units=[BlockClass]) (each block is then gathered and freed "
                "on its own)"
            )
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            where = "the module" if not name else f"submodule {name!r}"
            raise ValueError(
                f"{where} ({type(sub).__name__}(sparse=True)) gives sparse grads, which flat grad "
                "buffers cannot hold: build it with sparse=False"
            )
        if isinstance(sub, wrappers):
            where = "the module" if not name else f"submodule {name!r}"
            inner = "its .module" if isinstance(sub, (DistributedDataParallel, DataParallel)) else "the model"
            raise TypeError(
                f"{where} is already data-parallel ({type(sub).__name__}); flatshard.shard does the data "
                f"parallelism itself: pass {inner} before wrapping it"
            )


def check_current_device(device: torch.device, backend: str) -> None:
    """Params on ``cuda:k`` under NCCL need ``cuda:k`` to be the current device: NCCL runs
    the small control collectives (and torch's own barrier) on the current device, and eight
    ranks all on ``cuda:0`` crash or hang there. ``ValueError`` naming both, before any
    collective."""
    if device.type != "cuda" or backend != "nccl" or device.index is None:
        return
    current = torch.cuda.current_device()
    if current != device.index:
        raise ValueError(
            f"the params are on {device} but the current CUDA device is cuda:{current}: under NCCL "
            f"each rank needs its own device current. Call torch.cuda.set_device({device.index}) "
            "(torchrun: torch.cuda.set_device(int(os.environ['LOCAL_RANK']))) before "
            "init_process_group and shard, as DDP and FSDP2 scripts do"
        )


def check_devices(named: list[tuple[str, nn.Parameter]]) -> None:
    if not named:
        return
    device = named[0][1].device
    for name, p in named:
        if p.device != device:
            raise ValueError(
                f"param {name!r} is on {p.device} but {named[0][0]!r} is on {device}: one device"
            )
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"param {name!r} has layout {p.layout}; only dense params can be flattened")
        if p.is_complex():
            raise ValueError(
                f"param {name!r} is complex ({p.dtype}): flat buffers hold real dtypes. Keep it as "
                "a real param with a last dimension of 2 and view it with torch.view_as_complex "
                "in forward"
            )
