"""The offloaded optimizer stepped on the device, its tensors streamed there and back a chunk
at a time: [Note: streamed step].

The reasoning is [Note: streamed step] below."""

# [Note: streamed step]
#
# ``Offload(step="device")`` keeps every tensor of the offloaded optimizer at home on the host,
# as ``Offload()`` does ([Note: memory tiers] in ``planner/offload.py``: main params, state,
# and at stages 2-3 the grad shards), and runs its update on the device. The runs of the
# host-homed buffers are cut, in the inner optimizer's order, into chunks of whole runs of at
# most ``Offload.stream_chunk`` elements (a longer run is a chunk of its own: ``stream_chunks``
# in ``planner/offload.py``, which the plan counts with too), and each chunk is
#
# 1. uploaded: its runs' main params, their grads where those live on the host (stages 2-3;
#    at stages 0-1 the grads are the device's own) and every tensor of their state, copied
#    to the device;
# 2. stepped there by the one inner optimizer: for the call each run tensor's and grad's
#    ``.data`` is its device copy and its state entries are the device copies; only the
#    chunk's runs step (the other runs' ``.grad`` is None for the call, the way torch skips
#    a param without a grad; the precision-aware optimizer is told which runs);
# 3. downloaded: main params and state copied back into their host tensors (state made by a
#    first step is made on the device and copied into new host tensors), the run tensors
#    pointed back at the host.
#
# Runs whose buffer lives on the device (units kept resident, [Note: unit homes]) step first,
# in one call. Every run steps once a step, from the same values, with the kernel the device
# has (``resolve_offload`` asks for torch's fused kernel where the device has one): on a
# CPU-only machine, where host and device are one memory and every copy is still made, a
# run equals ``Offload()``'s bit for bit; on an accelerator the device's fused kernels differ
# from the host's only in the order of fp32 arithmetic.
#
# On CUDA the copies run on two side streams: chunk i+1 is uploaded while chunk i steps on
# the current stream, and chunk i is downloaded behind its step; before allocating chunk i+1
# the host waits for chunk i-1's download, so at most two chunks are on the device at once
# (``staging``, as the plan counts it, and a device budget at the step's peak). Their copies
# are pieces of one arena (``_Arena``) made on the current stream before the side streams
# wait for it: memory a copy allocates on a side stream stays cached for that stream, out of
# reach of the next forward, whereas the arena's goes back to the current stream's when the
# step ends, which is what a budget taking the larger of the step's peak and the units' in
# flight assumes.
# ``step`` returns after every download is done: the host values are the values of record,
# which the params' copies (stages 0-2) and the next gathers (stage 3) read. Host tensors
# are page-locked where ``Offload.pin_memory`` (so these copies are asynchronous); state a
# first step makes is pinned as it comes home.
#
# Why stream: per element a streamed step moves 16 bytes up and 12 down over the host link
# that a host step does not (fp32 main params, grads and Adam's two moments; 8 and 6 with
# the 4-byte state), in exchange for the device's memory bandwidth. That wins where the
# host's cores are few for its link (a fast coherent link, a host shared by many devices);
# a many-core host over PCIe steps faster at home. Both are one option apart.

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flatshard.comm.collectives import DEVICE_TO_HOST, HOST_TO_DEVICE, CommStats
from flatshard.optim.hybrid import SideStreams
from flatshard.optim.precision import PrecisionAwareOptimizer
from flatshard.optim.shards import BufferShards
from flatshard.planner.offload import staging_bytes, stream_chunks


@dataclass
class _Run:
    """One run of a host-homed buffer: its inner tensor and grad, and whether the grad lives
    on the host (and so is uploaded)."""

    tensor: torch.Tensor
    grad: torch.Tensor
    grad_on_host: bool


@dataclass
class _Staged:
    """A chunk on the device: per run, its host tensors (to point back at) and the device
    copies standing in for them; the events of its copies (CUDA only)."""

    runs: list[_Run]
    homes: list[tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]] = field(default_factory=list)
    made: list[torch.Tensor] = field(default_factory=list)  # device state the download reads
    uploaded: Any = None
    downloaded: Any = None


