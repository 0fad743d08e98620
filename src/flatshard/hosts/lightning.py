"""flatshard under Lightning's ``Trainer`` and ``Fabric``: ``strategy="flatshard"`` (once this
module is imported), ``Trainer(strategy=Strategy(stage=3, ...))`` or
``Fabric(strategy=FabricStrategy(stage=3, ...))``.

The reasoning is [Note: Lightning's strategy] below."""

# [Note: Lightning's strategy]
#
# Lightning runs the loop and asks its strategy for each distributed decision. ``Strategy``
# is Lightning's DDP strategy with the decisions that would break a sharded model taken
# over ([Note: hosted training] in ``hf.py`` says why each matters):
#
# * **The LightningModule is sharded in place** after the precision plugin's cast and the
#   move to the device: ``strategy.model`` *is* the LightningModule, with no DDP on top. Its
#   steps run through its own ``__call__`` (Lightning's forward redirection), so the hooks
#   of the whole module fire as under ``model(...)``, at stage 3 too.
# * **The optimizer ``configure_optimizers`` returns is rebuilt** as a ``DistributedOptimizer``
#   ([Note: rebuilt optimizers] in ``optimizers.py``); the LR schedulers are pointed at it. A
#   ``DistributedOptimizer`` returned there is kept. One optimizer per model (flatshard's rule).
# * **Accumulation**: the micro-batches before the last run under ``model.no_sync()``.
# * **Clipping** (``gradient_clip_val``, ``self.clip_gradients``): the precision plugin clips
#   the model's params, whose grads give the global norm ([Note: grads seen by torch]),
#   instead of the optimizer's params (this rank's shards: a local norm). fp16's scaler
#   becomes a ``ShardedGradScaler``.
# * **Checkpoints are directories written by every rank**: ``trainer.save_checkpoint`` and
#   ``ModelCheckpoint`` write a flatshard checkpoint (params, main params, optimizer state)
#   holding Lightning's own entries (loops, callbacks, schedulers, ...) as its ``extra``;
#   ``fit(ckpt_path=...)`` loads it after setup, at any world size and stage.
# * **Teardown leaves the model where it is** (Lightning's moves it to the CPU: a sharded
#   param cannot move).
#
# ``FabricStrategy`` takes the same decisions where Fabric asks for them: ``setup`` (shard,
# rebuild), ``no_backward_sync``, ``clip_gradients``, ``save`` and ``load``.

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from flatshard.checkpoint.directory import load_checkpoint, save_checkpoint
from flatshard.engine.dynamo import uncompiled
from flatshard.hosts.optimizers import point_at, rebuilt
from flatshard.hosts.scaler import use_sharded_scaler
from flatshard.optim.composite import unwrap_optimizer
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.wrap.module import ShardedModule
from flatshard.wrap.shard import shard as shard_model

try:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # (the lightning extra)
    raise ImportError("flatshard.hosts.lightning needs lightning: pip install 'flatshard[lightning]'") from e

STAGES = (0, 1, 2, 3)
DEFAULT_STAGE = 2
LIGHTNING = "lightning"
"""The ``extra`` entry of a flatshard checkpoint that holds Lightning's own entries."""


