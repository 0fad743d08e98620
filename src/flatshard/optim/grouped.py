"""``GroupedOptimizer``: one torch optimizer whose param groups each have their own class.

The usual Muon recipe steps 2-D weights with Muon and everything else (embeddings, norms,
biases, the head) with AdamW, in one optimizer as far as the training loop is concerned.
``GroupedOptimizer(groups, classes, defaults)`` is that: a composite optimizer ([Note:
composite optimizers] in ``optim/composite.py``) with one sub-optimizer per class, whose
stand-ins are the params themselves (no copies). Each group shows exactly its own class's
hyperparameters: the constructor's ``defaults`` that the class takes, then the group's own
values, checked by the class on a probe. ``DistributedOptimizer`` builds one when its
param groups name more than one class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flatshard.optim.composite import CompositeOptimizer, class_defaults, run_closure


def accepted(optimizer_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``defaults`` that ``optimizer_class``'s constructor takes (all of them if
    it takes ``**kwargs``)."""
    parameters = inspect.signature(optimizer_class).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(defaults)
    names = {p.name for p in parameters}
    return {k: v for k, v in defaults.items() if k in names}


def check_grouped(
    groups: Sequence[dict[str, Any]], classes: Sequence[type], defaults: dict[str, Any]
) -> None:
    """Refuse, before anything is built, a default no class takes and a value a group's class
    refuses (a ``TypeError`` or ``ValueError`` naming the class)."""
    unknown = set(defaults) - {k for cls in set(classes) for k in accepted(cls, defaults)}
    if unknown:
        names = sorted({cls.__name__ for cls in classes})
        raise TypeError(
            f"no optimizer class of the param groups ({', '.join(names)}) takes {sorted(unknown)}"
        )
    for cls in dict.fromkeys(classes):
        mine = [g for g, c in zip(groups, classes, strict=True) if c is cls]
        class_defaults(cls, accepted(cls, defaults), mine)


class GroupedOptimizer(CompositeOptimizer):
    """Param group ``i`` stepped by ``classes[i]``; ``defaults`` go to every class that takes
    them. ``param_groups`` and ``state`` are the usual torch objects over ``groups``' params."""

    def __init__(
        self, groups: Sequence[dict[str, Any]], classes: Sequence[type], defaults: dict[str, Any]
    ) -> None:
        groups = list(groups)
        if len(groups) != len(classes):
            raise ValueError(f"{len(groups)} param groups but {len(classes)} optimizer classes")
        check_grouped([{k: v for k, v in g.items() if k != "params"} for g in groups], classes, defaults)
        unique = list(dict.fromkeys(classes))
        filled = [
            {**class_defaults(cls, accepted(cls, defaults)), **group}
            for group, cls in zip(groups, classes, strict=True)
        ]
        super().__init__(filled, unique, {})
        known = set().union(*self._class_keys)
        for group, cls in zip(self.param_groups, classes, strict=True):
            mine = self._class_keys[unique.index(cls)]
            for key in [k for k in group if k in known and k not in mine]:
                del group[key]  # another class's default, filled in by torch
        self.group_classes = tuple(classes)
        for kind, cls in enumerate(unique):
            pairs = [(g, p, p) for g, p in self.ordered_params() if classes[g] is cls]
            if pairs:
                self.add_sub(cls, pairs, kind)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = run_closure(closure)
        self.push_hyperparameters()
        for sub in self.subs:
            sub.step()
        self.link_state()
        return loss

    def __repr__(self) -> str:
        classes = ", ".join(cls.__name__ for cls in self.group_classes)
        return f"GroupedOptimizer({len(self.param_groups)} groups: {classes})"
