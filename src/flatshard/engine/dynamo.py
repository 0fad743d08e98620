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

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

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
