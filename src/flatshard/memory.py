"""Resident model-state memory on this rank, counted from real storages."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import nn

from flatshard._compile import uncompiled


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of unique storages on this rank, by role (each storage counted once)."""

    params: int
    grads: int
    main_params: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main_params + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor (torch FSDP2): this rank's local shard
            t = t.to_local()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Count the params, grads, main params and optimizer state that ``model`` and
    ``optimizer`` keep on this rank. Flat buffers count once however many params view
    them; a storage shared by two roles counts for the first (params, grads, state). At
    stage 3 a unit's full params count while they exist (between steps: the units a step
    prefetched for the next forward; ``model.wait_for_params()`` frees them);
    ``model.flatshard_state.unsharder.peak_full_bytes`` says the most ever alive."""
    seen: set[int] = set()
    model = uncompiled(model)
    params = list(model.parameters())
    state = getattr(model, "flatshard_state", None)
    held = params
    if state is not None:  # the flat buffers, then params outside them (stage 3: placeholders skipped)
        in_buffers = {id(p) for bset in state.sets.values() for p in bset.params}
        held = [b.param_storage() for bset in state.sets.values() for b in bset.buffers]
        held = [t for t in held if t is not None]  # (None: the main params hold them)
        held += [p for p in params if id(p) not in in_buffers]
        if state.unsharder is not None:  # stage-3 units full right now (e.g. prefetched)
            held += [p.buffer.full_bucket(p.bucket) for parts in state.unsharder.parts for p in parts]
    param_bytes = _storage_bytes(held, seen)
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    if state is not None:  # grads that no param views between backwards (stage-2/3 shards)
        grads += [g for bset in state.sets.values() for b in bset.buffers for g in b.grad_storage()]
        grads += state.grad_sync.pooled_scratch()
    grad_bytes = _storage_bytes(grads, seen)
    main_bytes = 0
    state_bytes = 0
    if optimizer is not None:
        main_params = getattr(optimizer, "main_params", None)
        if callable(main_params):
            main_bytes = _storage_bytes(main_params(), seen)
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        state_bytes = _storage_bytes(state, seen)
    return MemoryReport(param_bytes, grad_bytes, main_bytes, state_bytes)


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

CPU_MALLOC_TUNABLES = ("glibc.malloc.tcache_count=0",)
"""glibc malloc settings for processes that train on CPU, in ``GLIBC_TUNABLES`` syntax.

glibc's per-thread caches (tcache) keep small freed blocks marked in use, so they are never
merged with the free memory around them. Small blocks freed between big ones then cut big
freed tensors into pieces that no later tensor fits, and the heap keeps growing: at stage 3
on the small GPT (2 ranks), RSS went from 328 to 608 MiB over 650 steps while the bytes in
use stayed at 130 MiB, and each step took 300-450 page faults (9-12 ms of system time
against DDP's 3). With tcache off: 326 to 346 MiB, flat after 100 steps, 30-45
faults and 4-6 ms of system time per step, and no slower for DDP. glibc reads tunables only
when a process starts, so they go into the environment of the ranks a launcher starts
(``cpu_malloc_env``); for ranks started otherwise (torchrun), export them yourself."""


def mib(nbytes: int | None) -> str:
    """``nbytes`` as MiB for tables ("-" for a count that could not be taken)."""
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def retain_freed_cpu_memory(threshold: int = 2**28) -> bool:
    """Ask glibc's malloc to keep freed blocks of up to ``threshold`` bytes for reuse instead
    of handing them back to the OS (and serve them from its heap, not fresh mmaps).

    On CPU every tensor freed and allocated again (activations, stage-2 scratch, stage-3
    full params) otherwise costs a page fault per 4 KiB: 3-7 thousand per step of the small
    GPT, about 10% of its step time. Process-wide and idempotent; the benchmark and the CLI
    call it for every peer alike. Returns False where malloc is not glibc's.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, threshold)) and bool(
            libc.mallopt(M_MMAP_THRESHOLD, threshold)
        )
    except (OSError, AttributeError):
        return False


def cpu_malloc_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``CPU_MALLOC_TUNABLES`` added to its ``GLIBC_TUNABLES`` (a tunable the
    environment already sets keeps its value)."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.partition("=")[0] for t in tunables}
    tunables += [t for t in CPU_MALLOC_TUNABLES if t.partition("=")[0] not in names]
    return {**env, "GLIBC_TUNABLES": ":".join(tunables)}
