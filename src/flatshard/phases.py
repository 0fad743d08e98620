"""Between training phases: every training byte of a sharded model and its optimizer moved
to the host and back (``offload_states`` / ``reload_states``), for a loop that hands the
device to something else between steps, as an RL job gives it to its inference engine
between rollouts ([Note: states between phases])."""

# [Note: states between phases]
#
# ``offload_states(model)`` copies each storage of the model state that lives on the
# model's device to a host tensor (pinned on CUDA) and frees the storage in place
# (``untyped_storage().resize_(0)``): every view into it (params, grads, bucket views, the
# optimizer's shards and state) stays the same object, and is valid again once
# ``reload_states(model)`` has grown the storage back and copied the bytes in. Bytes are
# copied, never converted: a reload is bit-exact, and training goes on as if nothing happened.
#
# * **What moves.** The flat buffers' params, the grads (buffers, shards, scratch), the main
#   params and the optimizer's state (the ``DistributedOptimizer`` attached to the model, or
#   the one given), each storage once; not those whose home is the host already
#   (``shard(offload=Offload())``, [Note: memory tiers] in ``planner/offload.py``). Params
#   outside the flat buffers (frozen ones below stage 3, a frozen quantized base) and the
#   module's buffers are plain tensors: their ``.data`` moves to a host copy and back, and
#   they stay readable on the host meanwhile.
# * **Nothing reads a freed storage** (a kernel reading one crashes the process). While
#   offloaded every param of a flat buffer is a placeholder (stage 3's, [Note:
#   placeholders] in ``units/placeholder.py``) whose refusal names ``reload_states``; a
#   forward, ``zero_grad``, the optimizer's step and whatever waits for the params first
#   (state dicts, checkpoints, ``summon_full_params``) raise a ``RuntimeError`` naming it.
# * **Nothing communicates.** Offloading first waits for the param gathers a step left in
#   flight and frees stage 3's gathered units, all local; a rank that offloads while the
#   others train stops at its next forward with that error.
# * ``memory_report`` counts the offloaded bytes on the host, under their roles.

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard.engine.dynamo import uncompiled
from flatshard.engine.tensor_parallel import local, local_shape
from flatshard.engine.wrapper_tensors import inner_values, is_wrapper
from flatshard.memory import ROLES, state_tensors
from flatshard.units.placeholder import OFFLOADED, hide, label, show
from flatshard.wrap.module import ShardedModule

__all__ = ["offload_states", "offloaded", "reload_states"]


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    host: torch.Tensor  # its bytes (uint8) on the host
    role: str


@dataclass
class Parked:
    """What ``offload_states`` moved, and how to put it back."""

    device: torch.device
    moved: list[_Moved] = field(default_factory=list)
    swapped: list[torch.Tensor] = field(default_factory=list)  # plain tensors whose .data is on the host
    hidden: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    marked: list[nn.Parameter] = field(default_factory=list)

    def bytes_by_role(self) -> dict[str, int]:
        """The moved storages' bytes, by role (the swapped plain tensors are counted by
        ``memory_report``'s own walk, on the host)."""
        out = dict.fromkeys(ROLES, 0)
        for m in self.moved:
            out[m.role] += m.host.numel()
        return out

    def host_storages(self) -> set[int]:
        """The storages of the plain tensors now on the host."""
        return {t.untyped_storage().data_ptr() for t in self.swapped}


