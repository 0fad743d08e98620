"""One flat buffer as the ``DistributedOptimizer`` sees it: this rank's shards of its
buckets, the fp32 main params where its params are 16-bit, and the runs the inner optimizer
steps over them ([Note: distributed optimizer] in ``optim/distributed.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from flatshard.comm.collectives import DEVICE_TO_HOST, HOST_TO_DEVICE, CommStats
from flatshard.comm.world import World
from flatshard.engine.buffer import FlatBuffer
from flatshard.planner.layout import ShardRanges
from flatshard.planner.mixed_precision import HALF_DTYPES
from flatshard.planner.offload import Offload
from flatshard.planner.shard_map import Run, plan_runs


@dataclass
class BufferShards:
    """One flat buffer as the optimizer sees it: its shards, main params and runs."""

    buffer: FlatBuffer
    world: World
    main_data: torch.Tensor | None  # 1D shard frame the runs view; None: they view the params
    runs: list[Run]
    tensors: list[torch.Tensor]  # one per run: what the inner optimizer steps
    grads: list[torch.Tensor]  # one per run: its grad (its tensor's .grad if dtypes match, unless streamed)
    on_host: bool = False  # its optimizer's home is the host ([Note: memory tiers])
    host_grads: torch.Tensor | None = None  # stages 0-1 on the host: the grads' host frame
    _split_pieces: tuple[list[torch.Tensor], list[torch.Tensor]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def buckets(self):
        return self.buffer.layout.buckets

    @property
    def record_main(self) -> torch.Tensor | None:
        """The main params that are the values of record of 16-bit params ([Note: values of
        record] in ``wrap/record.py``): ``main_data``, unless it is an offloaded copy of params
        in their own dtype (fp32 params: they are their own record)."""
        main = self.main_data
        copy = main is not None and self.on_host and main.dtype == self.buffer.layout.dtype
        return None if copy else main

    def fetch_grads(self, stats: CommStats) -> None:
        """Copy the grad shards, as the step will use them, into the host frame the runs'
        grads view (queued: on an accelerator, wait for the stream before reading them)."""
        if self.host_grads is None:
            return
        for bucket in self.buckets:
            frame = self.buffer.frame_range(bucket)
            host = self.host_grads[frame.start : frame.end]
            if not self.buffer.has_grad_shard(bucket):
                host.zero_()  # (no grad reached it since zero_grad: a zero grad, as on the device)
                continue
            host.copy_(self.buffer.grad_shard(bucket), non_blocking=host.is_pinned())
            stats.record(DEVICE_TO_HOST, host.numel() * host.element_size(), 0)

    def grad_shards(self) -> list[torch.Tensor]:
        return [self.buffer.grad_shard(b) for b in self.buckets]

    def grad_pieces(self, split: frozenset[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's grad pieces of the params not named in ``split``, and of those named
        (views of the grad shards, which keep their storage objects: built once; ``split``
        is the model's one set of tp-split names, [Note: tensor-parallel params])."""
        if self._split_pieces is None:
            kinds: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            for bucket, grad in zip(self.buckets, self.grad_shards(), strict=True):
                for piece in bucket.local_ranges(self.buffer.rank):
                    kinds[piece.name in split].append(grad[slice(*piece.in_shard)])
            self._split_pieces = kinds
        return self._split_pieces

    def nonfinite_grads(self) -> list[str]:
        """Names of the params whose grad pieces on this rank hold inf or NaN (a slow loop:
        only to say why a step was skipped)."""
        names = []
        for bucket, grad in zip(self.buckets, self.grad_shards(), strict=True):
            for piece in bucket.local_ranges(self.buffer.rank):
                if not bool(torch.isfinite(grad[slice(*piece.in_shard)]).all()):
                    names.append(piece.name)
        return names

    def held_pieces(self, names: frozenset[str]) -> Iterator[tuple[torch.Tensor, dict[str, slice], bool]]:
        """For each run holding a piece of a param named in ``names``: its tensor, those
        pieces by name as slices of it (flat), and whether they are all of its params
        ([Note: params without a grad] in ``optim/held.py``)."""
        for run, tensor in zip(self.runs, self.tensors, strict=True):
            lo, hi = run.in_shard
            pieces = [
                p
                for p in self.buckets[run.bucket].local_ranges(self.buffer.rank)
                if p.in_shard.start < hi and p.in_shard.end > lo
            ]
            held = {
                p.name: slice(p.in_shard.start - lo, p.in_shard.end - lo) for p in pieces if p.name in names
            }
            if held:
                yield tensor, held, len(held) == len(pieces)

    def load_main_from_params(self) -> None:
        if self.main_data is not None and not self.buffer.shard_dropped:
            for bucket in self.buckets:
                frame = self.buffer.frame_range(bucket)
                self.main_data[frame.start : frame.end].copy_(self.buffer.param_shard(bucket))

    def main_pieces(self) -> Iterator[tuple[ShardRanges, torch.Tensor]]:
        """Each param piece of this rank's shards with its view of the main params."""
        if self.main_data is None:
            return
        for bucket in self.buckets:
            frame = self.buffer.frame_range(bucket)
            for piece in bucket.local_ranges(self.buffer.rank):
                lo, hi = piece.in_shard
                yield piece, self.main_data[frame.start + lo : frame.start + hi]

    def load_main_values(self, originals: Mapping[str, torch.Tensor]) -> None:
        """Main params from full-precision values by param name, piece by piece: the pre-cast
        fp32 values at construction (see ``MixedPrecision``), a state dict's at a load."""
        if self.main_data is None or not originals:
            return
        for piece, main in self.main_pieces():
            original = originals.get(piece.name)
            if original is not None:
                main.copy_(original.reshape(-1)[slice(*piece.in_param)])

    def store_main_to_params(self, stats: CommStats) -> None:
        """The stepped main params into the params (rounded to their dtype); from the host
        over its link when they live there ([Note: memory tiers])."""
        if self.main_data is not None and not self.buffer.shard_dropped:
            for bucket in self.buckets:
                frame = self.buffer.frame_range(bucket)
                main, shard = self.main_data[frame.start : frame.end], self.buffer.param_shard(bucket)
                shard.copy_(main, non_blocking=main.is_pinned())
                if self.on_host:
                    stats.record(HOST_TO_DEVICE, shard.numel() * shard.element_size(), 0)


