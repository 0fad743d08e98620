"""Resident model-state memory on this rank, counted from real storages."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from flatshard.engine.dynamo import uncompiled
from flatshard.engine.grad_view import ShardedGrad
from flatshard.engine.wrapper_tensors import inner_values


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of unique storages on this rank, by role (each storage counted once), and how
    many of them live on the host ([Note: memory tiers] in ``planner/offload.py``)."""

    params: int
    grads: int
    main_params: int
    optimizer_state: int
    host: int = 0  # of the total, the bytes whose home is the host (offloaded)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main_params + self.optimizer_state

    @property
    def device(self) -> int:
        """The bytes whose home is the device."""
        return self.total - self.host

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total, "device": self.device}


ROLES = ("params", "grads", "main_params", "optimizer_state")


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: dict[int, int]) -> int:
    total = 0
    for t in (v for tensor in tensors for v in inner_values(tensor)):  # (a DTensor's local shard,
        storage = t.untyped_storage()  # a wrapper's inner tensors: torchao's NF4)
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen[key] = storage.nbytes()
        total += storage.nbytes()
    return total


def state_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, list[torch.Tensor]]:
    """Every tensor of the model state that ``model`` and ``optimizer`` keep on this rank, by
    role ("params", "grads", "main_params", "optimizer_state"; a storage may appear under
    several), with "host" listing those whose home is the host."""
    model = uncompiled(model)
    host_tensors = getattr(optimizer, "host_tensors", None)
    homed: dict[str, list[torch.Tensor]] = host_tensors() if callable(host_tensors) else {}
    params = list(model.parameters())
    state = getattr(model, "flatshard_state", None)
    held: list[torch.Tensor] = list(params)
    if state is not None:  # the flat buffers, then params outside them (stage 3: placeholders skipped)
        in_buffers = {id(p) for bset in state.param_sets() for p in bset.params}
        held = [b.param_storage() for bset in state.param_sets() for b in bset.buffers]
        held = [t for t in held if t is not None]  # (None: the main params hold them)
        held += [p for p in params if id(p) not in in_buffers]
        if state.unsharder is not None:  # stage-3 units full right now (e.g. prefetched)
            held += [p.full_tensor() for parts in state.unsharder.parts for p in parts]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    grads = [g for g in grads if not isinstance(g, ShardedGrad)]  # (no storage: views of the buffers')
    if state is not None:  # grads that no param views between backwards (stage-2/3 shards)
        grads += [g for bset in state.sets.values() for b in bset.buffers for g in b.grad_storage()]
        grads += state.grad_sync.pooled_scratch()
    grads += homed.get("grads", [])  # (the host frame an offloaded step reads them from)
    mains: list[torch.Tensor] = []
    inner_state: list[torch.Tensor] = []
    if optimizer is not None:
        main_params = getattr(optimizer, "main_params", None)
        mains = [*(main_params() if callable(main_params) else []), *homed.get("main_params", [])]
        inner_state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        inner_state += homed.get("optimizer_state", [])
    homed_params = []  # (frozen shards the model keeps on the host itself: [Note: memory tiers])
    if state is not None:
        buffers = [b for bset in state.param_sets() for b in bset.buffers]
        homed_params = [b.param_storage() for b in buffers if b.params_on_host]
    return {
        "params": held,
        "grads": grads,
        "main_params": mains,  # (an inner optimizer's host copies too)
        "optimizer_state": inner_state,
        "host": [t for role in homed.values() for t in role] + [t for t in homed_params if t is not None],
    }


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Count the params, grads, main params and optimizer state that ``model`` and
    ``optimizer`` keep on this rank. Flat buffers count once however many params view
    them; a storage shared by two roles counts for the first (params, grads, state). At
    stage 3 a unit's full params count while they exist (between steps: the units a step
    prefetched for the next forward; ``model.wait_for_params()`` frees them);
    ``model.flatshard_state.unsharder.peak_full_bytes`` says the most ever alive. Between
    ``offload_states`` and ``reload_states`` every byte counts on the host."""
    seen: dict[int, int] = {}  # storage -> its bytes
    roles = state_tensors(model, optimizer)
    counts = {role: _storage_bytes(roles[role], seen) for role in ROLES}
    host = {t.untyped_storage().data_ptr() for t in roles["host"]}
    parked = getattr(getattr(uncompiled(model), "flatshard_state", None), "parked", None)
    if parked is not None:  # ([Note: states between phases] in flatshard/phases.py)
        host |= parked.host_storages()
    host_bytes = sum(n for key, n in seen.items() if key in host)
    if parked is not None:
        for role, nbytes in parked.bytes_by_role().items():
            counts[role] += nbytes
            host_bytes += nbytes
    return MemoryReport(
        counts["params"], counts["grads"], counts["main_params"], counts["optimizer_state"], host_bytes
    )


def mib(nbytes: int | None) -> str:
    """``nbytes`` as MiB for tables ("-" for a count that could not be taken)."""
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"