class Strategy(DDPStrategy):
    """Lightning's ``Trainer`` training a sharded LightningModule ([Note: Lightning's
    strategy]): ``stage`` and any other ``flatshard.shard`` keyword (``mixed_precision``,
    ``buckets``, ``stage3``, ...); ``process_group_backend`` and ``timeout`` as in
    ``DDPStrategy``. Registered as ``"flatshard"`` (stage 2) and ``"flatshard_stage_N"``."""

    strategy_name = "flatshard"

    def __init__(
        self,
        stage: int = DEFAULT_STAGE,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        _check_stage(stage)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.options = {"stage": stage, **options}

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        entries = {"flatshard": DEFAULT_STAGE, **{f"flatshard_stage_{s}": s for s in STAGES}}
        for name, stage in entries.items():
            if name not in registry:
                registry.register(name, cls, description=f"flatshard at ZeRO stage {stage}", stage=stage)

    # -- what Lightning asks of a strategy ---------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # (a checkpoint loads into the sharded model and its DistributedOptimizer)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # (loaded with the params, in load_checkpoint)

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self.precision_plugin = Precision()
        assert self._precision_plugin is not None
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _clipping_the_model(plugin, self)

    @property
    def _module(self) -> Any:
        """The LightningModule (the model itself: nothing is wrapped around it)."""
        assert self.lightning_module is not None, "the strategy has no LightningModule yet"
        return self.lightning_module

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        model = self.model
        if fitting and self._layer_sync and not _is_sharded(model):
            model = self._layer_sync.apply(model)
        model = self.precision_plugin.convert_module(model)
        self.model = model
        self.model_to_device()
        if not _is_sharded(model):  # (a later validate or test finds it sharded)
            self.model = shard_model(model, **self.options)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # (the LightningModule's configure_optimizers)
        if len(self.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers: a sharded model has one "
                "DistributedOptimizer (its param groups may use different classes: a group's "
                "'optimizer_class' entry)"
            )
        new: list[torch.optim.Optimizer] = [rebuilt(self._module, o) for o in self.optimizers]
        for old, one in zip(self.optimizers, new, strict=True):
            for config in self.lr_scheduler_configs:
                point_at(config.scheduler, old, one)
        self.optimizers = new

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with self._module.no_sync():
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_call("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_call("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_call("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_call("predict_step", *args, **kwargs)

    def _through_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the LightningModule, entered through its ``__call__`` (its hooks)."""
        return self._forward_redirection(self._module, self._module, method, *args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # (the flatshard checkpoint holds the params, each rank its own pieces)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # (likewise the optimizer's state)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("flatshard's strategy takes no storage_options: every rank writes its own pieces")
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # (rank 0's path on every rank)
        optimizer = self._optimizer() if "optimizer_states" in checkpoint else None  # (else weights only)
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_checkpoint(path, self._module, optimizer, extra={LIGHTNING: rest})

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(checkpoint_path)
        if os.path.isfile(path):
            raise ValueError(
                f"{path} is a file, not a checkpoint directory flatshard's strategy wrote: to start from "
                "its weights, load its state_dict into the LightningModule before fit and leave ckpt_path out"
            )
        fitting = self._module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self._optimizer() if fitting else None
        return load_checkpoint(path, self._module, optimizer)[LIGHTNING]

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # (loaded in load_checkpoint)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # (loaded in load_checkpoint)

    def _optimizer(self) -> DistributedOptimizer | None:
        return unwrap_optimizer(self.optimizers[0]) if self.optimizers else None

    def teardown(self) -> None:
        """Lightning's, but the model stays where it is (a sharded param cannot move)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


# -- pieces ---------------------------------------------------------------------------------------
class _ClipsTheModel:
    """A precision plugin whose clipping acts on the model's params, whose grads are global
    ([Note: grads seen by torch]), not on the optimizer's shards; with fp16's scaler it
    unscales before the hooks and the clip, as Lightning's AMP plugin does for torch's
    optimizers (it leaves the unscaling to the step of one that, like a
    ``DistributedOptimizer``, can unscale in its step: hooks would see scaled grads)."""

    _flatshard_strategy: Any
    _flatshard_unscaled: bool = False  # (since the last scaler update)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None or not _is_flat(optimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]
        result = closure()  # (the step's forward and backward)
        self._unscale_once(optimizer)
        # (then the hooks and the clip)
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]
        if model.automatic_optimization and result is None:  # (the step skipped its backward)
            return result
        out = scaler.step(optimizer, **kwargs)
        scaler.update()
        self._flatshard_unscaled = False
        return out

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm"
    ) -> None:
        if not _is_flat(optimizer):
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]
        if clip_val > 0:
            self._unscale_once(optimizer)
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[arg-type]

    def main_params(self, optimizer: torch.optim.Optimizer) -> Any:
        if not _is_flat(optimizer):
            return super().main_params(optimizer)  # type: ignore[misc]
        return [p for p in self._flatshard_strategy._module.parameters() if p.grad is not None]

    def _unscale_once(self, optimizer: Any) -> None:
        scaler = getattr(self, "scaler", None)
        if scaler is not None and not self._flatshard_unscaled:
            scaler.unscale_(optimizer)
            self._flatshard_unscaled = True


def _is_flat(optimizer: Any) -> bool:
    return isinstance(unwrap_optimizer(optimizer), DistributedOptimizer)


def _clipping_the_model(plugin: Precision, strategy: Strategy) -> Precision:
    if not isinstance(plugin, _ClipsTheModel):
        plugin.__class__ = type(f"Sharded{type(plugin).__name__}", (_ClipsTheModel, type(plugin)), {})
    plugin._flatshard_strategy = weakref.proxy(strategy)  # type: ignore[attr-defined]
    return _with_sharded_scaler(plugin)