def check_fp8_record(all_shards: Sequence[BufferShards], fp8_values: set[str]) -> None:
    """Params that hold their fp8 values between steps need main params to keep the exact
    ones ([Note: fp8 gathers after the step] in ``engine/fp8_gathers.py``): refused otherwise,
    naming one."""
    for shards in all_shards:
        names = [slot.name for slot in shards.buffer.layout.params if slot.name in fp8_values]
        if names and shards.record_main is None:
            raise ValueError(
                f"param {names[0]!r} is gathered in fp8 after each step "
                "(MixedPrecision(fp8_gathers=True)), so its exact values live only in fp32 main "
                f"params, and this optimizer keeps none for it (main params of "
                f"{shards.buffer.layout.dtype}); build it with fp32 main params "
                "(OptimizerPrecision(main_dtype=torch.float32)), or leave fp8_gathers unset"
            )


def describe_nonfinite(all_shards: Sequence[BufferShards], most: int = 8) -> str:
    """Which params have non-finite grads on this rank, in words (for an error)."""
    names = [name for shards in all_shards for name in shards.nonfinite_grads()]
    rank = all_shards[0].buffer.rank if all_shards else 0
    if not names:
        return f"rank {rank} holds no non-finite grad: another rank does"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"params with non-finite grads on rank {rank}: " + ", ".join(map(repr, names[:most])) + more


def run_dtype(param_dtype: torch.dtype, main_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the runs the inner optimizer steps: fp32 main params for 16-bit params
    kept with fp32 main params, else the params' own."""
    return torch.float32 if param_dtype in HALF_DTYPES and main_dtype == torch.float32 else param_dtype


def build_shards(
    buffer: FlatBuffer,
    world: World,
    group_of: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    main_dtype: torch.dtype = torch.float32,
    pieces: set[str] | frozenset[str] = frozenset(),
    host: Offload | None = None,
) -> BufferShards:
    """The runs of ``buffer``'s shards, over fp32 main params where its params are 16-bit
    and ``main_dtype`` is fp32, else over the param shard itself (``run_dtype``); with
    ``host`` (the offload that homes this buffer's optimizer on the host), over a host frame
    in every case, their grads over the grad shards moved to the host (stages 2-3) or a host
    frame the step copies them into (stages 0-1) ([Note: memory tiers] in
    ``planner/offload.py``)."""
    runs = plan_runs(buffer.layout, buffer.rank, group_of, shapes, pieces)
    dtype = run_dtype(buffer.layout.dtype, main_dtype)
    main_data = host_grads = None
    if host is not None:
        pin = host.pin_memory and buffer.device.type == "cuda"
        main_data = torch.zeros(buffer.frame_numel, dtype=dtype, pin_memory=pin)
        if buffer.full_grads:  # (a streamed step reads them on the device: [Note: streamed step])
            if host.step == "host":
                host_grads = torch.zeros(buffer.frame_numel, dtype=buffer.layout.grad_dtype, pin_memory=pin)
        elif buffer.has_grads:
            buffer.home_grads_on_host(pin)
    elif dtype != buffer.layout.dtype:
        main_data = torch.zeros(buffer.frame_numel, dtype=torch.float32, device=buffer.device)
    tensors, run_grads = [], []
    for run in runs:
        bucket = buffer.layout.buckets[run.bucket]
        lo, hi = run.in_shard
        frame = buffer.frame_range(bucket)
        if main_data is None:
            tensor = buffer.param_shard(bucket)[lo:hi]
        else:
            tensor = main_data[frame.start + lo : frame.start + hi]
        if host_grads is not None:
            grad = host_grads[frame.start + lo : frame.start + hi]
        else:
            grads = buffer.grad_shard(bucket) if buffer.full_grads else buffer.allocate_grad_shard(bucket)
            grad = grads[lo:hi]  # (a view: it outlives the shard's storage being freed)
        if run.shape is not None:  # a whole-param run: the param's own shape
            tensor, grad = tensor.view(run.shape), grad.view(run.shape)
        # (bf16 runs, the params themselves, have fp32 grads that torch refuses as their .grad:
        # they are read from ``grads``; a streamed run gets its .grad for its step: [Note:
        # streamed step] in optim/streamed_step.py)
        if grad.dtype == tensor.dtype and (host is None or host.step == "host"):
            tensor.grad = grad
        tensors.append(tensor)
        run_grads.append(grad)
    shards = BufferShards(buffer, world, main_data, runs, tensors, run_grads, host is not None, host_grads)
    shards.load_main_from_params()
    return shards
