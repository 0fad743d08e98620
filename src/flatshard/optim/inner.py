"""The inner optimizer of ``DistributedOptimizer``: its param groups, the class of each, and
whether a class steps flat runs or whole-param runs.

The reasoning is [Note: elementwise optimizers] below."""

# [Note: elementwise optimizers]
#
# Flat shards cut params anywhere, so an inner optimizer stepping them sees pieces of params
# glued together: exact only for rules that update every element from that element's own
# grad and state (plus per-group scalars such as the step count). The classes in
# ``ELEMENTWISE`` are known to be such rules and step *flat runs*. Every other class (a
# subclass of one too: it may override ``step``), unless the caller declares
# ``elementwise=True``, steps *whole-param runs*: real tensors of their params' shapes
# ([Note: optimizer runs] in ``shard_map.py``), so Muon orthogonalizes whole matrices and
# a per-tensor norm sees the whole tensor. That needs the layout to hold each of its params
# whole on one rank ([Note: whole-param buckets] in ``layout.py``); where it does not, the
# optimizer is refused, naming the params and the ``shard(whole_params=...)`` that fixes it.
# A refusal list let a per-tensor rule through silently (a normalised SGD stepped fragments
# as if they were tensors); this rule cannot: an unknown class is stepped whole or refused.
# ``UNSUPPORTED`` classes cannot step one rank's shards at all and are refused outright.

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from flatshard.optim.blockwise import state_block
from flatshard.optim.composite import class_defaults
from flatshard.optim.grouped import GroupedOptimizer, accepted, check_grouped
from flatshard.wrap.module import ShardState

ELEMENTWISE = frozenset(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
    )
    if hasattr(torch.optim, name)
)
UNSUPPORTED = {
    "LBFGS": "re-evaluates a closure many times inside one step",
    "SparseAdam": "takes sparse grads, and flat buffers hold dense ones",
}
"""torch classes that cannot step a rank's shards at all, with the reason."""


def check_optimizer_class(
    optimizer_class: type,
    defaults: dict[str, Any] | None = None,
    *,
    elementwise: bool = False,
    groups: list[dict[str, Any]] | None = None,
    classes: Sequence[type] = (),
) -> None:
    """Refuse a class that is not a torch optimizer or cannot step shards, and (given the
    param groups and each one's class) hyperparameters a class refuses, before anything is
    built; a ``HybridDeviceOptimizer``'s classes are checked in its place."""
    from flatshard.optim.hybrid import HybridDeviceOptimizer

    defaults = defaults or {}
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, HybridDeviceOptimizer):
        if any(cls is not optimizer_class for cls in classes):
            raise ValueError(
                "a HybridDeviceOptimizer steps every param group: no group can name its own class"
            )
        for key in ("cpu_optimizer_class", "device_optimizer_class"):
            if defaults.get(key) is not None:
                _check_hybrid_class(defaults[key], elementwise)
        return
    for cls in dict.fromkeys([optimizer_class, *classes]):
        _check_class(cls)
    if groups is None:
        return
    if all(cls is optimizer_class for cls in classes):
        class_defaults(optimizer_class, defaults, groups)
    else:
        check_grouped(groups, classes, defaults)


def _check_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {cls!r}")
    for name, reason in UNSUPPORTED.items():
        base = getattr(torch.optim, name, None)
        if base is not None and issubclass(cls, base):
            raise ValueError(f"{cls.__name__} cannot step a rank's shards: it {reason}")


def _check_hybrid_class(cls: Any, elementwise: bool) -> None:
    """The host and device classes of a ``HybridDeviceOptimizer`` step flat runs only."""
    _check_class(cls)
    if state_block(cls, {}) is not None:  # (declared elementwise or not: [Note: blockwise state])
        raise ValueError(
            f"{cls.__name__} keeps its state in blocks of each param, and a HybridDeviceOptimizer "
            "inside DistributedOptimizer steps flat runs that glue params together: offload all of "
            "it (Offload(), the default optimizer=1.0) or none"
        )
    if cls not in ELEMENTWISE and not elementwise:
        raise ValueError(
            f"{cls.__name__} is not known to be elementwise, and a HybridDeviceOptimizer inside "
            f"DistributedOptimizer steps flat runs: use one of {_elementwise_names()}, or pass "
            f"elementwise=True if {cls.__name__} updates each element from its own grad and state alone"
        )


def _elementwise_names() -> str:
    return ", ".join(sorted(c.__name__ for c in ELEMENTWISE))


