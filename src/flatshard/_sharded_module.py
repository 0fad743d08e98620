"""The mixin every module returned by ``flatshard.shard`` gains (its class is swapped, as in
FSDP2, so the user's ``forward``, parameter names and state-dict keys stay as they were)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from flatshard._collectives import CommStats
from flatshard._grad_sync import BufferSet, GradSync
from flatshard._param_gather import ParamGather
from flatshard.layout import Layout


@dataclass
class ShardState:
    """Everything flatshard attaches to a wrapped module."""

    stage: int
    sets: dict[str, BufferSet]  # "main", and "expert" when an ExpertGroup is given
    grad_sync: GradSync
    stats: CommStats
    param_gather: ParamGather | None = None  # stages 1 and 2
    optimizer: object | None = None  # the DistributedOptimizer built over this module
    originals: dict[str, torch.Tensor] | None = None  # fp32 values before a MixedPrecision cast

    def take_originals(self) -> dict[str, torch.Tensor]:
        """The pre-cast fp32 values (once: they are dropped after)."""
        originals, self.originals = self.originals or {}, None
        return originals

    def wait_for_params(self) -> None:
        """Wait for every param all-gather still in flight after a step."""
        if self.param_gather is not None:
            self.param_gather.wait_all()


class ShardedModule(nn.Module):
    """Methods added to a module by ``flatshard.shard``."""

    _flatshard: ShardState

    @property
    def flatshard_state(self) -> ShardState:
        return self._flatshard

    @property
    def layouts(self) -> dict[str, Layout]:
        """The layout of each world's buffers ("main", and "expert" if any)."""
        return {key: bset.layout for key, bset in self._flatshard.sets.items()}

    @property
    def comm_stats(self) -> CommStats:
        """Collectives issued for this module and the bytes they moved (resettable)."""
        return self._flatshard.stats

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward passes reduce grads (False: accumulate locally)."""
        self._flatshard.grad_sync.sync_enabled = bool(requires_gradient_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads of the backward passes inside the block without communicating."""
        sync = self._flatshard.grad_sync
        previous = sync.sync_enabled
        sync.sync_enabled = False
        try:
            yield
        finally:
            sync.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Wait for grad reductions; only needed if a backward was interrupted by hand.

        Backward already waits for them in its end-of-backward callback.
        """
        self._flatshard.grad_sync.finish()

    def wait_for_params(self) -> None:
        """Wait for the param all-gathers a sharded step left running (stages 1 and 2).

        The forward waits for them bucket by bucket; call this before reading params
        outside a forward. ``state_dict`` and ``load_state_dict`` call it.
        """
        self._flatshard.wait_for_params()

    def state_dict(self, *args, **kwargs):
        self._flatshard.wait_for_params()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the flat buffers' views")
        self._flatshard.wait_for_params()
        return super().load_state_dict(state_dict, strict=strict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._flatshard.grad_sync.zero_grad(set_to_none=set_to_none)


_CLASS_CACHE: dict[type, type] = {}


def make_sharded(module: nn.Module, state: ShardState) -> ShardedModule:
    """Swap ``module``'s class for a subclass that mixes in ``ShardedModule``."""
    cls = module.__class__
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {"__module__": cls.__module__})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls
    module._flatshard = state
    return module  # type: ignore[return-value]
