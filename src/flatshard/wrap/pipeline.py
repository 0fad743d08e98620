"""A pipeline-parallel model's chunks on this rank and its pipeline world: ``Pipeline``,
joined by ``flatshard.hosts.pipelining.PipelineStage``.

The reasoning is [Note: pipeline chunks] below."""

# [Note: pipeline chunks]
#
# Under ``torch.distributed.pipelining`` the model is cut into chunks (the pipeline's stages),
# each rank of the pipeline dimension runs one chunk (GPipe, 1F1B) or several (interleaved
# schedules), and a schedule runs each chunk's forward and backward once per micro-batch. Each
# chunk is a flatshard model of its own over the data-parallel group (``shard(chunk,
# group=mesh["dp"])``), with its own buffers and ``DistributedOptimizer``. Invariants:
#
# * **One reduction per chunk per step.** ``PipelineStage`` runs every backward of a chunk but
#   its last in a step under ``no_sync()`` (grads add up unreduced in its buffers) and the last
#   one synced, which reduces their sum: the bytes a step sends over dp are one backward's,
#   whatever the number of micro-batches. The schedule's ``scale_grads`` (1 / micro-batches,
#   for a mean loss) then scales the reduced grads through their ``ShardedGrad``.
# * **A norm is the whole model's.** Pipeline ranks hold disjoint params, so the optimizer's
#   global norm (what it clips by, what its overflow check reads) is the sum of every local
#   chunk's squares (each over dp, and tp) summed over the pipeline world: every chunk's
#   optimizer on every rank sees the same norm, so all clip by one factor and all skip (or
#   raise) together. One chunk's optimizer computes it for all the rank's chunks
#   (``norm_sq``) and hands it to each of their optimizers, so every local chunk needs its
#   ``DistributedOptimizer`` before the first step; and clipping with any of them clips every
#   local chunk (a second clip in the step, with another chunk's optimizer, finds the norm
#   within bounds and changes nothing), as torch's ``clip_grad_norm_`` over the whole
#   model's params would.
# * **Checks across the job compare what must be alike.** Hyperparameters are compared
#   job-wide; param-group members only among ranks that optimize the same params
#   (``optim/agreement.py``).
# * **Zero-bubble schedules** split a backward into an input pass and a weight pass that
#   assigns ``.grad`` by hand, past any reduction. ``PipelineStage`` runs the whole backward in
#   the input pass and nothing in the weight pass: the grads are right, the bubble the split
#   would save is not saved. The step's last backward is the one the schedule marks last, or
#   the chunk's n-th of n micro-batches (an input pass is never marked).
# * **Stage 3 gathers a chunk's params for each micro-batch**, forward and backward, as it
#   does for each forward and backward outside a pipeline. Keeping them gathered through a
#   step (FSDP2's ``reshard_after_backward=False`` between micro-batches) is not done: it would
#   hold every local chunk's full params for the whole step.
# * **Refused, by name:** a chunk flatshard did not wrap; loss scaling (the last stage scales
#   the loss of every chunk). Torch's own ``PipelineStage`` around a flatshard chunk trains
#   right under the non-split schedules, with a reduction per micro-batch, but its model is not
#   known to be a pipeline's chunk: the optimizer's norm is then the chunk's alone.

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flatshard.comm.collectives import all_reduce
from flatshard.comm.world import World

if TYPE_CHECKING:  # (wrap/module.py imports this module)
    from flatshard.wrap.module import ShardState


class Pipeline:
    """The chunks of one pipeline-parallel model that this rank runs (by stage index), and
    the pipeline world (the ranks holding the other chunks)."""

    def __init__(self, world: World, num_stages: int) -> None:
        self.world = world
        self.num_stages = num_stages
        self.chunks: dict[int, ShardState] = {}  # stage index -> the chunk's state

    def norm_sq(self, parts: list[Callable[[], torch.Tensor]]) -> torch.Tensor:
        """The whole model's squared grad norm: every local chunk's (``parts``, in stage
        order, each fp64 and 0-d) summed, then summed over the pipeline world (every rank of it
        calls this)."""
        total = torch.stack([part() for part in parts]).sum()
        all_reduce(total, self.world, stats=self.chunks[min(self.chunks)].stats).wait()
        return total


# pipeline process group -> this rank's newest Pipeline over it (alive while a chunk of it is)
_PIPELINES: weakref.WeakValueDictionary[object, Pipeline] = weakref.WeakValueDictionary()


def join_pipeline(state: ShardState, world: World, stage_index: int, num_stages: int) -> Pipeline:
    """Record the flatshard model of ``state`` as stage ``stage_index`` of ``num_stages`` of
    the pipeline over ``world`` on this rank; returns that pipeline. A stage index the newest
    pipeline over ``world`` already has starts a new one (the model was built again)."""
    if state.pipeline is not None:
        raise ValueError("this flatshard model is already a pipeline stage: one PipelineStage a chunk")
    pipeline = _PIPELINES.get(world.group)
    if pipeline is None or stage_index in pipeline.chunks or pipeline.num_stages != num_stages:
        pipeline = _PIPELINES[world.group] = Pipeline(world, num_stages)
    pipeline.chunks[stage_index] = state
    state.pipeline = pipeline
    return pipeline