def steps_flat(cls: type, optimizer_class: type, elementwise: bool) -> bool:
    """Whether ``cls`` steps flat runs ([Note: elementwise optimizers])."""
    from flatshard.optim.hybrid import HybridDeviceOptimizer

    declared = elementwise and cls is optimizer_class
    return cls in ELEMENTWISE or declared or issubclass(cls, HybridDeviceOptimizer)


def param_groups(
    state: ShardState, params: Iterable[Any] | None, optimizer_class: type
) -> tuple[list[dict], dict[str, int], list[type]]:
    """The user's param groups as (hyperparameters, {param name: group index}, each group's
    class: its ``"optimizer_class"`` entry, else ``optimizer_class``)."""
    names = {id(p): n for bset in state.sets.values() for n, p in zip(bset.names, bset.params, strict=True)}
    if params is None:
        return [{}], dict.fromkeys(names.values(), 0), [optimizer_class]
    groups = list(params)
    if not groups:
        raise ValueError("params is an empty list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    hypers: list[dict[Any, Any]] = []
    group_of: dict[str, int] = {}
    classes: list[type] = []
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"param group {index} must be a dict with a 'params' entry, got {type(group).__name__}"
            )
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        for p in members:
            name = names.get(id(p))
            if name is None and isinstance(p, torch.Tensor) and p.numel() == 0:
                continue  # a param of no elements has nothing to step (kept out of the buffers)
            if name is None:
                raise ValueError(
                    f"param group {index} holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                    "param of the sharded model"
                )
            if name in group_of:
                raise ValueError(f"param {name!r} is in param groups {group_of[name]} and {index}")
            group_of[name] = index
        hypers.append({k: v for k, v in group.items() if k not in ("params", "optimizer_class")})
        classes.append(group.get("optimizer_class", optimizer_class))
    return hypers, group_of, classes


def whole_shapes(state: ShardState, group_of: dict[str, int], classes: list[type], whole: list[bool]):
    """{name: shape} of every param of a group that steps whole-param runs; a ``ValueError``
    naming the params the layout cuts across ranks, and what fixes it."""
    shapes = {}
    for bset in state.sets.values():
        for name, p in zip(bset.names, bset.params, strict=True):
            group = group_of.get(name)
            if group is not None and whole[group]:
                shapes[name] = tuple(p.shape)
        cut = _cut_params(bset.layout, shapes)
        if cut:
            group = group_of[cut[0]]
            cls = classes[group].__name__
            listed = ", ".join(repr(n) for n in cut[:3]) + (
                f" and {len(cut) - 3} more" if len(cut) > 3 else ""
            )
            raise ValueError(
                f"{cls} (param group {group}) is not known to be elementwise, so it steps each param "
                f"as a whole tensor, but this {bset.layout.world_size}-rank layout cuts {listed} across "
                f"ranks: shard the model with flatshard.shard(..., whole_params=<the params of "
                f"{cls}'s groups>), or pass elementwise=True if {cls} updates each element from its "
                "own grad and state alone"
            )
    return shapes


def _cut_params(layout, names: Iterable[str]) -> list[str]:
    """The params among ``names`` that lie in more than one rank's shard."""
    wanted = set(names)
    return [
        slot.name
        for buffer in layout.buffers
        for bucket in buffer.buckets
        if bucket.sharded
        for slot in bucket.params
        if slot.name in wanted and bucket.owner(slot) is None
    ]


def make_inner(
    optimizer_class: type,
    classes: list[type],
    groups: list[dict[str, Any]],
    defaults: dict[str, Any],
    describe: Callable[[torch.Tensor], str],
) -> torch.optim.Optimizer:
    """The inner optimizer over ``groups`` of run tensors: ``optimizer_class`` itself, or a
    ``GroupedOptimizer`` when groups name other classes. A class that refuses one of its
    tensors (Muon takes only matrices) is reported with what ``describe`` says of it."""
    try:
        if all(cls is optimizer_class for cls in classes):
            return optimizer_class(groups, **defaults)
        return GroupedOptimizer(groups, classes, defaults)
    except (TypeError, ValueError) as e:
        for index, (group, cls) in enumerate(zip(groups, classes, strict=True)):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for tensor in group["params"]:
                try:
                    cls([{**hyper, "params": [tensor]}], **accepted(cls, defaults))
                except (TypeError, ValueError) as refusal:
                    raise type(e)(
                        f"{cls.__name__} (param group {index}) refused {describe(tensor)} of shape "
                        f"{tuple(tensor.shape)}: {refusal}"
                    ) from None
        raise
