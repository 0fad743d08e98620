"""Torch optimizers that delegate the update to sub-optimizers over stand-in tensors.

``CompositeOptimizer`` holds the
user's params in ``param_groups``; subclasses pair each param with a *stand-in* (a host
copy, an fp32 master, or the param itself) and build ordinary torch optimizers over the
stand-ins with ``add_sub``. This class keeps the two views consistent: hyperparameters
flow outer -> sub before every sub-step, ``state`` holds the sub-optimizers' own per-param
dicts, and state dicts are torch's format keyed by the user's params.

The reasoning is [Note: composite optimizers] below."""

# [Note: composite optimizers]
#
# ``HybridDeviceOptimizer`` and ``OwnerShardedOptimizer`` are torch optimizers over the user's
# params that delegate the update to *sub-optimizers* (ordinary torch optimizers) over *stand-
# ins*: a host fp32 copy of an offloaded param, an fp32 master of a 16-bit param, or the param
# itself. Invariants, each tested:
#
# * **One source of truth for hyperparameters.** ``param_groups`` holds the user's params and
#   every hyperparameter of the sub-optimizer class (filled from the class's own defaults, so
#   a group shows ``betas`` even on a rank that updates none of its params). Each sub-
#   optimizer group mirrors one outer group; before every sub-step the outer values are copied
#   onto it (only keys the sub-optimizer knows), so LR schedulers and hand edits reach every
#   sub-optimizer.
# * **One source of truth for state.** ``state[param]`` is *the same dict object* as the sub-
#   optimizer's ``state[stand_in]`` (re-linked after each step and load, never copied, and
#   ``state`` is mutated in place so that a ``DistributedOptimizer`` holding it sees it).
# * **State dicts are keyed like torch's**: ``state_dict()`` is torch's format over the outer
#   groups (params numbered in group order), so a plain torch optimizer's state dict loads
#   into a composite one and back. ``load_state_dict`` hands each sub-optimizer the entries of
#   its stand-ins, and the sub-optimizer casts them to its stand-in's device and dtype (fp32
#   on the host for offloaded params), not to the user's param's. Masters of 16-bit params
#   travel under ``"master_params"`` so a resume continues from the fp32 values, not from the
#   rounded 16-bit ones.
# * **A stand-in's grad is the param's grad**, copied (or cast) at step time; a param whose
#   grad is None gives a stand-in whose grad is None, so it is skipped exactly as torch skips
#   it.

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SubOptimizer:
    """A torch optimizer over stand-ins, and which outer group each of its groups mirrors."""

    optimizer: torch.optim.Optimizer
    groups: list[int]  # outer group index of each of the optimizer's groups
    params: list[torch.Tensor]  # the user's params, in the optimizer's order
    stand_ins: list[torch.Tensor] = field(default_factory=list)

    def step(self) -> None:
        self.optimizer.step()