def offload_states(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Move every training byte of ``model`` (a ``flatshard.shard`` model) and its optimizer
    (the ``DistributedOptimizer`` built over it, or ``optimizer``) to the host, freeing the
    device's copies; ``reload_states`` brings them back bit for bit. Until then the model
    refuses to run or be read ([Note: states between phases])."""
    state = _state(model, "offload_states")
    if state.parked is not None:
        raise RuntimeError(
            "offload_states: the model's states are offloaded already; call reload_states first"
        )
    optimizer = optimizer if optimizer is not None else state.optimizer
    state.wait_for_params()  # (the gathers in flight; stage 3: no unit left gathered)
    device = state.device
    parked = Parked(device)
    in_buffers = {id(p): p for bset in state.param_sets() for p in bset.params}
    _hide(model, state, in_buffers, parked)
    _move_storages(model, optimizer, device, parked)
    _swap_plain(model, in_buffers, device, parked)
    state.parked = parked
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with torch.cuda.device(device):  # (not the current device's: it may be another)
            torch.cuda.empty_cache()


def reload_states(model: nn.Module) -> None:
    """Bring back what ``offload_states`` moved to the host: the same storages, the same
    bytes, the params plain again."""
    state = _state(model, "reload_states")
    parked = state.parked
    if parked is None:
        raise RuntimeError("reload_states: the model's states are not offloaded (call offload_states first)")
    for moved in parked.moved:
        moved.storage.resize_(moved.host.numel())
        _bytes(moved.storage).copy_(moved.host, non_blocking=True)
    for tensor in parked.swapped:
        tensor.data = tensor.data.to(parked.device, non_blocking=True)
    if parked.device.type == "cuda":
        torch.cuda.synchronize(parked.device)
    for param, view, placeholder in parked.hidden:
        show(param, view, placeholder)
    for param in parked.marked:
        delattr(param, OFFLOADED)
    if state.tree is not None:
        state.tree.take_storages()
    state.parked = None


@contextmanager
def offloaded(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """``offload_states`` on entry, ``reload_states`` on exit (an error inside too)."""
    offload_states(model, optimizer)
    try:
        yield
    finally:
        reload_states(model)


def _state(model: nn.Module, what: str):
    module = uncompiled(model)
    if not isinstance(module, ShardedModule):
        raise TypeError(f"{what} takes a model wrapped by flatshard.shard, got {type(module).__name__}")
    return module.flatshard_state


def _hide(model: nn.Module, state, in_buffers: dict[int, nn.Parameter], parked: Parked) -> None:
    """Every param of a flat buffer a placeholder that names ``reload_states``: below stage 3
    made one here, at stage 3 one already between its unit's uses."""
    names = {id(p): n for n, p in uncompiled(model).named_parameters()}
    for key, param in in_buffers.items():
        if not state.policy.gathers_units:
            view = local(param)
            nan = torch.full((1,), float("nan"), dtype=view.dtype, device=view.device)
            placeholder = nan.expand(local_shape(param))
            label(param, f"param {names.get(key, '?')!r}")
            hide(param, placeholder)
            parked.hidden.append((param, view, placeholder))
        setattr(param, OFFLOADED, True)
        parked.marked.append(param)


def _move_storages(model: nn.Module, optimizer, device: torch.device, parked: Parked) -> None:
    """Each storage of the model state on ``device`` (not homed on the host) to a host copy,
    freed in place."""
    roles = state_tensors(model, optimizer)
    roles["params"] = [t for t in roles["params"] if not isinstance(t, nn.Parameter)]  # (plain: swapped)
    homed = {t.untyped_storage().data_ptr() for t in roles["host"]}
    seen: set[int] = set()
    pin = device.type == "cuda"
    for role in ROLES:
        for tensor in roles[role]:
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            key = storage.data_ptr()
            if key in seen or key in homed or storage.nbytes() == 0 or storage.device != device:
                continue
            seen.add(key)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes(storage), non_blocking=pin)
            parked.moved.append(_Moved(storage, host, role))
    if pin:
        torch.cuda.synchronize(device)
    for moved in parked.moved:
        moved.storage.resize_(0)


def _swap_plain(
    model: nn.Module, in_buffers: dict[int, nn.Parameter], device: torch.device, parked: Parked
) -> None:
    """The params outside the flat buffers and the module's buffers: their ``.data`` to a
    host copy (readable meanwhile)."""
    module = uncompiled(model)
    plain = [p for p in module.parameters() if id(p) not in in_buffers]
    for tensor in [*plain, *module.buffers()]:
        if tensor.device != device or not tensor.numel():
            continue
        wrapped = is_wrapper(tensor) or isinstance(tensor, DTensor)  # (its inner tensors move)
        for inner in inner_values(tensor) if wrapped else [tensor]:
            parked.swapped.append(inner)
            inner.data = inner.data.to("cpu", copy=True)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
