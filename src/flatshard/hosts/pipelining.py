"""flatshard under ``torch.distributed.pipelining``: ``PipelineStage`` in place of torch's,
around a chunk ``flatshard.shard`` wrapped over the data-parallel group ([Note: pipeline
chunks] in ``wrap/pipeline.py``).

    mesh = init_device_mesh("cuda", (pp, dp), mesh_dim_names=("pp", "dp"))
    chunk = flatshard.shard(chunk, stage=2, group=mesh["dp"])
    opt = flatshard.DistributedOptimizer(chunk, torch.optim.AdamW, lr=3e-4)
    stage = PipelineStage(chunk, stage_index, num_stages, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)  # or GPipe, interleaved
    ...
    schedule.step(x, target=y, losses=losses); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from flatshard.comm.world import resolve_world
from flatshard.engine.dynamo import uncompiled
from flatshard.wrap.module import ShardedModule
from flatshard.wrap.pipeline import join_pipeline


class PipelineStage(TorchPipelineStage):
    """Torch's ``PipelineStage`` (same arguments, those after ``device`` by keyword) for a
    chunk ``flatshard.shard`` wrapped: each step reduces the chunk's grads once, after its last
    micro-batch, and the chunk's ``DistributedOptimizer`` takes the whole model's grad norm
    across the pipeline (``group``) when it clips or checks for overflow. Under a zero-bubble
    schedule the input pass does the whole backward: right, but without the bubble it saves."""

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        **kwargs: Any,
    ) -> None:
        model = uncompiled(submodule)
        if not isinstance(model, ShardedModule):
            raise TypeError(
                f"flatshard's PipelineStage takes a chunk flatshard.shard() returned, got "
                f"{type(model).__name__}: shard it over the data-parallel group first, or use torch's "
                "PipelineStage for a chunk flatshard does not wrap"
            )
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.chunk: ShardedModule = model
        self._backwards = 0  # this step's backward passes so far
        world = resolve_world(kwargs.get("group"), model.flatshard_state.timeout)
        join_pipeline(model.flatshard_state, world, stage_index, num_stages)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        """A micro-batch's backward, unreduced under ``no_sync`` but for the step's last. A
        zero-bubble schedule's input pass runs the whole backward (its weight pass would assign
        ``.grad`` by hand, past the reduction) and its weight pass nothing."""
        if backward_type == "weight":
            return (), None
        if backward_type == "input" and bwd_kwargs["output_grads"] is None:  # (the loss, in a 1-tuple)
            bwd_kwargs = {**bwd_kwargs, "stage_output": bwd_kwargs["stage_output"][0]}
        self._backwards += 1
        last = last_backward or self._backwards == self.chunks  # (an input pass is never "last")
        if last:
            self._backwards = 0
        with contextlib.nullcontext() if last else self.chunk.no_sync():
            return super().backward_maybe_with_nosync("full", bwd_kwargs, last)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """Torch's backward metadata inference (first step): its ``autograd.grad`` through the
        chunk to its inputs reaches no param, and runs under ``no_sync`` so that it reduces
        nothing either."""
        with self.chunk.no_sync():
            return super()._prepare_backward_infra(*args, **kwargs)
