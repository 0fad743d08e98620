"""The named states of the engine's lifecycles, and every legal transition, in one place.

The reasoning is [Note: lifecycles] below."""

# [Note: lifecycles]
#
# Four things change state as a step runs; each is one enum member, never a
# cluster of flags, and moves only along the edges of ``TRANSITIONS`` (``advance`` raises
# ``IllegalTransition`` otherwise: a bug in flatshard, not a user error).
#
# * ``Backward``, of a module's grad sync: ``IDLE`` between backwards; ``RUNNING`` from the
#   first grad (or the hook on the outputs) until the end-of-backward callback; ``UNBOUNDED``
#   once this backward gave up waiting for a reduction during backward ([Note: two process
#   groups] in ``units/unshard.py``): later reductions are left to the callback.
# * ``Grads``, of a module's grads since ``zero_grad``: ``EMPTY`` (none), ``REDUCED`` (a synced
#   backward reduced them: the optimizer may step), ``UNREDUCED`` (a backward under
#   ``no_sync`` accumulated grads that no reduction has summed yet: stepping is an error).
# * ``ReductionState``, of one reduction within a backward: ``COLLECTING`` (grads arrive),
#   ``REDUCING`` (its all-reduce or reduce-scatter is in flight), ``REPLICATING`` (replicated
#   sharding: the shards' all-reduce across the replicate world is in flight), ``REDUCED``
#   (waited for and folded into the grads; a grad arriving now is an error) until the next
#   backward starts it over.
# * ``Gather``, of one stage-3 unit: ``SHARDED`` (its params are placeholders over shards),
#   ``GATHERING`` (its all-gathers are in flight), ``FULL`` (waited for; its params view the
#   full buckets). Resharding frees it from either of the last two.

from __future__ import annotations

from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


class IllegalTransition(RuntimeError):
    """A lifecycle was asked to move along an edge ``TRANSITIONS`` does not have."""


class Backward(Enum):
    IDLE = "idle"
    RUNNING = "running"
    UNBOUNDED = "running, no longer bounding grad scratch"


class Grads(Enum):
    EMPTY = "empty"
    REDUCED = "reduced"
    UNREDUCED = "accumulated under no_sync, not reduced"


class ReductionState(Enum):
    COLLECTING = "collecting grads"
    REDUCING = "reducing"
    REPLICATING = "reducing across replicas"
    REDUCED = "reduced"


class Gather(Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    FULL = "full"


TRANSITIONS: dict[Enum, frozenset[Enum]] = {
    Backward.IDLE: frozenset({Backward.RUNNING}),
    Backward.RUNNING: frozenset({Backward.UNBOUNDED, Backward.IDLE}),
    Backward.UNBOUNDED: frozenset({Backward.IDLE}),
    # zero_grad empties from anywhere; a synced backward reduces; a no_sync one leaves its sum unreduced
    Grads.EMPTY: frozenset({Grads.EMPTY, Grads.REDUCED, Grads.UNREDUCED}),
    Grads.REDUCED: frozenset({Grads.EMPTY, Grads.REDUCED, Grads.UNREDUCED}),
    Grads.UNREDUCED: frozenset({Grads.EMPTY, Grads.REDUCED, Grads.UNREDUCED}),
    # a backward without sync never launches; the next backward starts over from any state
    ReductionState.COLLECTING: frozenset({ReductionState.COLLECTING, ReductionState.REDUCING}),
    ReductionState.REDUCING: frozenset(
        {ReductionState.REPLICATING, ReductionState.REDUCED, ReductionState.COLLECTING}
    ),
    ReductionState.REPLICATING: frozenset({ReductionState.REDUCED, ReductionState.COLLECTING}),
    ReductionState.REDUCED: frozenset({ReductionState.COLLECTING}),
    Gather.SHARDED: frozenset({Gather.GATHERING}),
    Gather.GATHERING: frozenset({Gather.FULL, Gather.SHARDED}),
    Gather.FULL: frozenset({Gather.SHARDED}),
}


def advance(state: E, new: E, what: str) -> E:
    """``new``, if ``TRANSITIONS`` allows ``state`` -> ``new``; else ``IllegalTransition``
    naming ``what`` moved."""
    if new not in TRANSITIONS[state]:
        raise IllegalTransition(f"{what}: {state.name} -> {new.name} is not a legal transition")
    return new
