"""Flat buffers: one contiguous param tensor and one grad tensor per ``BufferLayout``.

The reasoning is in the notes below ([Note: buffers own storage], ...)."""

# [Note: buffers own storage]
# After ``FlatBuffer.bind``, each param's ``.data`` is a view into ``param_data`` and its
# ``.main_grad`` a view into ``grad_data`` (of the buffer's grad dtype: fp32 accumulation for
# 16-bit params). Nothing copies between a param and its bucket on the hot path; collectives
# and optimizer updates work on bucket-sized slices of these two tensors. Alignment gaps and
# end padding are zero at construction and nothing writes them as data.
#
# With ``full_grads=False`` (stages 2 and 3) there is no ``grad_data``: grads live in
# per-bucket-group scratch while a backward runs (see [Note: sharded grads]) and, between
# backwards, only as this rank's shard of each bucket, one tensor per bucket
# (``grad_shard(bucket)``). Their storage exists from the reduction that first writes them
# in a backward until ``zero_grad(set_to_none=True)`` frees it (resized to zero, so views of
# them, such as the optimizer's ``.grad``, stay valid), as FSDP2 drops its sharded grads: a
# forward after ``zero_grad`` runs without them. The concatenation of this rank's shards,
# bucket after bucket, is the buffer's *shard frame*: ``frame_range(bucket)`` is where a
# bucket's shard sits in it; the optimizer's fp32 main params (and, at stage 3, the param
# shards) use that frame.
#
# With ``sharded_params=True`` (stage 3) params are kept as shards too: ``param_shard_data``
# holds this rank's shard of every bucket in the same frame. The full buckets a unit is
# gathered into, and each param's ``.data`` pointing at its view of one or at its
# placeholder, belong to the stage-3 layer ([Note: full buckets] in ``units/full_buckets.py``).
#
# [Note: main-backed shards]
# At stage 3 a 16-bit buffer whose module has a ``DistributedOptimizer`` keeps no 16-bit
# shard: the optimizer's fp32 main params (the same frame) are the only copy of this rank's
# params, so the params cost 4 bytes per element of the shard instead of 2 + 4 (16Ψ/N in
# all with AdamW, as FSDP2 keeps). Invariants:
#
# * ``main_frame`` holds the values; the 16-bit params are ``main_frame.to(dtype)``, rounded
#   straight into this rank's part of a full bucket when it is gathered
#   (``gather_source``). That is the value a 16-bit shard refreshed after every step would
#   hold, so trajectories are unchanged.
# * A step writes ``main_frame`` and copies nothing.
# * Code that reads or writes the 16-bit shard (checkpoints, ``summon_full_params``, seeding
#   from weights) runs inside ``ShardState.param_dtype_shards()``: ``param_shard_data`` is
#   then ``main_frame.to(dtype)``, and on exit every element where it differs from
#   ``main_frame.to(dtype)`` (i.e. that was written) sets ``main_frame`` to its value; the
#   others keep their fp32 precision. Outside that block ``param_shard`` raises.
# * ``load_param`` writes the main params directly, at the precision it is given.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from flatshard.comm.world import ONE, World
from flatshard.engine.tensor_parallel import local, local_grad, local_shape, rebind
from flatshard.planner.layout import BucketLayout, BufferLayout, Layout, Range

FlatParam: TypeAlias = Any
"""An ``nn.Parameter`` bound to a flat buffer. flatshard sets ``main_grad`` on it (a view of
the buffer's grads), an attribute torch's stubs do not know, so it is typed as Any."""


