"""Changes to a module after ``shard()`` are noticed at its next forward ([Note: never
silent] in ``errors.py``).

``shard`` lays params out once: which are trainable (in flat buffers, reduced, stepped) and
which frozen, each bound by identity. A param replaced by a new ``nn.Parameter``, a
``requires_grad`` flipped, or a module or param added after wrapping would then be ignored:
the new param never trained or synchronised, a frozen one still stepped. So each forward
first compares the module tree with what was wrapped, by identity and a flag per param
(a loop of plain attribute reads, no tensor work), and raises ``RuntimeError`` naming the
param or module before anything runs.
"""

from __future__ import annotations

from torch import nn


class WrappedTree:
    """What ``shard`` wrapped: every module's own params (by identity, with
    ``requires_grad``) and its number of child modules."""

    def __init__(self, module: nn.Module) -> None:
        self.records = [
            (name or "(root)", m, dict(m._parameters), _trainable(m), len(m._modules))
            for name, m in module.named_modules(remove_duplicate=False)
        ]

    def check(self) -> None:
        for name, m, params, trainable, children in self.records:
            if len(m._modules) != children or len(m._parameters) != len(params):
                _raise(
                    f"module {name!r} has child modules {list(m._modules)} and params "
                    f"{list(m._parameters)}, {children} and {list(params)} when wrapped"
                )
            for attr, p in params.items():
                if m._parameters.get(attr) is not p:
                    _raise(f"param {_qualified(name, attr)!r} was replaced by another nn.Parameter")
            if _trainable(m) != trainable:
                changed = next(
                    a for a, p in params.items() if p is not None and p.requires_grad != trainable[a]
                )
                flag = params[changed].requires_grad
                _raise(
                    f"param {_qualified(name, changed)!r} has requires_grad={flag}, {not flag} when wrapped"
                )

    def hook(self, module: nn.Module, args: tuple) -> None:
        self.check()


def _trainable(m: nn.Module) -> dict[str, bool]:
    return {a: p is not None and p.requires_grad for a, p in m._parameters.items()}


def _qualified(module_name: str, attr: str) -> str:
    return attr if module_name == "(root)" else f"{module_name}.{attr}"


def _raise(what: str) -> None:
    raise RuntimeError(
        f"{what} after shard(): flatshard laid the params out when it wrapped the model, so the "
        "change would be ignored (a new param never trained or synchronised, a frozen one still "
        "stepped). Make such changes before shard(); to load values, copy them into the params "
        "(load_state_dict, flatshard.load_weights)"
    )
