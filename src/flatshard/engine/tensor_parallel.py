"""Tensor-parallel params: a DTensor param held in flat buffers by its local shard.

The reasoning is [Note: tensor-parallel params] below."""

# [Note: tensor-parallel params]
#
# A model made tensor-parallel first (``parallelize_module`` over the ``tp`` dimension of a
# device mesh, or transformers' tensor-parallel plan) and then sharded with
# ``shard(model, group=mesh["dp"])`` has params that are DTensors: each holds a local shard
# (``_local_tensor``) under global metadata (shape, placements). flatshard is the model's
# data-parallel dimension and sees only the local shards:
#
# * **The buffers hold local shards.** A param's layout spec is its local tensor's size and
#   dtype. Binding points ``_local_tensor`` at the buffer view (``rebind``; assigning
#   ``.data`` does not reach a DTensor's local tensor), so the Parameter object, its hooks,
#   its tied names and references to it stay. ``local`` is the one accessor of a param's
#   values; a DTensor's ``shape`` and ``numel()`` are global and never size a buffer.
# * **Collectives run over dp only.** Every rank of a dp group holds the same tp coordinate,
#   so its local shards have the same shapes (the agreement lines name each param's local
#   shape and placements). ``mesh_of`` refuses a dp world that shares a rank other than this
#   one with the params' tp mesh (it would average different shards), params on two meshes
#   or on a mesh of several dimensions, and a ``Partial`` or strided placement (a param
#   already sharded by another library).
# * **A grad is summed over tp before it is reduced over dp.** Autograd hands a DTensor
#   grad whose placements may differ from the param's: a ``Replicate`` param used on
#   sequence-sharded activations (a ``SequenceParallel`` norm) gets a ``Partial`` grad.
#   ``local_grad`` redistributes it to the param's placements (an all-reduce over tp that
#   every tp rank reaches in the same order, since they run the same graph) and gives its
#   local tensor, which grad sync accumulates and reduces as any grad, scaled by 1 / dp.
# * **Every param's ``.grad`` is a ``ShardedGrad``** ([Note: grads seen by torch]) in a
#   tensor-parallel model, at every stage: a torch optimizer stepping DTensors the buffers
#   do not back is refused, and ``DistributedOptimizer`` steps the local shards (an
#   elementwise update is the same on a shard as on the full param).
# * **Norms cover the whole mesh, each element once.** A param sharded over tp (some
#   ``Shard`` placement) has its ``|g|**p`` summed over dp, then over tp. A param
#   replicated over tp (every placement ``Replicate``, or a plain param beside DTensors)
#   holds the same reduced grad on every tp rank: it is summed over dp only. So torch's
#   ``clip_grad_norm_``, ``DistributedOptimizer.clip_grad_norm_`` and the overflow check
#   give the norm one process computes on the whole model.
# * **Mixed precision casts a DTensor param by swapping its contents** with its cast
#   (``torch.utils.swap_tensors``, as ``module.to(dtype)`` does: the dtype is in the
#   DTensor's metadata, which ``.data`` does not reach), so the param object stays; the fp32
#   main params start from the fp32 local shards.
# * **Checkpoints keep each param full.** A checkpoint stores every param (its main params
#   and optimizer state too) as its flattened full tensor ([Note: checkpoints]); a rank's
#   piece of a local shard is a set of runs of it (``global_runs``: a ``Shard(d)`` shard is
#   contiguous in the full param over its dims from ``d`` on), so a checkpoint written at any
#   tp x dp layout is the one the plain model writes, and loads at any other layout.
# * **Stage 3 gathers local shards.** A stage-3 unit gathers each DTensor param's local shard
#   over dp, and the param's ``_local_tensor`` is rebound to its view of the full bucket while
#   the unit is gathered and to its NaN placeholder between (``rebind``: the DTensor object,
#   its class and its placements stay); a state dict loaded at stage 3 gives each rank its
#   local shard of every value (``local_values``), and ``summon_full_params(with_grads=True)``
#   gives DTensor grads of the params' placements (``as_grad_of``).
# * **Refused for now, by name** (``refuse``): a meta-device model (its placeholders would
#   take the full shape), ``whole_params`` (Muon's whole matrix is split by tp), loading
#   weight files (``load_weights``, ``load_pretrained``: full tensors into local shards), the
#   hybrid and owner optimizers (they size params by their global shape).
#   ``full_state_dict()`` and ``save_pretrained`` gather each param full over tp (``full_value``,
#   on every rank), from the fp32 main params where the optimizer keeps them.
# * **Compiled**, a DTensor param's local shard is an alias of its buffer view with a
#   version counter of its own (a compiled graph saves the local shard for backward, and a
#   view would count stage 3's gather into its bucket as an in-place write), and the
#   DTensor's own metadata (its storage offset) follows it (``rebind`` sets both): Dynamo
#   fakes a DTensor by rebuilding it around its faked local tensor and refuses one whose
#   offset differs. The rest is in [Note: hooks and torch.compile].

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatshard.comm.collectives import all_reduce
from flatshard.comm.world import World, resolve_world