class FlatBuffer:
    """The tensors behind one ``BufferLayout``, as seen from ``rank``."""

    def __init__(
        self,
        layout: BufferLayout,
        device: torch.device,
        *,
        rank: int = 0,
        full_grads: bool = True,
        sharded_params: bool = False,
        grads: bool = True,
    ) -> None:
        self.layout = layout
        self.has_grads = grads  # False: frozen params at stage 3 ([Note: frozen params])
        self.rank = rank
        self.device = torch.device(device)
        self.param_data: torch.Tensor | None = None  # 1D, whole buffer (stages 0-2)
        self.param_shard_data: torch.Tensor | None = None  # 1D, shard frame (stage 3)
        self.grad_data: torch.Tensor | None = None  # 1D, whole buffer (stages 0 and 1)
        self.grad_shards: list[torch.Tensor] = []  # stages 2-3: one per bucket (storage freed by zero_grad)
        starts, offset = [], 0
        for bucket in layout.buckets:
            starts.append(offset)
            offset += bucket.shard_range(rank).size
        self._frame_starts = starts
        self.frame_numel = offset
        self.main_frame: torch.Tensor | None = None  # stage 3, 16-bit: fp32 main params hold the shard
        self.main_on_host = False  # that frame is on the host ([Note: memory tiers])
        self.grads_on_host = False  # stages 2-3: the grad shards are on the host ([Note: memory tiers])
        self.params_on_host = False  # stage 3: the (frozen) param shards are on the host (the same)
        if sharded_params:
            self.param_shard_data = torch.zeros(offset, dtype=layout.dtype, device=device)
        else:
            self.param_data = torch.zeros(layout.numel, dtype=layout.dtype, device=device)
        if not grads:
            pass
        elif full_grads:
            self.grad_data = torch.zeros(layout.numel, dtype=layout.grad_dtype, device=device)
        else:
            self.grad_shards = [
                torch.zeros(b.shard_range(rank).size, dtype=layout.grad_dtype, device=device)
                for b in layout.buckets
            ]

    def bind(self, params: Sequence[FlatParam]) -> None:
        """Move each param's values into the buffer and rebind it as a view.

        ``params[slot.index]`` is the param of every slot (the order given to plan_layout).
        """
        with torch.no_grad():
            for slot in self.layout.params:
                param = params[slot.index]
                numel = local_shape(param).numel()  # ([Note: tensor-parallel params])
                if numel != slot.numel or param.dtype != self.layout.dtype:
                    raise ValueError(
                        f"param {slot.name!r} ({numel} elements, {param.dtype}) does not match "
                        f"its layout slot ({slot.numel} elements, {self.layout.dtype})"
                    )
                if self.param_shard_data is not None:
                    self._bind_sharded(slot, param)
                    continue
                assert self.param_data is not None  # (stages 0-2: the whole buffer)
                values = local(param)
                view = self.param_data[slot.start : slot.end].view(values.shape)
                view.copy_(values)
                rebind(param, view)
                if self.grad_data is None:
                    param.main_grad = None
                    continue
                grad_view = self.grad_data[slot.start : slot.end].view(values.shape)
                if param.grad is not None:
                    grad_view.copy_(local_grad(param, param.grad))
                param.main_grad = grad_view

    def _bind_sharded(self, slot, param: FlatParam) -> None:
        """Stage 3: keep this rank's pieces of ``param`` in the shard frame (a meta param keeps
        no values: it is initialized unit by unit). Its ``.data`` stays as it is until the
        stage-3 layer's ``FullBuckets`` points it at a placeholder."""
        if param.grad is not None:
            raise ValueError(
                f"param {slot.name!r} has a .grad; call zero_grad(set_to_none=True) before stage 3"
            )
        if not param.is_meta:
            self.load_param(slot, local(param))
        param.main_grad = None

    def load_param(self, slot, values: torch.Tensor) -> None:
        """Copy this rank's pieces of a full param's ``values`` into the shard frame (into
        the main params, at the precision of ``values``, when they hold the shard)."""
        bucket = self.layout.buckets[slot.bucket]
        frame = self.frame_range(bucket)
        flat = values.detach().reshape(-1)
        target = self.main_frame if self.shard_dropped else self.param_shard_data
        assert target is not None  # (a sharded buffer holds its shard, or its main params do)
        for piece in bucket.local_ranges(self.rank):
            if piece.name == slot.name:
                lo, hi = piece.in_shard
                target[frame.start + lo : frame.start + hi].copy_(flat[slice(*piece.in_param)])

    # -- stage 3: main-backed shards ([Note: main-backed shards]) -------------------------------
    def adopt_main(self, main: torch.Tensor, host: bool = False) -> None:
        """Let ``main`` (fp32, the shard frame, seeded from the shard) hold this rank's params
        from now on, and drop the 16-bit shard; ``host``: ``main`` lives on the host, so each
        gather copies this rank's part over the host link ([Note: memory tiers])."""
        if self.param_shard_data is None or main.shape != self.param_shard_data.shape:
            raise RuntimeError("adopt_main: only a stage-3 buffer's shard frame can be held by main params")
        self.main_frame = main
        self.main_on_host = host
        self.param_shard_data = None

    def home_params_on_host(self, pin: bool) -> None:
        """Stage 3, a buffer without main params (frozen params): its param shards live on
        the host from now on (page-locked with ``pin``), so each gather copies this rank's
        part over the host link ([Note: memory tiers] in ``planner/offload.py``)."""
        if self.param_shard_data is None or self.main_frame is not None:
            raise RuntimeError("home_params_on_host: only a stage-3 shard without main params moves")
        host = torch.empty(self.param_shard_data.shape, dtype=self.layout.dtype, pin_memory=pin)
        self.param_shard_data = host.copy_(self.param_shard_data)
        self.params_on_host = True

    @property
    def shard_on_host(self) -> bool:
        """Whether this rank's shard lives on the host (main params or params)."""
        return self.main_on_host or self.params_on_host

    @property
    def shard_dropped(self) -> bool:
        """Whether the main params hold the shard and no 16-bit copy exists now."""
        return self.main_frame is not None and self.param_shard_data is None

    def gather_source(self, bucket: BucketLayout) -> torch.Tensor:
        """What this rank's part of ``bucket`` is gathered from (copied into the full bucket,
        rounded to the param dtype)."""
        if self.main_frame is not None:
            frame = self.frame_range(bucket)
            return self.main_frame[frame.start : frame.end]
        return self.param_shard(bucket)

    def materialize_shard(self) -> None:
        """Give the buffer a 16-bit shard again: the main params rounded."""
        if self.shard_dropped and self.main_frame is not None:
            self.param_shard_data = self.main_frame.to(self.layout.dtype)

    def release_shard(self) -> bool:
        """Drop the 16-bit shard, first setting the main params wherever it was written
        (differs from the main params rounded); returns whether any element was."""
        if self.main_frame is None or self.param_shard_data is None:
            return False
        shard, self.param_shard_data = self.param_shard_data, None
        written = False
        for bucket in self.layout.buckets:
            frame = self.frame_range(bucket)
            mine, main = shard[frame.start : frame.end], self.main_frame[frame.start : frame.end]
            changed = mine != main.to(mine.dtype)
            if bool(changed.any()):
                main.copy_(torch.where(changed, mine.to(main.dtype), main))
                written = True
        return written

    def param_storage(self) -> torch.Tensor | None:
        """The tensor that holds this buffer's params between uses (None when the main
        params hold them, [Note: main-backed shards])."""
        return self.param_data if self.param_data is not None else self.param_shard_data

    @property
    def sharded_params(self) -> bool:
        """Params kept as this rank's shards, gathered into full buckets on use (stage 3)."""
        return self.param_shard_data is not None

    @property
    def main_backed(self) -> bool:
        """The optimizer's fp32 main params hold this 16-bit buffer's shard
        ([Note: main-backed shards])."""
        return self.main_frame is not None

    @property
    def full_grads(self) -> bool:
        return self.grad_data is not None

    def grad_range(self, first: BucketLayout, last: BucketLayout) -> torch.Tensor:
        """The grad buffer from ``first``'s start to ``last``'s end (consecutive buckets)."""
        if self.grad_data is None:
            raise RuntimeError("this buffer keeps only grad shards (stage 2): there is no full grad range")
        return self.grad_data[first.start : last.end]

    def param_range(self, first: BucketLayout, last: BucketLayout) -> torch.Tensor:
        if self.param_data is None:
            raise RuntimeError("this buffer keeps only param shards (stage 3): there is no full param range")
        return self.param_data[first.start : last.end]

    # -- this rank's shards ----------------------------------------------------------------
    def shard_range(self, bucket: BucketLayout) -> Range:
        """This rank's shard of ``bucket``, in buffer offsets."""
        return bucket.shard_range(self.rank)

    def frame_range(self, bucket: BucketLayout) -> Range:
        """Where ``bucket``'s shard sits in the shard frame."""
        start = self._frame_starts[bucket.index]
        return Range(start, start + bucket.shard_range(self.rank).size)

    def own_part(self, tensor: torch.Tensor, bucket: BucketLayout) -> torch.Tensor:
        """This rank's shard within ``tensor``, a bucket-sized tensor (e.g. a full bucket)."""
        own = self.shard_range(bucket).shift(bucket.start)
        return tensor[own.start : own.end]

    def param_shard(self, bucket: BucketLayout) -> torch.Tensor:
        """This rank's shard of ``bucket``'s params (a view of ``param_data``, or at stage 3
        of ``param_shard_data``)."""
        if self.param_data is None:
            if self.param_shard_data is None:  # (dropped: the main params hold it)
                raise RuntimeError(
                    "the main params hold this stage-3 shard: read or write it inside "
                    "ShardState.param_dtype_shards() ([Note: main-backed shards])"
                )
            frame = self.frame_range(bucket)
            return self.param_shard_data[frame.start : frame.end]
        shard = self.shard_range(bucket)
        return self.param_data[shard.start : shard.end]

    def grad_shard(self, bucket: BucketLayout) -> torch.Tensor:
        """This rank's reduced grads of ``bucket`` once a backward has synced (a view)."""
        if self.grad_data is not None:
            shard = self.shard_range(bucket)
            return self.grad_data[shard.start : shard.end]
        return self.grad_shards[bucket.index]

    def grad_storage(self) -> list[torch.Tensor]:
        """The tensors that hold this buffer's grads between backwards."""
        return [self.grad_data] if self.grad_data is not None else list(self.grad_shards)

    def allocate_grad_shard(self, bucket: BucketLayout) -> torch.Tensor:
        """``bucket``'s grad shard with its storage allocated (values undefined if it was
        freed: the caller overwrites them)."""
        return refill(self.grad_shards[bucket.index])

    def home_grads_on_host(self, pin: bool) -> None:
        """Stages 2-3: this rank's grad shards live on the host from now on (page-locked with
        ``pin``), their values kept: each reduction folds its shard into them over the host
        link, and the device keeps no grad of this buffer between backwards ([Note: memory
        tiers] in ``planner/offload.py``)."""
        if self.full_grads or not self.has_grads:
            raise RuntimeError("home_grads_on_host: only a buffer of grad shards (stages 2-3) has them")
        homed = []
        for shard in self.grad_shards:
            host = torch.zeros(shard.numel(), dtype=shard.dtype, pin_memory=pin)
            homed.append(host.copy_(shard) if allocated(shard) else release(host))
        self.grad_shards = homed
        self.grads_on_host = True

    def has_grad_shard(self, bucket: BucketLayout) -> bool:
        """Whether ``bucket``'s grads exist (not freed by ``zero_grad`` since)."""
        if self.grad_data is not None:
            return True
        return self.has_grads and allocated(self.grad_shards[bucket.index])

    def zero_grads(self) -> None:
        """Zero every grad this buffer holds (``zero_grad(set_to_none=False)``)."""
        for tensor in self.grad_storage():
            if allocated(tensor):
                tensor.zero_()

    def free_grad_shards(self) -> None:
        """Release every grad shard's storage (``zero_grad(set_to_none=True)``)."""
        for shard in self.grad_shards:
            release(shard)


def allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def refill(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with storage for its elements again (same storage object, so views of it
    stay valid; values undefined after ``_release``)."""
    if not allocated(tensor):
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
    return tensor


def release(tensor: torch.Tensor) -> torch.Tensor:
    """Free ``tensor``'s memory, keeping its storage object (and every view's) alive."""
    tensor.untyped_storage().resize_(0)
    return tensor


@dataclass
class BufferSet:
    """All flat buffers of one world (the main data-parallel group, or an expert group)."""

    world: World  # the shard world: buckets are reduce-scattered and params gathered over it
    layout: Layout
    buffers: list[FlatBuffer]
    params: list[FlatParam]  # in layout-spec order (slot.index)
    names: list[str]
    scale: float  # multiplier applied to grads before the sum over ``world`` (and ``replicate``)
    replicate: World = ONE  # replicated sharding: shards are all-reduced over this world too
