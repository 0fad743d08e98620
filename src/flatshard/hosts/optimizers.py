"""A torch optimizer a host's user built over the model, rebuilt as a ``DistributedOptimizer``
once the model is sharded (Lightning's ``configure_optimizers``, Fabric's ``setup``).

The reasoning is [Note: rebuilt optimizers] below."""

# [Note: rebuilt optimizers]
#
# The user builds ``AdamW(model.parameters(), ...)`` and often an LR scheduler over it before
# the host shards the model; sharding keeps the param objects, so the optimizer's groups still
# name the model's params. ``rebuilt(model, optimizer)`` returns a ``DistributedOptimizer`` of
# the same class, groups and settings (what a scheduler already wrote, ``initial_lr`` and the
# current ``lr``, included), and *retires* the torch optimizer, because references to it live
# on where the host cannot see them (a scheduler the user kept, an attribute):
#
# * its ``param_groups`` and ``state`` become the new optimizer's, so a scheduler built over it
#   goes on setting the learning rate the steps use;
# * its ``step`` and ``zero_grad`` raise, naming the optimizer to call instead: stepping it
#   would update the shards a second time, or nothing.

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, NoReturn

import torch
from torch import nn

from flatshard.optim.composite import unwrap_optimizer
from flatshard.optim.distributed import DistributedOptimizer


def rebuilt(model: nn.Module, optimizer: torch.optim.Optimizer) -> DistributedOptimizer:
    """``optimizer`` (built over the sharded ``model``'s params, not yet stepped) as a
    ``DistributedOptimizer``; the torch optimizer is retired ([Note: rebuilt optimizers]).
    A ``DistributedOptimizer`` comes back as it is."""
    inner = unwrap_optimizer(optimizer)
    if isinstance(inner, DistributedOptimizer):
        return inner
    if optimizer.state:
        raise ValueError(
            f"the {type(optimizer).__name__} has stepped already: a sharded model's optimizer starts from "
            "its shards; hand it over before any step"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        foreign = [p for p in group["params"] if id(p) not in names]
        if foreign:
            raise ValueError(
                f"param group {index} of the {type(optimizer).__name__} holds {len(foreign)} tensor(s) that "
                "are not params of the sharded model: build the optimizer over the model's parameters()"
            )
        trained = [p for p in group["params"] if p.requires_grad]
        if trained:  # (a frozen param never gets a grad: torch would skip it too)
            groups.append({**group, "params": trained})
    new = DistributedOptimizer(model, type(optimizer), params=groups, **_settings(optimizer))
    _retire(optimizer, new)
    return new


def point_at(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """``scheduler`` (and the schedulers it chains) steps ``new`` where it stepped ``old``."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        _note_steps(new)
    for inner in getattr(scheduler, "_schedulers", []):
        point_at(inner, old, new)


def _settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class takes as arguments (torch's ``AdamW`` records
    ``decoupled_weight_decay``, which only ``Adam`` takes); each group keeps all of its own."""
    accepted = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _retire(old: torch.optim.Optimizer, new: DistributedOptimizer) -> None:
    """``old`` shares ``new``'s groups and state, and refuses to step ([Note: rebuilt
    optimizers]); a torch scheduler over it sees a step taken (it checks for one)."""
    name = type(old).__name__

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"this {name} was rebuilt as the flatshard.DistributedOptimizer that steps the sharded model "
            "(the host returned it: Fabric's setup, Lightning's optimizers()); step that one. Its param "
            "groups are this optimizer's, so a scheduler built over this one still sets their lr"
        )

    refuse._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    old.param_groups = new.param_groups
    old.state = new.state  # type: ignore[assignment]
    old.step = refuse  # type: ignore[method-assign]
    old.zero_grad = refuse  # type: ignore[method-assign]
    old._opt_called = True  # type: ignore[attr-defined]


def _note_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's schedulers do when they are built (they check the
    mark, and that a step came before theirs, to warn about a misordered loop)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step, ref = optimizer.step, weakref.ref(optimizer)

    @functools.wraps(step)
    def noted(*args: Any, **kwargs: Any) -> Any:
        ref()._opt_called = True  # type: ignore[union-attr]
        return step(*args, **kwargs)

    noted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = noted  # type: ignore[method-assign]
