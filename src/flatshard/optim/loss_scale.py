"""Loss scaling for fp16 training: keep small grads from underflowing in 16 bits.

Scale the loss by ``scale`` before backward (``DistributedOptimizer.scale_loss``); the
optimizer divides the fp32 main grads by it, and skips a step whose grads overflowed on any
rank. A dynamic scaler then halves the scale, and doubles it again after
``growth_interval`` overflow-free steps in a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StaticLossScaler:
    """A constant loss scale."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"loss scale must be positive, got {self.scale!r}")

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome (a static scale ignores it)."""

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicLossScaler(StaticLossScaler):
    """Back off by ``backoff_factor`` after an overflow (not below ``min_scale``); grow by
    ``growth_factor`` after ``growth_interval`` steps without one."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"growth_interval must be a positive int, got {self.growth_interval!r}")

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))


def make_loss_scaler(loss_scale: float | str | StaticLossScaler | None) -> StaticLossScaler | None:
    """``None`` (no scaling), a number (static), ``"dynamic"``, or a scaler object."""
    if loss_scale is None or isinstance(loss_scale, StaticLossScaler):
        return loss_scale
    if loss_scale == "dynamic":
        return DynamicLossScaler()
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return StaticLossScaler(float(loss_scale))
    raise ValueError(f"loss_scale must be None, a positive number, 'dynamic' or a scaler, got {loss_scale!r}")