def is_distributed(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor (tensor-parallel, or sharded by another library)."""
    return isinstance(param, DTensor)


def local(param: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of ``param``: a DTensor's local shard, else ``.data``."""
    return param._local_tensor if isinstance(param, DTensor) else param.data


def local_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``local(param)``, read from metadata only (a stage-3 param not gathered
    refuses reads of its values, not of its shape)."""
    return param._local_tensor.shape if isinstance(param, DTensor) else param.shape


def full_value(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` of this rank's local shard of ``param`` (local shape) as the full
    tensor: gathered over tp for a DTensor param (every tp rank must call it), else as they
    are. A DTensor given as ``values`` is gathered full itself."""
    if isinstance(values, DTensor):
        return values.full_tensor()
    if not isinstance(param, DTensor):
        return values
    shard = DTensor.from_local(
        values, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return shard.full_tensor()


def rebind(param: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``values`` (the local shape and dtype) the tensor ``param`` reads and writes."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            # The local tensor aliases ``values`` with a version counter of its own, as a
            # plain param's ``.data`` does: a compiled graph saves it for backward, and a
            # view would count stage 3's gather into its bucket as a write to it. The
            # wrapper's own metadata takes its storage offset too: Dynamo fakes a DTensor
            # by rebuilding it around its faked local tensor and refuses a differing offset.
            alias = values.new_empty(0).set_(
                values.untyped_storage(), values.storage_offset(), values.size(), values.stride()
            )
            mesh, placements = param.device_mesh, param.placements
            wrapper = DTensor.from_local(alias, mesh, placements, shape=param.shape, stride=param.stride())
            param.data = wrapper  # (run_check=False by default: no collective)
            param._local_tensor = alias
        else:
            param.data = values


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``param``'s new ``grad`` as a plain tensor of its local shape: a DTensor grad whose
    placements differ from the param's (``Partial`` on a replicated norm) redistributed
    to them first."""
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    values = grad._local_tensor
    wait = getattr(values, "wait", None)  # (an AsyncCollectiveTensor of the redistribution)
    return wait() if callable(wait) else values


@dataclass(frozen=True)
class TensorParallel:
    """The tp dimension of a model whose params include DTensors: its world, and which
    params are sharded over it (the others hold the same values on every tp rank)."""

    world: World
    mesh_dims: tuple[str, ...]
    split: frozenset[str]  # the names of the params with a Shard placement


def mesh_of(named: Sequence[tuple[str, nn.Parameter]], worlds: Sequence[World]) -> TensorParallel | None:
    """The tp dimension of ``named``'s DTensor params (None without any), checked against
    the data-parallel ``worlds`` (see the note)."""
    dist_named = [(n, p) for n, p in named if isinstance(p, DTensor)]
    if not dist_named:
        return None
    first_name, first = dist_named[0]
    mesh = first.device_mesh
    dims = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    for name, p in dist_named:
        _check_param(name, p)
        if p.device_mesh != mesh:
            raise ValueError(
                f"param {name!r} is a DTensor on mesh {_ranks(p.device_mesh)} and {first_name!r} on "
                f"{_ranks(mesh)}: flatshard composes with one tensor-parallel mesh dimension"
            )
    tp_ranks = set(_ranks(mesh))
    for world in worlds:
        if world.group is None:
            continue
        dp_ranks = set(dist.get_process_group_ranks(world.group))
        shared = sorted(dp_ranks & tp_ranks - {dist.get_rank()})
        if shared:
            raise ValueError(
                f"group: the data-parallel ranks {sorted(dp_ranks)} include ranks {shared} of the "
                f"tensor-parallel mesh {dims} {sorted(tp_ranks)} of param {first_name!r}: they hold "
                "different shards, which a data-parallel reduction would average. Pass the mesh's "
                'data-parallel dimension (mesh["dp"], or Lightning\'s self.device_mesh["data_parallel"])'
            )
        _check_same_coordinate(world, mesh, dims, first_name)
    timeout = next((w.timeout for w in worlds if w.group is not None), None)
    world = resolve_world(mesh.get_group(), timeout)
    split = frozenset(n for n, p in dist_named if any(isinstance(s, Shard) for s in p.placements))
    return TensorParallel(world, tuple(dims), split)


def _check_same_coordinate(world: World, mesh, dims: tuple[str, ...], name: str) -> None:
    """Every rank of a data-parallel ``world`` must hold the same tp shards (the same
    coordinate in its tp mesh): a dp group across tp coordinates ({0, 3} beside tp groups
    {0, 1} and {2, 3}) would average, and at wrap time broadcast, different shards."""
    coordinate = (mesh.get_coordinate() or [0])[0]
    spread = torch.tensor([coordinate, -coordinate], dtype=torch.int64, device=world.control_device)
    all_reduce(spread, world, op="max").wait()
    if int(spread[0]) != -int(spread[1]):
        dp_ranks = sorted(dist.get_process_group_ranks(world.group))
        raise ValueError(
            f"group: the data-parallel ranks {dp_ranks} sit at tensor-parallel coordinates "
            f"{-int(spread[1])} to {int(spread[0])} of the mesh {dims} of param {name!r} (this rank "
            f"{dist.get_rank()}: {coordinate} in {sorted(_ranks(mesh))}): they hold different shards, "
            "which a data-parallel reduction would average. The dp group must be orthogonal to tp: pass "
            'the mesh\'s data-parallel dimension (mesh["dp"] of one init_device_mesh with "tp")'
        )


SPREAD = 1e-4
"""How far a sum of squares of grads replicated over tp may differ between the tp ranks,
relative to it: rounding gives 1e-7, experts spread over tp O(1) ([Note: expert parallelism]
in ``wrap/plan.py``)."""


def check_alike_over_tp(total: torch.Tensor, total_sq: torch.Tensor, tp: TensorParallel) -> None:
    """Raise unless the values whose sum over tp is ``total`` (and of their squares
    ``total_sq``) were alike on every tp rank: every rank decides alike from the same sums."""
    n = tp.world.size
    spread = float((n * total_sq - total.square()).clamp(min=0).sqrt())  # sqrt(sum_{i<j} (x_i - x_j)^2)
    if spread > SPREAD * abs(float(total)):
        raise ValueError(
            f"the grads of params that are not split over tp {tp.mesh_dims} differ between the tp ranks "
            f"(their norms spread by {spread / abs(float(total)):.2g} of their sum): params that hold "
            "different values on each tp rank, such as experts spread over tp, need their "
            "expert-parallel group named, shard(expert=flatshard.Experts(group, match, ep=...))"
        )


def global_runs(param: torch.Tensor, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Elements ``[lo, hi)`` of ``param``'s flattened local shard as runs of its flattened
    full tensor: ``(offset in the full tensor, lo, hi)`` each, contiguous in both (a plain or
    replicated param: one run at ``lo``). A ``Shard(d)`` shard is contiguous in the full tensor
    over its dims from ``d`` on, so its runs are ``prod(shape[:d])`` at most."""
    if not isinstance(param, DTensor) or not any(isinstance(s, Shard) for s in param.placements):
        return [(lo, lo, hi)] if hi > lo else []
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = tuple(param.shape)
    shape, offsets = compute_local_shape_and_global_offset(full, param.device_mesh, param.placements)
    dim = next(s.dim for s in param.placements if isinstance(s, Shard)) % len(full)
    after = math.prod(full[dim + 1 :])
    run = shape[dim] * after  # (elements of the local shard contiguous in the full tensor)
    runs = []
    start = lo
    while start < hi:
        outer, inner = divmod(start, run) if run else (0, 0)
        end = min(hi, (outer + 1) * run)
        base = sum(o * math.prod(full[i + 1 :]) for i, o in enumerate(offsets))
        runs.append((outer * full[dim] * after + base + inner, start, end))
        start = end
    return runs


def as_grad_of(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (local shape) as a ``.grad`` of ``param``: a DTensor's grad is a DTensor
    of its placements, over ``values``."""
    if not isinstance(param, DTensor):
        return values
    return DTensor.from_local(
        values, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def local_values(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """What this rank's local shard of ``param`` holds of ``value`` (a state dict's entry for
    it: a DTensor, or the full tensor); ``value`` itself for a plain param."""
    if not isinstance(param, DTensor):
        return value
    if isinstance(value, DTensor):
        return value.redistribute(param.device_mesh, param.placements).to_local()
    shape = local_shape(param)
    flat = value.reshape(-1)
    runs = global_runs(param, 0, shape.numel())
    return torch.cat([flat[start : start + hi - lo] for start, lo, hi in runs]).view(shape)


def _check_param(name: str, p: DTensor) -> None:
    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"param {name!r} is a DTensor on a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: flatshard is "
            "the data-parallel dimension of a tensor-parallel model whose params live on the 1-D tp "
            "mesh (a param already sharded by fully_shard or another library cannot be sharded again)"
        )
    for placement in p.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"param {name!r} has placement {placement} on mesh {mesh.mesh_dim_names}: flatshard "
                "shards tensor-parallel params placed Shard(dim) or Replicate()"
            )
    if not p._local_tensor.is_contiguous():
        raise ValueError(f"param {name!r}'s local shard is not contiguous: call .contiguous() on it first")


def _ranks(mesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def describe(param: nn.Parameter) -> str:
    """A DTensor param's local shape and placements, for the agreement lines."""
    if not isinstance(param, DTensor):
        return ""
    return f" local={tuple(param._local_tensor.shape)} placements={tuple(map(str, param.placements))}"


def refuse(what: str, name: str, instead: str) -> ValueError:
    """The error for a feature that does not yet work on a tensor-parallel param."""
    return ValueError(
        f"{what} is not supported with tensor parallelism yet (param {name!r} is a DTensor): "
        f"{instead} ([Note: tensor-parallel params])"
    )


def refuse_tensor_parallel(module: nn.Module, what: str, instead: str) -> None:
    """Raise ``refuse`` naming ``module``'s first DTensor param, if it has one."""
    name = next((n for n, p in module.named_parameters() if isinstance(p, DTensor)), None)
    if name is not None:
        raise refuse(what, name, instead)


def refuse_distributed_params(params, what: str) -> None:
    """An optimizer that sizes its params by their shape refuses a DTensor among ``params``
    (its global shape is not what this rank holds)."""
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            raise ValueError(
                f"{what} was given a DTensor param (number {i}, shape {tuple(p.shape)}, placements "
                f"{tuple(map(str, p.placements))}): it sizes params by their global shape, which a "
                "tensor-parallel rank does not hold. Shard the model with flatshard.shard(model, "
                'group=mesh["dp"]) and step it with flatshard.DistributedOptimizer '
                "([Note: tensor-parallel params])"
            )
