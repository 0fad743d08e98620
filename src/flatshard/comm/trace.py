"""Named ranges in a ``torch.profiler`` trace, so that a user can see where flatshard's
communication sits against compute.

The reasoning is [Note: profiler ranges] below."""

# [Note: profiler ranges]
#
# torch's profiler shows gloo's and NCCL's collectives by their op alone (``gloo:all_reduce``),
# on the backend's own thread: nothing says which bucket or unit they move, or whether the
# training thread waited for them. flatshard adds a range, named ``flatshard::...``, around
#
# * issuing each collective: ``flatshard::reduce_scatter 65,536 B (all_to_all)`` (op, bytes,
#   the implementation chosen, [Note: collective choice] in ``comm/collectives.py``);
# * each wait for one: ``flatshard::wait reduce_scatter #12`` (the collective's number in the
#   step, as a ``DesyncError`` names it). A wait that takes long in the trace is exposed
#   communication; a short one is overlap that worked;
# * stage 3's unit gathers and waits (``flatshard::gather unit 3 (blocks.2)``,
#   ``flatshard::wait unit 3 (blocks.2)``) and the optimizer's step
#   (``flatshard::optimizer step``).
#
# When no profiler runs a range is one check of the profiler's state and a shared no-op
# context (about 0.6 µs in all, measured; a stage-3 step of the small GPT makes a few dozen);
# its name is formatted only when a profiler records.

from __future__ import annotations

from contextlib import nullcontext

import torch

_OFF = nullcontext()


def span(name: str, *args: object):
    """A ``flatshard::NAME`` range (``name.format(*args)``) while a profiler records, else a
    no-op: callers pass the raw values, so nothing is formatted on the hot path."""
    if not torch.autograd._profiler_enabled():
        return _OFF
    return torch.profiler.record_function("flatshard::" + name.format(*args))
