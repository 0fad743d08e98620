"""The grads a ``DistributedOptimizer`` step uses: loss scaling, the global norm, clipping and
the check for inf and NaN ([Note: prepared grads] below)."""

# [Note: prepared grads]
#
# The grads of one backward are *prepared* once (``_prepare_grads``, keyed by the grad sync's
# generation): their global squared norm over every data-parallel world and tp, with one
# small all-reduce on which the optimizer's settings check rides; whether it is finite (all
# ranks see the same sum, so all agree on skipping a step); and ``_grad_factor``, the
# multiplier not yet applied to the grad shards (the inverse loss scale, a clip coefficient).
# Unscaling and clipping only change the factor and the recorded norm; the factor reaches the
# shards in one ``_foreach_mul_`` before the update, or when a reader (a GradScaler's
# unscale, a second clip) needs the grads as they are. A pipeline chunk's optimizer prepares
# the whole model's grads: the norm is summed over every chunk of this rank and over the
# pipeline's ranks ([Note: pipeline chunks]).

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch

from flatshard.engine.lifecycle import Grads
from flatshard.errors import NonFiniteGradError, ShardedGradError
from flatshard.optim.grad_norm import check_max_norm, global_norm_sq
from flatshard.optim.shards import describe_nonfinite
from flatshard.wrap.pipeline import Pipeline

if TYPE_CHECKING:
    from flatshard.optim.agreement import SettingsCheck
    from flatshard.optim.loss_scale import StaticLossScaler
    from flatshard.optim.shards import BufferShards
    from flatshard.wrap.module import ShardState