def _unscale(plugin: Any, optimizer: Any) -> None:
    """fp16 under Fabric: the grads unscaled before a clip (the step then skips its own)."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        scaler.unscale_(optimizer)


def _with_sharded_scaler(plugin: Any) -> Any:
    """fp16 (``16-mixed``): the plugin's ``GradScaler`` becomes a ``ShardedGradScaler``: one inf
    check for every rank."""
    use_sharded_scaler(plugin, getattr(plugin, "device", "cuda"))  # (MixedPrecision's device)
    return plugin


def _is_sharded(model: object) -> bool:
    return isinstance(model, nn.Module) and isinstance(uncompiled(model), ShardedModule)


class FabricStrategy(FabricDDPStrategy):
    """Lightning's ``Fabric`` with a sharded model ([Note: Lightning's strategy], for Fabric):
    ``fabric.setup`` shards the model in place and rebuilds its optimizer ([Note: rebuilt
    optimizers]); ``no_backward_sync`` is ``model.no_sync()``; ``clip_gradients`` clips the
    model's params (global norms); ``fabric.save`` / ``fabric.load`` write and read a
    flatshard checkpoint, the state's other entries as its ``extra``. Arguments as
    ``Strategy``'s. Registered as ``"flatshard"`` (stage 2) and ``"flatshard_stage_N"``."""

    def __init__(
        self,
        stage: int = DEFAULT_STAGE,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: FabricPrecision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        _check_stage(stage)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.options = {"stage": stage, **options}
        self._backward_sync_control = _NoSync()
        self._sharded: nn.Module | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        Strategy.register_strategies.__func__(cls, strategy_registry)  # type: ignore[attr-defined]

    @property
    def precision(self) -> FabricPrecision:
        if self._precision is None:
            self.precision = FabricPrecision()
        assert self._precision is not None
        return self._precision

    @precision.setter
    def precision(self, precision: FabricPrecision | None) -> None:
        self._precision = None if precision is None else _with_sharded_scaler(precision)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list, scheduler: Any = None
    ) -> tuple:
        module = self.setup_module(module)
        new = [self.setup_optimizer(o) for o in optimizers]
        for old, one in zip(optimizers, new, strict=True):
            point_at(scheduler, old, one)
        return module, new, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        if not _is_sharded(module):
            module = shard_model(module, **self.options)
        self._sharded = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self._sharded is None:
            raise RuntimeError(
                "set the model up first: fabric.setup(model, optimizer), or setup_module(model)"
            )
        return rebuilt(self._sharded, optimizer)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Any,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        _unscale(self.precision, optimizer)
        return torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float | int) -> None:
        _unscale(self.precision, optimizer)
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_val)

    def save_checkpoint(
        self, path: Any, state: dict, storage_options: Any = None, filter: Any = None
    ) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(
                "flatshard's strategy takes no storage_options or filter: every rank writes its pieces"
            )
        module, optimizer, rest = _split(state)
        path = os.fspath(self.broadcast(os.fspath(path)))  # (rank 0's path on every rank)
        save_checkpoint(path, module, optimizer, extra=rest)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if isinstance(state, nn.Module):  # (fabric.load_raw(path, model))
            state = {"model": state}
        if not isinstance(state, dict):
            raise TypeError(
                "fabric.load of a flatshard checkpoint takes the state to load into (a dict holding the "
                f"sharded model), got {state!r}"
            )
        module, optimizer, rest = _split(state)
        loads = {k: v for k, v in rest.items() if hasattr(v, "load_state_dict")}
        saved = load_checkpoint(os.fspath(path), module, optimizer, extra=loads)
        missing = [k for k in rest if k not in loads and k not in saved]
        if missing and strict:
            raise KeyError(f"checkpoint {path} has no entries {missing} (it has {sorted(saved)})")
        for key in rest.keys() - loads.keys() - set(missing):
            state[key] = saved[key]
        return {k: v for k, v in saved.items() if k not in state}


class _NoSync(_BackwardSyncControl):
    """Fabric's ``no_backward_sync(model)``: the sharded model's ``no_sync()``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        return module.no_sync() if enabled else nullcontext()  # type: ignore[operator]


def _split(state: dict[str, Any]) -> tuple[nn.Module, DistributedOptimizer | None, dict[str, Any]]:
    """A Fabric state: its sharded model, its ``DistributedOptimizer`` and the rest."""
    modules = [k for k, v in state.items() if _is_sharded(v)]
    optimizers = [k for k, v in state.items() if isinstance(unwrap_optimizer(v), DistributedOptimizer)]
    if len(modules) != 1 or len(optimizers) > 1:
        raise ValueError(
            f"a flatshard checkpoint holds one sharded model and at most one DistributedOptimizer; the state "
            f"has models {modules} and optimizers {optimizers}"
        )
    optimizer = unwrap_optimizer(state[optimizers[0]]) if optimizers else None
    rest = {k: v for k, v in state.items() if k not in (*modules, *optimizers)}
    return state[modules[0]], optimizer, rest


def _check_stage(stage: int) -> None:
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


Strategy.register_strategies(StrategyRegistry)
FabricStrategy.register_strategies(STRATEGY_REGISTRY)
