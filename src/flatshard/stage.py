"""What a ZeRO stage means, in one place: ``StagePolicy``.

[Note: stage policy]
A stage is four answers, and every part of flatshard asks the policy instead of comparing
the stage number (``tests/test_repo.py`` holds that to this module):

| stage | params | grads kept | optimizer state | grads reduced by | params return by      |
| ----- | ------ | ---------- | --------------- | ---------------- | --------------------- |
| 0     | full   | full       | full            | all-reduce       | (they never left)     |
| 1     | full   | full       | shard           | reduce-scatter   | all-gather per bucket |
| 2     | full   | shard      | shard           | reduce-scatter   | all-gather per bucket |
| 3     | shard  | shard      | shard           | reduce-scatter   | all-gather per unit   |

So stage 0 is stage 1 with an unsharded optimizer, stage 2 is stage 1 that keeps only its
grad shard, stage 3 is stage 2 whose param buffer is sharded too. Sharded stages pad their
buckets so that every rank's shard has the same size (``plan_layout(shard=True)``), need
``DistributedOptimizer`` (a torch optimizer over ``model.parameters()`` never sees the grad
shards) and may shard over a 2-D (replicate, shard) mesh. Only stage 3 gathers params by
unit, so only it takes the unit options (``UnitOptions``) and a model on the meta device;
an option that does not apply to the chosen stage is an error naming the option and the
stage, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STAGES = (0, 1, 2, 3)
BACKWARD_PREFETCH = ("pre", "post", None)
DEFAULT_UNIT_BYTES = 2**20
"""Adjacent small units merge up to this many bytes of params ([Note: merged units] in
``engine/units.py``); measured in ``benchmarks/README.md`` (Stage 3: merged units)."""


@dataclass(frozen=True)
class UnitOptions:
    """Stage 3's gather schedule ([Note: unsharding] in ``stage3/unshard.py``), validated once.

    reshard_after_forward: free a unit's params after its forward (False: keep them until
        its backward is done, trading memory for one gather per unit).
    forward_prefetch: units whose gathers start ahead of the forward (0: none).
    backward_prefetch: "pre" (start the next unit's gather when a unit's backward starts),
        "post" (when it ends) or None.
    limit_all_gathers: prefetches start only while fewer gathers are in flight.
    unit_bytes: adjacent small sibling units merge into one while their params fit in this
        many bytes (None: a unit per module).
    """

    reshard_after_forward: bool = True
    forward_prefetch: int = 1
    backward_prefetch: str | None = "pre"
    limit_all_gathers: int = 2
    unit_bytes: int | None = DEFAULT_UNIT_BYTES

    def __post_init__(self) -> None:
        if self.backward_prefetch not in BACKWARD_PREFETCH:
            raise ValueError(
                f"backward_prefetch must be one of {BACKWARD_PREFETCH}, got {self.backward_prefetch!r}"
            )
        if not _is_int(self.forward_prefetch) or self.forward_prefetch < 0:
            raise ValueError(f"forward_prefetch must be an int >= 0, got {self.forward_prefetch!r}")
        if not _is_int(self.limit_all_gathers) or self.limit_all_gathers < 1:
            raise ValueError(f"limit_all_gathers must be an int >= 1, got {self.limit_all_gathers!r}")
        if self.unit_bytes is not None and (not _is_int(self.unit_bytes) or self.unit_bytes < 1):
            raise ValueError(f"unit_bytes must be an int >= 1 or None, got {self.unit_bytes!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {self.reshard_after_forward!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_UNIT_DEFAULTS = UnitOptions()
# Options of shard() that only stage 3 reads, with the value that means "not given".
_STAGE3_ONLY: dict[str, Any] = {
    "units": None,
    "ignored_modules": None,
    "device": None,
    "param_init_fn": None,
    **{name: getattr(_UNIT_DEFAULTS, name) for name in UnitOptions.__dataclass_fields__},
}


@dataclass(frozen=True)
class StagePolicy:
    """What ``stage`` keeps sharded and which collectives it runs ([Note: stage policy])."""

    stage: int
    unit_options: UnitOptions = field(default_factory=UnitOptions)

    def __post_init__(self) -> None:
        if not _is_int(self.stage) or self.stage not in STAGES:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")

    @classmethod
    def build(cls, stage: int, **stage3_options: Any) -> StagePolicy:
        """The policy of ``stage`` with ``shard()``'s stage-3 options (``units``,
        ``device``, ``param_init_fn`` and the ``UnitOptions`` fields); raises ``ValueError``
        naming any option given a value at a stage that does not use it."""
        policy = cls(stage)
        unknown = set(stage3_options) - set(_STAGE3_ONLY)
        if unknown:
            raise TypeError(f"not stage-3 options: {sorted(unknown)}")
        if not policy.gathers_units:
            for name, value in stage3_options.items():
                if value != _STAGE3_ONLY[name]:
                    raise ValueError(
                        f"{name}={_short(value)} applies to stage 3 only (it says how units are gathered, "
                        f"materialized or which frozen params they shard); got stage {stage}: "
                        "drop it or use stage=3"
                    )
            return policy
        fields = {k: v for k, v in stage3_options.items() if k in UnitOptions.__dataclass_fields__}
        return cls(stage, UnitOptions(**fields))

    # -- what each rank keeps ----------------------------------------------------------------
    @property
    def shards_optimizer(self) -> bool:
        """Optimizer state and fp32 main params only for this rank's shard; the grads reach
        it by reduce-scatter, so the model needs ``DistributedOptimizer``."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Between backwards only this rank's grad shards are kept (not the full grad buffer)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Between uses only this rank's param shards are kept; units are gathered before use."""
        return self.stage == 3

    # -- how it is laid out and communicated ------------------------------------------------
    @property
    def pads_for_shards(self) -> bool:
        """Buckets are padded so that every rank's shard has the same size."""
        return self.shards_optimizer

    @property
    def reduction(self) -> str:
        """How grads are summed over the world: whole (``all_reduce``) or into shards."""
        return "reduce_scatter" if self.shards_optimizer else "all_reduce"

    @property
    def gathers_buckets_after_step(self) -> bool:
        """Each bucket's updated params are all-gathered after the step (stages 1-2)."""
        return self.shards_optimizer and not self.shards_params

    @property
    def gathers_units(self) -> bool:
        """Params are gathered unit by unit around their use (stage 3): the unit options,
        unit scratch and meta-device materialization apply."""
        return self.shards_params

    @property
    def allows_hybrid_mesh(self) -> bool:
        """A 2-D (replicate, shard) mesh is hybrid sharding: it needs something sharded."""
        return self.shards_optimizer

    def wire_bytes_per_element(self, param_bytes: int, grad_bytes: int, gathers: int = 2) -> int:
        """Bytes per element of a bucket that one step's collectives carry, before the ring
        factor (N-1)/N: an all-reduce of grads moves them twice; a reduce-scatter once plus
        each all-gather of params (``gathers`` a step at stage 3: [Note: comm bytes])."""
        if self.reduction == "all_reduce":
            return 2 * grad_bytes
        return grad_bytes + (gathers if self.gathers_units else 1) * param_bytes

    def __str__(self) -> str:
        return f"stage {self.stage}"


def _short(value: object) -> str:
    text = getattr(value, "__name__", None) if callable(value) else None
    text = " ".join((text or repr(value)).split())  # (one line: a module's repr spans many)
    return text if len(text) <= 60 else text[:57] + "..."