class GradPreparation:
    """The grad half of ``DistributedOptimizer``: what it does to the grads before its update
    (a base class; the optimizer sets the attributes below in its ``__init__``)."""

    _sharded: ShardState
    _buffer_shards: list[BufferShards]
    _settings: SettingsCheck
    inner: torch.optim.Optimizer
    loss_scaler: StaticLossScaler | None
    nonfinite: str
    skipped_steps: int

    def _init_grads(self) -> None:
        self._prepared_at: int | None = None  # grad_sync.generation when grads were prepared
        self._found_inf = False
        self._scaler_checked = False  # a ShardedGradScaler checked the grads since the last step
        self._grad_norm = torch.zeros(())  # of the grads as they are now (unscaled)
        self._grad_factor = 1.0  # multiplier not yet applied to the grad shards
        self._norm_checked_settings = False

    # -- loss scaling ------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale: call backward on this."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def unscale_grads_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """A ``ShardedGradScaler``'s check ([Note: grad scaler]): ``found_inf`` becomes 1 where
        any rank's grads hold inf or NaN, else the grads are multiplied by ``inv_scale``."""
        if self.loss_scaler is not None:
            raise ValueError(
                "a GradScaler drives a DistributedOptimizer that has its own loss_scale: the loss "
                "would be scaled twice; use one of them"
            )
        self._check_grads_synced()
        self._scaler_checked = True
        if self._sharded.grad_sync.grads is Grads.EMPTY:
            return
        self._prepare_grads()
        found_inf.fill_(float(self._found_inf))
        factor = float(inv_scale)
        if not self._found_inf and factor != 1.0:
            self._grad_factor *= factor
            self._grad_norm = self._grad_norm * factor
            self._apply_grad_factor()
            self._sharded.grad_sync.views.forget()  # (their cached norms were of scaled grads)

    def _scaled_step(self) -> bool:
        """Whether this step's loss was scaled: by ``loss_scale``, or by a GradScaler whose
        ``step`` called this one (it sets ``found_inf`` and ``grad_scale`` first)."""
        checked, self._scaler_checked = self._scaler_checked, False
        if not hasattr(self, "found_inf"):
            return self.loss_scaler is not None
        if not checked:
            raise ShardedGradError(
                f"torch.amp.GradScaler made its own inf check on the flat grads this rank holds (at "
                f"stage {self._sharded.stage}; at stages 1-3 only a shard of them), so ranks could "
                "disagree on skipping this step and on the next scale. Use flatshard.ShardedGradScaler "
                "(the same arguments), whose check is the optimizer's global norm, or "
                "DistributedOptimizer(loss_scale='dynamic'); nothing was stepped"
            )
        grad_scale = getattr(self, "grad_scale", None)  # None: unscale_ ran already
        pending = self._sharded.grad_sync.grads is not Grads.EMPTY and not self._found_inf
        if grad_scale is not None and pending:
            self._grad_factor /= float(grad_scale)
            self._grad_norm = self._grad_norm / float(grad_scale)
        return True

    # -- grads ---------------------------------------------------------------------------------
    def _grad_shards(self) -> list[torch.Tensor]:
        return [g for shards in self._buffer_shards for g in shards.grad_shards()]

    def _prepare_grads(self) -> None:
        """Global norm and overflow check of the grads of the latest backward (once)."""
        generation = self._sharded.grad_sync.generation
        if self._prepared_at == generation:
            return
        pipeline = self._sharded.pipeline
        if pipeline is None:
            self._prepared(self.model_norm_sq())
            return
        optimizers = _chunk_optimizers(pipeline)
        norm_sq = pipeline.norm_sq([o.model_norm_sq for o in optimizers])  # [Note: pipeline chunks]
        for optimizer in optimizers:
            optimizer._prepared(norm_sq)

    def _prepared(self, norm_sq: torch.Tensor) -> None:
        """Record the global squared norm of the grads as they are now."""
        finite = math.isfinite(norm_sq.item())
        self._found_inf = not finite
        self._grad_norm = (norm_sq.sqrt() / self.loss_scale).float()
        self._grad_factor = 1.0 / self.loss_scale if finite else 1.0
        self._prepared_at = self._sharded.grad_sync.generation

    def model_norm_sq(self) -> torch.Tensor:
        """The squared global norm of this model's grads (over its data-parallel worlds, and
        tp), checking the settings that ride on its all-reduce."""
        self._check_grads_synced()  # (a pipeline's other chunks' too)
        if self._sharded.grad_sync.grads is Grads.EMPTY:  # (stage 2 freed them: nothing to read)
            return torch.zeros((), dtype=torch.float64)
        norm_sq, riding = global_norm_sq(self._sharded, self._buffer_shards, self._settings, self.inner)
        if riding is not None:
            self._settings.after_riding(self.inner, *riding)
            # (with replicated sharding the norm spans one row: the rows still need the full check)
            self._norm_checked_settings = riding[1].size == self._settings.world.size
        return norm_sq

    def _apply_grad_factor(self) -> None:
        if self._grad_factor != 1.0:
            torch._foreach_mul_(self._grad_shards(), self._grad_factor)
            self._grad_factor = 1.0

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale grads so that their global 2-norm is at most ``max_norm``; return the norm
        before clipping (of the unscaled grads; inf or NaN when they overflowed, which
        ``error_if_nonfinite`` makes a ``RuntimeError``, as in torch's ``clip_grad_norm_``)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ supports norm_type=2.0, got {norm_type!r}")
        check_max_norm(max_norm)
        self._check_grads_synced()
        if self._sharded.grad_sync.grads is Grads.EMPTY:
            return torch.zeros(())  # no grads since zero_grad, as torch reports for no grads
        self._prepare_grads()
        norm = self._grad_norm
        if self._found_inf and error_if_nonfinite and self.loss_scaler is None:
            raise RuntimeError(
                f"the total norm of the grads is {norm.item()}: non-finite, so it cannot be clipped "
                f"({self._nonfinite_names()})"
            )
        if not self._found_inf or (self.nonfinite == "step" and self.loss_scaler is None):
            # (a step taken anyway clips as torch's clip_grad_norm_ does: by NaN for a NaN norm
            # (min keeps it), by 0 for an infinite one)
            coef = min(float(max_norm) / (norm.item() + 1e-6), 1.0)
            pipeline = self._sharded.pipeline  # (a pipeline chunk's clips the whole model's)
            for optimizer in [self] if pipeline is None else _chunk_optimizers(pipeline):
                optimizer._grad_factor *= coef
                optimizer._apply_grad_factor()
                optimizer._grad_norm = norm * coef  # a second clip sees the clipped grads, as in torch
        return norm.clone()

    def _check_grads_synced(self) -> list[str]:
        """Refuse grads that cannot be stepped; the params without a grad ([Note: params without
        a grad]), after a zero_grad that bypassed ours is taken as one."""
        without = self._sharded.grad_sync.without_grads()
        self._sharded.grad_sync.views.check_assigned()
        if self._sharded.grad_sync.grads is Grads.UNREDUCED:
            raise RuntimeError(
                "grads were accumulated under no_sync() and never reduced: run the last backward "
                "of the accumulation outside no_sync() before clipping or stepping"
            )
        return without

    def _refuse_nonfinite(self) -> None:
        """``nonfinite="raise"`` without loss scaling: a ``NonFiniteGradError`` naming the
        params, before anything is stepped (the norm's all-reduce tells every rank alike)."""
        if self.nonfinite != "raise":
            return
        self._prepare_grads()
        if self._found_inf:
            raise NonFiniteGradError(
                f"the grads hold inf or NaN and there is no loss scaler, so this is no fp16 overflow "
                f"({self._nonfinite_names()}); nothing was stepped. Find the NaN upstream (the data, "
                "the loss); DistributedOptimizer(nonfinite='skip') skips such steps with a warning"
            )

    def _nonfinite_names(self) -> str:
        return describe_nonfinite(self._buffer_shards)

    def _warn_skipped(self) -> None:
        """Without a loss scaler a non-finite grad is no fp16 overflow that the next scale
        fixes: it is a bug upstream, so every such skip says so, naming the params."""
        warnings.warn(
            f"DistributedOptimizer skipped step {self.skipped_steps} of this run: the grads hold "
            f"inf or NaN, and there is no loss scaler, so this is not an fp16 overflow "
            f"({self._nonfinite_names()}). nonfinite='step' steps anyway, 'raise' raises; "
            "clip_grad_norm_(error_if_nonfinite=True) raises",
            RuntimeWarning,
            stacklevel=4,
        )

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step`` was skipped because grads overflowed."""
        return self._found_inf


def _chunk_optimizers(pipeline: Pipeline) -> list[GradPreparation]:
    """The ``DistributedOptimizer`` of each of this rank's chunks of ``pipeline``."""
    found = [state.optimizer for _, state in sorted(pipeline.chunks.items())]
    for index, optimizer in zip(sorted(pipeline.chunks), found, strict=True):
        if not isinstance(optimizer, GradPreparation):
            raise ValueError(
                f"pipeline stage {index} on this rank has no DistributedOptimizer: the whole model's "
                "grad norm needs every chunk's; build one for each chunk before the step"
            )
        if optimizer.loss_scaler is not None:  # (each chunk's scaler would scale its grads its own way)
            raise ValueError(
                "loss scaling is not supported in a pipeline-parallel model (the last stage scales the "
                "loss for every chunk): train in bf16, which needs none"
            )
    return found  # type: ignore[return-value]
