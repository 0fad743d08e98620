"""flatshard under Hugging Face accelerate: ``prepare(accelerator, model, optimizer, ...)`` in
place of ``accelerator.prepare(...)`` ([Note: hosted training] in ``hf.py``)."""

from __future__ import annotations

from typing import Any

import torch

from flatshard.engine.dynamo import uncompiled
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.optim.grad_scaler import ShardedGradScaler
from flatshard.wrap.module import ShardedModule


def prepare(accelerator: Any, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` for a sharded model and its ``DistributedOptimizer``
    (and any data loaders and schedulers): the model is prepared for autocast only, with no
    DDP on top (flatshard reduces its grads), fp16's scaler becomes a ``ShardedGradScaler``,
    and the rest is accelerate's own. Then ``accelerator.backward``, ``accumulate(model)``
    (through ``model.no_sync``) and ``clip_grad_norm_(model.parameters(), ...)`` (the global
    norm) work as they do under DDP. Returns what ``accelerator.prepare`` returns."""
    models = [
        o for o in objects if isinstance(o, torch.nn.Module) and isinstance(uncompiled(o), ShardedModule)
    ]
    if not models:
        raise TypeError(
            "flatshard.hosts.accelerate.prepare() takes a model flatshard.shard() returned among its "
            "objects; prepare other models with accelerator.prepare"
        )
    for o in objects:
        if isinstance(o, torch.optim.Optimizer) and not isinstance(o, DistributedOptimizer):
            raise TypeError(
                f"a {type(o).__name__} beside a sharded model: flatshard steps its own shards; use "
                "flatshard.DistributedOptimizer(model, torch.optim.AdamW, ...) (the same class and settings)"
            )
    use_sharded_scaler(accelerator)
    for model in models:  # (then accelerator.prepare finds it prepared and wraps nothing around it)
        accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    return accelerator.prepare(*objects)


def use_sharded_scaler(accelerator: Any) -> None:
    """fp16: the accelerator's ``GradScaler`` becomes a ``ShardedGradScaler`` with its
    settings ([Note: grad scaler]); before the optimizer is prepared, which keeps it."""
    old = getattr(accelerator, "scaler", None)
    if old is None or isinstance(old, ShardedGradScaler):
        return
    accelerator.scaler = ShardedGradScaler(
        accelerator.device.type,
        init_scale=old.get_scale() if old.is_enabled() else 2.0**16,
        growth_factor=old.get_growth_factor(),
        backoff_factor=old.get_backoff_factor(),
        growth_interval=old.get_growth_interval(),
        enabled=old.is_enabled(),
    )