class StreamedStep:
    """Steps the runs of ``shards`` homed on the host on their device, a chunk at a time, and
    the other runs in one call ([Note: streamed step])."""

    def __init__(self, shards: Sequence[BufferShards], stats: CommStats, chunk: int) -> None:
        self.stats = stats
        self._all = [t for s in shards for t in s.tensors]
        self._resident = {id(t) for s in shards if not s.on_host for t in s.tensors}
        runs = [
            _Run(tensor, grad, s.buffer.grads_on_host)
            for s in shards
            if s.on_host
            for tensor, grad in zip(s.tensors, s.grads, strict=True)
        ]
        cut = stream_chunks([r.tensor.numel() for r in runs], chunk)
        self.chunks = [[runs[i] for i in c] for c in cut]
        self.chunk_bytes: list[int] = []  # each chunk's bytes on the device in the last step
        devices = {s.buffer.device for s in shards if s.on_host}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self._streams = SideStreams(self.device) if self.device.type == "cuda" else None
        self._pin = any(s.main_data is not None and s.main_data.is_pinned() for s in shards)

    @torch.no_grad()
    def step(self, inner: torch.optim.Optimizer) -> None:
        """One update of every run: the resident ones, then the streamed chunks."""
        first = True
        if self._resident:
            _step_only(inner, self._resident, self._all, first)
            first = False
        self.chunk_bytes = []
        if not self.chunks:
            return
        streams = self._streams
        current = streams.compute() if streams is not None else None
        arena = _Arena(self.device, [self._upload_sizes(inner, c) for c in self.chunks])
        if streams is not None:  # (grads and main params written, the arena made: on the current stream)
            streams.h2d.wait_stream(streams.compute())
        behind: _Staged | None = None  # the chunk before: downloading
        ahead = self._upload(inner, self.chunks[0], arena.chunk(0))
        for index, following in enumerate([*self.chunks[1:], None], start=1):
            staged = ahead
            if current is not None:
                current.wait_event(staged.uploaded)
            self._step_staged(inner, staged, first)
            first = False
            self._download(inner, staged)
            _wait(behind)  # (its device copies released before the next chunk's are made)
            behind = staged
            if following is not None:
                ahead = self._upload(inner, following, arena.chunk(index))
        _wait(behind)  # (then the arena goes back to the current stream's memory)

    def _upload_sizes(self, inner: torch.optim.Optimizer, runs: list[_Run]) -> list[int]:
        """The bytes of each tensor ``_upload`` carves from the arena for ``runs``, in its order."""
        sizes = []
        for run in runs:
            state = inner.state.get(run.tensor) or {}
            sizes += [_nbytes(run.grad)] if run.grad_on_host else []
            sizes += [_nbytes(v) for v in state.values() if type(v) is torch.Tensor]
            sizes.append(_nbytes(run.tensor))
        return sizes

    def _upload(
        self, inner: torch.optim.Optimizer, runs: list[_Run], place: Iterator[torch.Tensor]
    ) -> _Staged:
        staged = _Staged(runs)
        h2d = self._streams.h2d if self._streams is not None else None
        with _on(h2d):
            for run in runs:
                state = inner.state.get(run.tensor) or {}
                tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
                grad = self._send(run.grad, place) if run.grad_on_host else None
                copies = {k: self._send(v, place) for k, v in tensors.items()}
                staged.homes.append((run.tensor.data, run.grad.data if grad is not None else None, tensors))
                staged.copies.append((self._send(run.tensor, place), grad, copies))
            staged.uploaded = _record(h2d)
        return staged

    def _step_staged(self, inner: torch.optim.Optimizer, staged: _Staged, first: bool) -> None:
        """Point the chunk's runs at their device copies, step them, point them back. A run's
        ``.grad`` is set for the call only where its dtype is the run's (a bf16 run's fp32
        grad is the precision-aware optimizer's to read), and only while both are on the
        device: at stages 0-1 a run's grad is the device's, its tensor the host's."""
        for run, (tensor, grad, state) in zip(staged.runs, staged.copies, strict=True):
            run.tensor.data = tensor
            if grad is not None:
                run.grad.data = grad
            if run.grad.dtype == tensor.dtype:
                run.tensor.grad = run.grad
            if state:
                inner.state[run.tensor].update(state)
        try:
            _step_only(inner, {id(r.tensor) for r in staged.runs}, self._all, first)
        finally:
            for run, (tensor, grad, _) in zip(staged.runs, staged.homes, strict=True):
                run.tensor.grad = None
                run.tensor.data = tensor
                if grad is not None:
                    run.grad.data = grad

    def _download(self, inner: torch.optim.Optimizer, staged: _Staged) -> None:
        """Copy the chunk's stepped main params and state home (behind its step)."""
        stream = self._streams.d2h if self._streams is not None else None
        if self._streams is not None:
            self._streams.d2h.wait_stream(self._streams.compute())
        with _on(stream):
            held = 0
            for run, (home, _, homes), (copy, grad, _) in zip(
                staged.runs, staged.homes, staged.copies, strict=True
            ):
                self._receive(home, copy)
                held += _nbytes(copy) + (_nbytes(grad) if grad is not None else 0)
                state = inner.state.get(run.tensor) or {}
                for key, value in list(state.items()):
                    if torch.is_tensor(value):
                        state[key] = self._receive(homes.get(key), value, state=True)
                        staged.made.append(value)  # (made by the step: kept until its copy is done)
                        held += _nbytes(value)
            staged.downloaded = _record(stream)
        self.chunk_bytes.append(held)

    @property
    def staging(self) -> int:
        """The most bytes the last step held on the device at once: the plan's ``staging``
        ([Note: streamed step])."""
        return staging_bytes(self.chunk_bytes)

    def _send(self, tensor: torch.Tensor, place: Iterator[torch.Tensor]) -> torch.Tensor:
        """``tensor``'s device copy: into the arena's next piece (a plain tensor), or made by
        ``to`` (a tensor subclass, such as torchao's low-bit state, copies itself)."""
        self.stats.record(HOST_TO_DEVICE, _nbytes(tensor), 0)
        tensor = tensor.detach()
        if type(tensor) is not torch.Tensor:
            return tensor.to(self.device, copy=True, non_blocking=tensor.is_pinned())
        piece = next(place)[: _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
        return piece.copy_(tensor, non_blocking=tensor.is_pinned())

    def _receive(self, home: torch.Tensor | None, value: torch.Tensor, state: bool = False) -> torch.Tensor:
        """``value`` (on the device) copied into ``home`` where it fits, else into a new host
        tensor; the host tensor that holds it now. ``state``: a state tensor, which moves to a
        page-locked one where it is not and host tensors are (a load makes them unpinned)."""
        self.stats.record(DEVICE_TO_HOST, value.numel() * value.element_size(), 0)
        unpinned = state and self._pin and type(home) is torch.Tensor and not home.is_pinned()
        if (
            home is not None
            and type(home) is type(value)
            and (home.shape, home.dtype) == (value.shape, value.dtype)
            and not unpinned
        ):
            return home.copy_(value, non_blocking=home.is_pinned())
        new = value.to("cpu", copy=True)
        return new.pin_memory() if self._pin and type(new) is torch.Tensor else new


class _Arena:
    """The device memory of a step's chunks: one tensor made on the current stream, so that
    what the step frees returns to the memory the forward and backward allocate from (a copy
    made on a side stream stays cached for that stream alone). Chunks take turns from its two
    ends, even ones from the front and odd ones from the back, so a chunk and the one before
    it, the two on the device at once ([Note: streamed step]), never overlap in it: its size
    is the largest such pair's (the plan's ``staging``, with each tensor's start rounded up to
    ``ALIGN`` bytes)."""

    ALIGN = 256

    def __init__(self, device: torch.device, sizes: list[list[int]]) -> None:
        self.sizes = [[-(-n // self.ALIGN) * self.ALIGN for n in chunk] for chunk in sizes]
        total = staging_bytes([sum(chunk) for chunk in self.sizes])
        self.memory = torch.empty(total, dtype=torch.uint8, device=device)

    def chunk(self, index: int) -> Iterator[torch.Tensor]:
        """Chunk ``index``'s pieces in its sizes' order."""
        sizes = self.sizes[index]
        start = 0 if index % 2 == 0 else self.memory.numel() - sum(sizes)
        for n in sizes:
            yield self.memory[start : start + n]
            start += n


def _step_only(
    inner: torch.optim.Optimizer, ids: Collection[int], runs: list[torch.Tensor], first: bool
) -> None:
    """Step the runs whose ids are ``ids`` and no other: the precision-aware optimizer by
    name; any other by hiding the other runs' grads for the call, as torch skips a param
    without a grad. ``first``: the first call of this step (the precision-aware optimizer
    counts its steps there)."""
    if isinstance(inner, PrecisionAwareOptimizer):
        inner.step_runs(ids, count=first)
        return
    hidden = [(t, t.grad) for t in runs if id(t) not in ids and t.grad is not None]
    for t, _ in hidden:
        t.grad = None
    try:
        inner.step()
    finally:
        for t, grad in hidden:
            t.grad = grad


class _on:
    """``torch.cuda.stream(stream)``, or nothing on a CPU."""

    def __init__(self, stream: Any) -> None:
        self.context = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def _record(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _wait(staged: _Staged | None) -> None:
    """The host waits for ``staged``'s download; its device copies are then released."""
    if staged is None:
        return
    if staged.downloaded is not None:
        staged.downloaded.synchronize()
    staged.copies.clear()
    staged.made.clear()
