"""What ``shard()`` refuses before it touches the model: arguments of the wrong type or
range, a module already sharded or under another data-parallel wrapper, params on devices
it cannot use. Each refusal names the value ([Note: never silent] in ``errors.py``)."""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import nn

from flatshard.planner.stage import BUCKET_KEYWORDS, STAGE3_OPTIONS, Buckets, Stage3, StagePolicy, stage3_only
from flatshard.wrap.module import ShardedModule


def bucket_options(buckets: Buckets | None, keywords: dict) -> Buckets:
    """``shard()``'s ``buckets``, or the ``Buckets`` its former keywords (``bucket_size=...``,
    taken out of ``keywords``) spell, with a ``DeprecationWarning`` naming the new spelling."""
    given = {k: keywords.pop(k) for k in list(keywords) if k in BUCKET_KEYWORDS}
    if buckets is not None and not isinstance(buckets, Buckets):
        raise TypeError(f"buckets must be a flatshard.Buckets, got {type(buckets).__name__}")
    if not given:
        return buckets or Buckets()
    _deprecated(given, buckets, "bucket", "buckets", "Buckets", BUCKET_KEYWORDS)
    return Buckets(**{BUCKET_KEYWORDS[k]: v for k, v in given.items()})


def _deprecated(given: dict, policy: object, what: str, keyword: str, cls: str, renamed: dict) -> None:
    """Former keywords of ``shard()`` (``given``): refused beside the ``keyword=`` policy
    object, else a ``DeprecationWarning`` (pointing at the caller of ``shard``) naming the new
    spelling, fields renamed by ``renamed``."""
    if policy is not None:
        raise TypeError(f"give the {what} options in {keyword}= only, not also as {sorted(given)}")
    old = ", ".join(f"{k}=..." for k in given)
    new = ", ".join(f"{renamed.get(k, k)}=..." for k in given)
    warnings.warn(
        f"shard({old}) is deprecated: pass {keyword}=flatshard.{cls}({new})", DeprecationWarning, stacklevel=4
    )


def stage3_options(stage: int, stage3: Stage3 | None, keywords: dict) -> Stage3 | None:
    """``shard()``'s ``stage3``, or the ``Stage3`` its former keywords (``unit_bytes=...``)
    spell, with a ``DeprecationWarning`` naming the new spelling. As before, at stages 0-2 a
    keyword given its default passes and any other value is refused naming it."""
    unknown = sorted(set(keywords) - set(STAGE3_OPTIONS))
    if unknown:
        raise TypeError(f"shard() got an unexpected keyword argument {unknown[0]!r}")
    if not keywords:
        return stage3
    _deprecated(keywords, stage3, "stage-3", "stage3", "Stage3", {})
    if StagePolicy(stage).gathers_units:
        return Stage3(**keywords)
    defaults = Stage3.__dataclass_fields__
    for name, value in keywords.items():
        if value is not defaults[name].default and value != defaults[name].default:
            raise stage3_only(name, value, stage)
    return None


def check_arguments(module, grad_scale) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedModule):
        raise ValueError(f"{type(module).__name__} is already sharded")
    if grad_scale is not None and (
        isinstance(grad_scale, bool)
        or not isinstance(grad_scale, numbers.Real)
        or not (math.isfinite(grad_scale) and float(grad_scale) > 0)
    ):
        raise ValueError(f"grad_scale must be a positive finite number or None, got {grad_scale!r}")
    _check_not_wrapped(module)


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
