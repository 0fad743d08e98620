"""flatshard under Hugging Face accelerate: after ``import flatshard.hosts.accelerate``,
accelerate's own ``accelerator.prepare(model, optimizer, ...)`` prepares a sharded model
([Note: hosted training] in ``hf.py``).

Importing this module teaches ``Accelerator.prepare_model`` (which ``prepare`` calls for each
model) one thing: a model ``flatshard.shard()`` returned is prepared for autocast only, with
no DDP on top (flatshard reduces its grads), and its accelerator is adopted: fp16's scaler
becomes a ``ShardedGradScaler``, and its ``save_state`` / ``load_state`` and
``get_state_dict`` / ``save_model`` work with the sharded model: ``save_state`` writes a
flatshard checkpoint of each sharded model and its ``DistributedOptimizer`` (``flatshard/``
in the state's folder; every rank writes its pieces) and leaves the rest (schedulers, data
samplers, the scaler, RNG states, registered objects, other models) to accelerate;
``load_state`` reads it back at any world size and stage; ``get_state_dict`` gathers the
full state dict (rank 0 gets it), so ``save_model`` writes what ``from_pretrained`` loads.
Every other model, and every accelerator without a sharded model, is accelerate's as before.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from flatshard.checkpoint.directory import load_checkpoint, save_checkpoint
from flatshard.engine.dynamo import uncompiled
from flatshard.hosts.scaler import use_sharded_scaler
from flatshard.optim.composite import unwrap_optimizer
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.wrap.module import ShardedModule

try:
    import accelerate
except ImportError as e:  # (the hf extra)
    raise ImportError("flatshard.hosts.accelerate needs accelerate: pip install 'flatshard[hf]'") from e

CHECKPOINT = "flatshard"
"""The flatshard checkpoint's folder in a state folder (``flatshard_1`` for a second model)."""


def prepare(accelerator: Any, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` that also checks a sharded model is among them and
    refuses a torch optimizer beside it (accelerate's own ``prepare`` does the rest: see the
    module's docstring). Then ``accelerator.backward``, ``accumulate(model)`` (through
    ``model.no_sync``) and ``clip_grad_norm_(model.parameters(), ...)`` (the global norm) work
    as they do under DDP. Returns what ``accelerator.prepare`` returns."""
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
    return accelerator.prepare(*objects)


def _install() -> None:
    """Wrap ``Accelerator.prepare_model`` once (see the module's docstring)."""
    original = accelerate.Accelerator.prepare_model
    if getattr(original, "flatshard", False):
        return

    @functools.wraps(original)
    def prepare_model(
        self: Any, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Any:
        if evaluation_mode or not isinstance(uncompiled(model), ShardedModule):
            return original(self, model, device_placement, evaluation_mode)
        _adopt(self)
        return original(self, model, device_placement=False, evaluation_mode=True)  # (no DDP)

    prepare_model.flatshard = True  # type: ignore[attr-defined]
    accelerate.Accelerator.prepare_model = prepare_model  # type: ignore[method-assign]


def _adopt(accelerator: Any) -> None:
    """The sharded scaler (before the optimizer is prepared, which keeps it), and the states."""
    use_sharded_scaler(accelerator)
    if not isinstance(accelerator, _ShardedStates):  # (its save_state, load_state, get_state_dict)
        accelerator.__class__ = type(
            f"Sharded{type(accelerator).__name__}", (_ShardedStates, type(accelerator)), {}
        )


class _ShardedStates:
    """An accelerator whose ``save_state``, ``load_state`` and ``get_state_dict`` take its
    sharded models (see the module's docstring)."""

    _models: list[Any]
    _optimizers: list[Any]

    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        def write(models: Any, weights: Any, folder: str) -> None:  # (every rank: collective)
            for i, (model, optimizer) in enumerate(sharded):
                save_checkpoint(os.path.join(folder, _folder(i)), model, optimizer)

        sharded = self._sharded_models()
        with self._without_sharded(), _hook(self.register_save_state_pre_hook, write):  # type: ignore[attr-defined]
            return super().save_state(output_dir, *args, **kwargs)  # type: ignore[misc]

    def load_state(self, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        def read(models: Any, folder: str) -> None:
            for i, (model, optimizer) in enumerate(sharded):
                load_checkpoint(os.path.join(folder, _folder(i)), model, optimizer)

        sharded = self._sharded_models()
        with self._without_sharded(), _hook(self.register_load_state_pre_hook, read):  # type: ignore[attr-defined]
            return super().load_state(input_dir, *args, **kwargs)  # type: ignore[misc]

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict of a sharded model (every rank calls it; rank 0 gets it)."""
        inner = uncompiled(self.unwrap_model(model))  # type: ignore[attr-defined]
        if isinstance(inner, ShardedModule):
            return inner.full_state_dict()
        return super().get_state_dict(model, unwrap)  # type: ignore[misc]

    def _sharded_models(self) -> list[tuple[Any, DistributedOptimizer | None]]:
        """Each sharded model with the prepared ``DistributedOptimizer`` built over it."""
        flat = [o for o in map(unwrap_optimizer, self._optimizers) if isinstance(o, DistributedOptimizer)]
        models: list[Any] = [uncompiled(self.unwrap_model(m)) for m in self._models if self._is_sharded(m)]  # type: ignore[attr-defined]
        return [(m, next((o for o in flat if o is m.flatshard_state.optimizer), None)) for m in models]

    def _is_sharded(self, model: Any) -> bool:
        return isinstance(uncompiled(self.unwrap_model(model)), ShardedModule)  # type: ignore[attr-defined]

    @contextmanager
    def _without_sharded(self) -> Iterator[None]:
        """Accelerate's own save or load, of everything but the sharded models and their
        ``DistributedOptimizer`` (it would save rank 0's shards as the whole state)."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not self._is_sharded(m)]
        self._optimizers = [
            o for o in optimizers if not isinstance(unwrap_optimizer(o), DistributedOptimizer)
        ]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers


@contextmanager
def _hook(register: Callable[[Any], Any], hook: Callable[..., None]) -> Iterator[None]:
    handle = register(hook)
    try:
        yield
    finally:
        handle.remove()


def _folder(index: int) -> str:
    return CHECKPOINT if index == 0 else f"{CHECKPOINT}_{index}"


_install()
