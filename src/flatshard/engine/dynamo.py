"""flatshard under ``torch.compile``: hooks that stay outside graphs, and the compiled wrapper.

The reasoning is [Note: hooks and torch.compile] below."""

# [Note: hooks and torch.compile]
#
# ``block.compile()`` compiles ``nn.Module._call_impl``, so Dynamo meets flatshard's module
# hooks as it traces the block. They issue and wait on collectives, repoint ``param.data``
# and register autograd hooks, none of which can be captured in a graph. Every hook that
# flatshard registers on a module is therefore wrapped by ``eager``: Dynamo does not trace it
# and runs it as Python between graphs (FSDP2 does the same with its hooks). The block's
# forward between its pre- and post-hooks stays one graph; with per-block compile the breaks
# fall on the block's edges, where the hooks stand, and none inside it (counted by
# ``tests/stages/test_compile.py``).
#
# Hooks on tensors and params (``register_hook``, ``register_post_accumulate_grad_hook``)
# fire during backward, which Dynamo does not trace, so they need no wrapper.
#
# ``torch.compile(model)`` returns an ``OptimizedModule`` around the sharded module; every
# function of flatshard that takes a model accepts either (``uncompiled``).
#
# A tensor-parallel model ([Note: tensor-parallel params]) adds two rules, because a graph
# break is only safe for DTensor activations where torch's own tensor-parallel code expects
# one (torch 2.13; without flatshard, a whole-model compile of such a model is one graph):
#
# * **A module holding DTensor params of its own runs whole outside graphs when flatshard
#   hooks it** (``whole_outside_graphs``). Its tensor-parallel input and output functions are
#   hooks too, and a break between them and its forward cuts a DTensor in a pending state
#   out of the graph that made it: a vocab-parallel embedding's ``_MaskPartial`` output keeps
#   its mask in a buffer that its output function's reduction clears, so a graph ending
#   before that reduction fails to compile ("Mixing fake modes"). Its whole call (hooks and
#   forward) is therefore one eager piece: Dynamo breaks before and after it, in its parent.
# * **A pre-hook hands its module settled activations** (``eager_pre_hook``). An output
#   function redistributing with ``async_op=True`` returns an ``AsyncCollectiveTensor``; one
#   that enters a graph as its input gets a plain grad back from the graph's backward where
#   the redistribution's backward needs a DTensor (an ``AttributeError`` inside autograd).
#   So before the hook runs, each such argument becomes a plain tensor (``clone``, which
#   waits for it and keeps its autograd history); other arguments are passed as they are.

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from flatshard.engine.tensor_parallel import is_distributed

F = TypeVar("F", bound=Callable)


def eager(hook: F) -> F:
    """``hook``, run as plain Python even when called from a compiled module."""
    return torch.compiler.disable(hook, recursive=True)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(model)`` wrapped, or ``model`` itself."""
    if "_orig_mod" not in model._modules:  # (most models: no torch._dynamo import needed)
        return model
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def eager_pre_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs=True``) run as ``eager`` runs it, which first settles
    the module's arguments that are still in flight ([Note: hooks and torch.compile]) and
    then returns them to the module (None, as ``hook`` does, when there were none)."""

    def run(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        settled_args = tuple(_settled(a) for a in args)
        settled_kwargs = {k: _settled(v) for k, v in kwargs.items()}
        changed = any(a is not b for a, b in zip(args, settled_args, strict=True)) or any(
            settled_kwargs[k] is not v for k, v in kwargs.items()
        )
        hook(module, settled_args, settled_kwargs)
        return (settled_args, settled_kwargs) if changed else None

    return eager(run)


def whole_outside_graphs(module: nn.Module) -> None:
    """Make every call of ``module`` (its hooks and its forward) one eager piece under
    ``torch.compile``, when it holds DTensor params of its own ([Note: hooks and
    torch.compile]); other modules are left as they are. ``module.compile()`` afterwards
    replaces this."""
    owns_dtensors = any(is_distributed(p) for p in module.parameters(recurse=False))
    if owns_dtensors and module._compiled_call_impl is None:
        module._compiled_call_impl = eager(module._call_impl)


def _settled(value: Any) -> Any:
    """``value`` as a plain tensor if it is an ``AsyncCollectiveTensor``, else itself."""
    if type(value).__name__ != "AsyncCollectiveTensor":  # (no import for the common case)
        return value
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value
