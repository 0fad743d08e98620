"""What a ZeRO stage means, in one place: ``StagePolicy``.

The reasoning is [Note: stage policy] below."""

# [Note: stage policy]
# A stage is four answers, and every part of flatshard asks the policy instead of comparing
# the stage number (``tests/repo/test_repo.py`` holds that to this module):
#
# | stage | params | grads kept | optimizer state | grads reduced by | params return by      |
# | ----- | ------ | ---------- | --------------- | ---------------- | --------------------- |
# | 0     | full   | full       | full            | all-reduce       | (they never left)     |
# | 1     | full   | full       | shard           | reduce-scatter   | all-gather per bucket |
# | 2     | full   | shard      | shard           | reduce-scatter   | all-gather per bucket |
# | 3     | shard  | shard      | shard           | reduce-scatter   | all-gather per unit   |
#
# So stage 0 is stage 1 with an unsharded optimizer, stage 2 is stage 1 that keeps only its
# grad shard, stage 3 is stage 2 whose param buffer is sharded too. Sharded stages pad their
# buckets so that every rank's shard has the same size (``plan_layout(shard=True)``), need
# ``DistributedOptimizer`` (a torch optimizer over ``model.parameters()`` never sees the grad
# shards) and may shard over a 2-D (replicate, shard) mesh. Only stage 3 gathers params by
# unit, so only it takes the stage-3 options (``Stage3``) and a model on the meta device;
# options given at a stage that does not read them are an error naming them and the stage,
# never silently ignored.

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STAGES = (0, 1, 2, 3)
BACKWARD_PREFETCH = ("pre", "post", None)
DEFAULT_UNIT_BYTES = 2**20
"""Adjacent small units merge up to this many bytes of params ([Note: merged units] in
``units/unit_tree.py``); measured in ``benchmarks/README.md`` (Stage 3: merged units)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


DEFAULT_BUCKET_SIZE = 2**22
"""Elements per bucket by default (16 MiB of fp32 grads)."""


@dataclass(frozen=True)
class Buckets:
    """``shard(..., buckets=flatshard.Buckets(...))``: how the flat buffers are cut into
    buckets and how the buckets are reduced, validated when it is built (a bad value is a
    ``ValueError`` naming it). The same at every stage.

    size: elements per bucket (a bucket closes once it holds at least this many); None for
        one bucket per buffer.
    per_launch: buckets, of any dtype, reduced together once all their grads are in (on
        gloo a buffer's buckets of up to 512 KiB by one all-to-all of the packed group;
        otherwise one collective a bucket, launched together); None puts all of them in
        one group.
    pad_for_high_busbw: pad sharded buckets to a multiple of 2**16 elements as well (for
        collectives whose bus bandwidth is highest at such sizes).
    align: elements (a multiple of 64): every param starts, and every rank's shard is cut, at
        a multiple of this, so that an optimizer keeping its state in blocks of this many
        elements (or a divisor: torchao's ``AdamW8bit`` and ``AdamWFp8`` 256, ``AdamW4bit``
        128) steps whole blocks on every rank ([Note: aligned shards] in layout.py). None:
        params at multiples of 64, shards cut anywhere.
    """

    size: int | None = DEFAULT_BUCKET_SIZE
    per_launch: int | None = 1
    pad_for_high_busbw: bool = False
    align: int | None = None

    def __post_init__(self) -> None:
        if self.size is not None and (not _is_int(self.size) or self.size < 1):
            raise ValueError(f"Buckets.size must be a positive number of elements or None, got {self.size!r}")
        if self.per_launch is not None and (not _is_int(self.per_launch) or self.per_launch < 1):
            raise ValueError(f"Buckets.per_launch must be a positive int or None, got {self.per_launch!r}")
        if not isinstance(self.pad_for_high_busbw, bool):
            raise TypeError(f"pad_for_high_busbw must be True or False, got {self.pad_for_high_busbw!r}")
        if self.align is not None and (not _is_int(self.align) or self.align < 1 or self.align % 64):
            raise ValueError(
                f"Buckets.align must be a positive multiple of 64 elements or None, got {self.align!r}"
            )


@dataclass(frozen=True)
class Stage3:
    """``shard(stage=3, stage3=flatshard.Stage3(...))``: how stage 3 picks, gathers,
    materializes and frees its units, validated when it is built (a bad value is a
    ``ValueError`` naming it). Giving it at stages 0-2, where nothing reads it, is an error.

    units: module classes, or a predicate ``(qualified_name, module) -> bool``, that pick the
        units gathered and freed together; default: the layers a Hugging Face model's
        ``_no_split_modules`` names, else the children of every ``nn.ModuleList``. The root
        is a unit too and owns every other param.
    reshard_after_forward: free a unit's params after its forward (False: keep them until
        its backward is done, trading memory for one gather per unit).
    forward_prefetch: units whose gathers start ahead of the forward (0: none).
    backward_prefetch: "pre" (start the next unit's gather when a unit's backward starts),
        "post" (when it ends) or None.
    limit_all_gathers: prefetches start only while fewer gathers are in flight.
    unit_bytes: adjacent small sibling units merge into one while their params fit in this
        many bytes (None: a unit per module).
    device: where a model built on the ``meta`` device is materialized (default: the current
        CUDA device if there is one, else the CPU), unit by unit.
    param_init_fn: initializes each module of a meta model (default: its own
        ``reset_parameters()``, a Hugging Face model's ``_init_weights``, zero LoRA B
        matrices: [Note: default init] in ``wrap/init.py``).
    ignored_modules: modules whose frozen params stay replicated on every rank; every other frozen
        floating param is sharded and gathered with its unit ([Note: frozen params] in
        ``units/build.py``).
    """

    units: Any = None
    reshard_after_forward: bool = True
    forward_prefetch: int = 1
    backward_prefetch: str | None = "pre"
    limit_all_gathers: int = 2
    unit_bytes: int | None = DEFAULT_UNIT_BYTES
    device: Any = None
    param_init_fn: Any = None
    ignored_modules: Any = None

    def __post_init__(self) -> None:
        self._check_schedule()
        if self.ignored_modules is not None:
            object.__setattr__(self, "ignored_modules", tuple(self.ignored_modules))
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ValueError(f"param_init_fn must be callable, got {self.param_init_fn!r}")

    def __repr__(self) -> str:
        fields = Stage3.__dataclass_fields__
        given = [
            f"{k}={_short(getattr(self, k))}" for k, f in fields.items() if getattr(self, k) != f.default
        ]
        return f"Stage3({', '.join(given)})"

    def _check_schedule(self) -> None:
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


SCHEDULE = (
    "reshard_after_forward",
    "forward_prefetch",
    "backward_prefetch",
    "limit_all_gathers",
    "unit_bytes",
)
"""The fields of ``Stage3`` that set the order and number of the collectives (the gather
schedule): every rank must agree on them."""


@dataclass(frozen=True)
class StagePolicy:
    """What ``stage`` keeps sharded and which collectives it runs ([Note: stage policy])."""

    stage: int
    stage3: Stage3 = field(default_factory=Stage3, hash=False)

    def __post_init__(self) -> None:
        if not _is_int(self.stage) or self.stage not in STAGES:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")

    @classmethod
    def build(cls, stage: int, stage3: Stage3 | None) -> StagePolicy:
        """The policy of ``stage`` with ``shard()``'s ``stage3`` options; raises
        ``ValueError`` when they are given at a stage that does not read them."""
        policy = cls(stage)
        if stage3 is not None and not isinstance(stage3, Stage3):
            raise TypeError(f"stage3 must be a flatshard.Stage3, got {_short(stage3)}")
        if not policy.gathers_units:
            if stage3 is not None:
                raise stage3_only("stage3", stage3, stage)
            return policy
        return cls(stage, stage3 or Stage3())

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
    def grad_collective(self) -> str:
        """How grads are summed over the world: whole (``all_reduce``) or into shards."""
        return "reduce_scatter" if self.shards_optimizer else "all_reduce"

    @property
    def gathers_params(self) -> bool:
        """Params are all-gathered at all: after the step (stages 1-2) or unit by unit (3)."""
        return self.shards_optimizer

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
    def allows_replicated_mesh(self) -> bool:
        """A 2-D (replicate, shard) mesh is replicated sharding: it needs something sharded."""
        return self.shards_optimizer

    def wire_bytes_per_element(self, param_bytes: int, grad_bytes: int, gathers: int = 2) -> int:
        """Bytes per element of a bucket that one step's collectives carry, before the ring
        factor (N-1)/N: an all-reduce of grads moves them twice; a reduce-scatter once plus
        each all-gather of params (``gathers`` a step at stage 3: [Note: comm bytes])."""
        if self.grad_collective == "all_reduce":
            return 2 * grad_bytes
        return grad_bytes + (gathers if self.gathers_units else 1) * param_bytes

    def __str__(self) -> str:
        return f"stage {self.stage}"


def stage3_only(name: str, value: object, stage: int) -> ValueError:
    """The error for a stage-3 option given at ``stage`` (0-2), which would do nothing there."""
    return ValueError(
        f"{name}={_short(value)} applies to stage 3 only (it says how units are gathered, "
        f"materialized or which frozen params they shard); got stage {stage}: drop it or use stage=3"
    )


def _short(value: object) -> str:
    text = getattr(value, "__name__", None) if callable(value) else None
    text = " ".join((text or repr(value)).split())  # (one line: a module's repr spans many)
    return text if len(text) <= 60 else text[:57] + "..."