def run_closure(closure) -> Any:
    """What ``step(closure)`` does first in every torch optimizer: re-evaluate the loss."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer under a host library's wrapper (accelerate's ``AcceleratedOptimizer``
    holds it as ``.optimizer``), or ``optimizer`` itself."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def class_defaults(
    optimizer_class: type, defaults: dict[str, Any], groups: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """Every hyperparameter ``optimizer_class(params, **defaults)`` puts in a group. The
    class validates ``defaults`` (and each of ``groups``' own hyperparameters) here, on a
    probe, so a bad value fails before anything is built, as a ``TypeError`` or
    ``ValueError`` naming the class and the values."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    # 2-D probes: matrix optimizers (Muon) refuse other shapes, and every other takes them.
    probes = [{**g, "params": [torch.zeros(1, 1, requires_grad=True)]} for g in (groups or [{}])]
    name = optimizer_class.__name__
    try:
        probe = optimizer_class(probes, **defaults)
    except (TypeError, ValueError, IndexError) as e:
        given = {**defaults, **({"param groups": list(groups)} if any(groups) else {})}
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(f"{name} refused the hyperparameters {given}: {e}") from None
    filled = {k: v for k, v in probe.defaults.items() if k != "params"}
    for index, group in enumerate(groups):  # torch checks only the constructor's values
        for key, value in group.items():
            if not _same_kind(value, filled.get(key)):
                raise TypeError(
                    f"param group {index}: {key}={value!r} for {name}, whose {key} is like {filled[key]!r}"
                )
    return filled


def _same_kind(value: Any, default: Any) -> bool:
    """Whether a group's ``value`` can stand where the class's ``default`` does: a number for
    a number, a tuple of numbers as long for a tuple (anything for other defaults)."""
    number = (int, float, torch.Tensor)
    if isinstance(default, bool) or default is None:
        return True
    if isinstance(default, (int, float)):
        return isinstance(value, number) and not isinstance(value, bool)
    if isinstance(default, tuple):
        return (
            isinstance(value, (tuple, list))
            and len(value) == len(default)
            and all(_same_kind(v, d) for v, d in zip(value, default, strict=True))
        )
    return True


class CompositeOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that update the user's params through sub-optimizers."""

    def __init__(self, params: Iterable[Any], classes: Sequence[type], defaults: dict[str, Any]) -> None:
        self.subs: list[SubOptimizer] = []
        filled = [class_defaults(cls, defaults) for cls in classes]
        self._class_keys = [set(f) for f in filled]
        merged: dict[str, Any] = {}
        for f in reversed(filled):  # the first class's values win
            merged.update(f)
        super().__init__(params, merged)

    # -- building ----------------------------------------------------------------------------
    def ordered_params(self) -> list[tuple[int, torch.Tensor]]:
        """(outer group index, param) of every param, in the numbering of state dicts."""
        return [(g, p) for g, group in enumerate(self.param_groups) for p in group["params"]]

    def add_sub(
        self, optimizer_class: type, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]], kind: int = 0
    ) -> SubOptimizer:
        """A sub-optimizer over ``(outer group, param, stand-in)`` triples: one sub group per
        outer group that has members, in outer order, with the outer group's hyperparameters
        (``kind`` picks which class's keys, see ``classes``)."""
        by_group: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for g, param, stand_in in pairs:
            by_group.setdefault(g, []).append((param, stand_in))
        groups: list[dict[str, Any]] = []
        params: list[torch.Tensor] = []
        stand_ins: list[torch.Tensor] = []
        sub_groups: list[Any] = []
        for g in sorted(by_group):
            members = by_group[g]
            groups.append({**self._sub_hyper(g, kind), "params": [s for _, s in members]})
            sub_groups.append(g)
            params.extend(p for p, _ in members)
            stand_ins.extend(s for _, s in members)
        sub = SubOptimizer(optimizer_class(groups), sub_groups, params, stand_ins)
        self.subs.append(sub)
        return sub

    def _sub_hyper(self, g: int, kind: int) -> dict[str, Any]:
        """The outer group's hyperparameters a sub-optimizer of class ``kind`` should get:
        its own class's keys, and keys no class knows (user annotations)."""
        known = set().union(*self._class_keys)
        mine = self._class_keys[kind]
        group = self.param_groups[g]
        return {k: v for k, v in group.items() if k != "params" and (k in mine or k not in known)}

    # -- keeping the views consistent ------------------------------------------------------------
    def push_hyperparameters(self) -> None:
        """Copy every outer group's hyperparameters onto the sub groups that mirror it."""
        for sub in self.subs:
            for g, sub_group in zip(sub.groups, sub.optimizer.param_groups, strict=True):
                outer = self.param_groups[g]
                for key in sub_group:
                    if key != "params" and key in outer:
                        sub_group[key] = outer[key]

    def link_state(self) -> None:
        """Make ``state[param]`` the sub-optimizer's own dict for its stand-in (in place)."""
        for sub in self.subs:
            for param, stand_in in zip(sub.params, sub.stand_ins, strict=True):
                entry = sub.optimizer.state.get(stand_in)
                if entry is None:
                    self.state.pop(param, None)
                else:
                    self.state[param] = entry

    def masters(self) -> dict[torch.Tensor, torch.Tensor]:
        """{param: its higher-precision stand-in} for params whose stand-in holds more than
        the param does (fp32 masters of 16-bit params); saved with the state."""
        return {}

    def main_params(self) -> list[torch.Tensor]:
        """The stand-ins that are tensors of their own (host copies, fp32 masters), for
        ``memory_report``."""
        return [s for sub in self.subs for p, s in zip(sub.params, sub.stand_ins, strict=True) if s is not p]

    def reload_model_params(self) -> None:
        """Refresh the stand-ins from the params (after the params were changed by hand)."""

    # -- state dicts -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's format over the user's params, plus ``master_params`` (by param index)."""
        self.link_state()
        out = super().state_dict()
        index = {p: i for i, (_, p) in enumerate(self.ordered_params())}
        out["master_params"] = {index[p]: m for p, m in self.masters().items()}
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of the plain torch optimizer over the same
        param groups; each sub-optimizer casts its entries to its stand-ins' device and dtype."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or "state" not in state_dict:
            raise ValueError("not an optimizer state dict: expected 'state' and 'param_groups' entries")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        saved_index: dict[int, Any] = {}  # id(param) -> its index in the saved numbering
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {g} has {len(saved['params'])} params in the state dict, "
                    f"{len(group['params'])} in this optimizer"
                )
            group.update({k: v for k, v in saved.items() if k != "params"})
            saved_index.update({id(p): i for p, i in zip(group["params"], saved["params"], strict=True)})
        self.reload_model_params()
        self.push_hyperparameters()
        saved_state = state_dict["state"]
        for sub in self.subs:
            sub.optimizer.load_state_dict(_sub_state_dict(sub, saved_state, saved_index))
        saved_masters = state_dict.get("master_params") or {}
        for param, master in self.masters().items():
            value = saved_masters.get(saved_index[id(param)])
            if value is not None:
                master.copy_(value)
        self.state.clear()
        self.link_state()


def _sub_state_dict(sub: SubOptimizer, saved_state: dict, saved_index: dict[int, Any]) -> dict[str, Any]:
    """The entries of ``saved_state`` for ``sub``'s stand-ins, numbered as ``sub`` numbers them."""
    state, groups, n = {}, [], 0
    for group in sub.optimizer.param_groups:
        numbers = []
        for _ in group["params"]:
            entry = saved_state.get(saved_index[id(sub.params[n])])
            if entry is not None:
                state[n] = entry
            numbers.append(n)
            n += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    return {"state": state, "param_groups": groups}
