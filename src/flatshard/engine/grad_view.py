"""A param's ``.grad`` where flatshard keeps the grad in its buffers: a ``ShardedGrad``.

The reasoning is [Note: grads seen by torch] below."""

# [Note: grads seen by torch]
#
# Torch's utilities (``clip_grad_norm_``, ``clip_grad_value_``, ``zero_grad``, a torch optimizer)
# read ``param.grad``. Where a buffer is *exposed* (stage 0, grad dtype = param dtype) that is
# ``main_grad`` itself, all-reduced: they work unchanged. Elsewhere the grad lives in the
# buffers only (stages 1-3: each rank holds the reduced grads of its shard; stage 0 with
# 16-bit params: an fp32 ``main_grad``), and a ``.grad`` of None made those utilities skip the
# param without a word (``clip_grad_norm_`` returned 0). So at the end of every backward each
# such param's ``.grad`` becomes its ``ShardedGrad``: a tensor with the param's shape, dtype
# and device and no storage, whose operations act on the grad as a whole, across ranks:
#
# * **Norms are global.** ``torch.linalg.vector_norm(g, ord)`` (and ``g.norm()``,
#   ``torch._foreach_norm``) is the norm of the param's whole reduced grad, in the dtype of
#   the grad flatshard holds (fp32 for a bf16 param with fp32 grads): on its first call
#   after a change, every param's partial norms (of this rank's pieces, in fp32 or wider) go
#   into one all-reduce per world (sum of ``|x|**ord``, or max for ``inf``), cached until the
#   grads change. As with DTensor, every rank must ask (torch's ``clip_grad_norm_`` does).
# * **Elementwise writes act on this rank's pieces** (``mul_``, ``div_`` by a scalar or a
#   0-d tensor, ``clamp_``, ``clamp_min_``, ``clamp_max_``, ``zero_``, and their ``_foreach_``
#   forms): the pieces are what the optimizer steps, so clipping reaches the update, on every
#   rank alike. Padding is never a piece.
# * **Anything else is refused** with a ``ShardedGradError`` naming the param, the operation
#   and what to call instead (``summon_full_params(with_grads=True)`` to read the full grad,
#   ``flatshard.DistributedOptimizer`` to step): a torch optimizer over the model's params, or
#   user code reading one rank's values, fails at once instead of stepping nothing.
# * **Backward adds through it.** A backward that finds a ``ShardedGrad`` (no ``zero_grad``
#   since the last one) has autograd call its ``add_``; inside backward that only hands the new
#   grad to the grad-sync hook, which accumulates it into the buffers as usual.
# * **A grad assigned by hand is refused at the step** (``check_assigned``): a ``.grad`` that is
#   neither None nor what flatshard put there never reached a reduction, so stepping would
#   ignore it (stages 1-3) or step on one rank's values; the error says to accumulate it with
#   ``torch.autograd.backward(params, grads)``, which goes through the reduction.
#
# Grads accumulated under ``no_sync`` are not reduced: their ``ShardedGrad`` refuses even
# norms until a synced backward. ``zero_grad`` (set to None) drops them all.

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from flatshard.comm.collectives import CommStats, all_reduce, all_reduce_max
from flatshard.comm.world import World
from flatshard.engine.buffer import FlatBuffer, FlatParam
from flatshard.engine.tensor_parallel import TensorParallel, check_alike_over_tp, is_distributed
from flatshard.errors import ShardedGradError


class ShardedGrad(torch.Tensor):
    """A param's ``.grad`` whose values flatshard holds (see [Note: grads seen by torch])."""

    _views: GradViews
    _key: int
    _pending: torch.Tensor | None

    @staticmethod
    def __new__(cls, param: nn.Parameter, views: GradViews) -> ShardedGrad:
        grad = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        grad._views, grad._key, grad._pending = views, id(param), None
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in _flat(args) if isinstance(a, ShardedGrad))
        handler = _HANDLERS.get(func)
        if handler is None or not isinstance(args[0], (ShardedGrad, list, tuple)):  # (or read as an operand)
            raise first._views.refusal(first._key, func)
        return handler(first._views, args, kwargs)

    def take_pending(self) -> torch.Tensor | None:
        """The grad a backward added through this one (and forget it)."""
        pending, self._pending = self._pending, None
        return pending

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        name = self._views.names.get(self._key, "a param")
        return f"ShardedGrad({name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class DistributedShardedGrad(ShardedGrad):
    """The ``ShardedGrad`` of a DTensor param ([Note: tensor-parallel params]). An operation
    that mixes it with a DTensor (a torch optimizer stepping the param) is refused naming the
    param, before DTensor's dispatch would fail without naming it (DTensor leaves
    ``__torch_function__`` to the other operands)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = [*_flat(args), *_flat(kwargs.values())]
        if any(is_distributed(a) for a in operands):
            first = next(a for a in operands if isinstance(a, ShardedGrad))
            raise first._views.refusal(first._key, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


Piece = tuple[FlatBuffer, Any, slice]  # (buffer, bucket, the param's elements in its grad shard)


@dataclass(frozen=True)
class ExpertSpread:
    """Where the expert params' grads lie beyond their own world (the expert-data-parallel
    group), [Note: expert parallelism] in ``wrap/plan.py``: an expert param's whole grad is
    its grads on every rank of ``world`` and of ``over``, which is the expert-parallel group,
    or (``in_main``) the main data-parallel world, made of copies of ``world``."""

    world: World
    over: World
    in_main: bool


class GradViews:
    """The ``ShardedGrad`` of every hidden param of one wrapped module, and the pieces of
    its grad this rank holds."""

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter, World, bool, torch.dtype]],
        pieces: dict[int, list[Piece]],
        *,
        stats: CommStats,
        reduced: Callable[[], bool],
        changed: Callable[[], None],
        stage: int,
        gathers_units: bool,
        exposed: Sequence[tuple[str, FlatParam]] = (),
        tensor_parallel: TensorParallel | None = None,
        experts: ExpertSpread | None = None,
    ) -> None:
        """``params``: (name, param, its world, whether its grads are sharded over the
        world, the dtype its grad is held in); ``gathers_units``: stage 3's policy (params
        exist only inside the model's forward and backward); ``exposed``: the params whose ``.grad`` is
        ``main_grad`` itself; ``reduced``: whether the grads are reduced now; ``changed``:
        called after a write (the optimizer's cached norm is stale); ``tensor_parallel``: the
        tp dimension over which the norms of params it splits are summed too ([Note:
        tensor-parallel params]); ``experts``: where the expert params' grads lie beyond
        their world."""
        self.names = {id(p): name for name, p, *_ in params}
        self._experts = experts
        self.stage = stage
        self._gathers_units = gathers_units
        self._params = [p for _, p, *_ in params]
        self._held = {id(p): dtype for _, p, _, _, dtype in params}
        self._exposed = list(exposed)
        self._tensor_parallel = tensor_parallel
        self._world = {id(p): (world, sharded) for _, p, world, sharded, _ in params}
        self._pieces = pieces
        self._stats = stats
        self._reduced = reduced
        self._changed = changed
        self._grads = {
            id(p): (DistributedShardedGrad if is_distributed(p) else ShardedGrad)(p, self)
            for p in self._params
        }
        self._norms: dict[float, dict[int, torch.Tensor]] = {}
        self._attached: set[int] = set()  # params given their view since the last zero_grad

    # -- lifecycle ------------------------------------------------------------------------------
    def attach(self, has_grad: Callable[[FlatParam], bool]) -> None:
        """A hidden param's ``.grad`` becomes its ``ShardedGrad`` (end of a backward) where
        it has a grad as under torch and DDP: ``has_grad`` (a grad reached it on some rank,
        or here under ``no_sync``), or it had one already ([Note: params without a grad])."""
        self._norms.clear()
        with torch._C.DisableTorchFunctionSubclass():  # (stage-3 placeholders: no dispatch)
            for p in self._params:
                view = self._grads[id(p)]
                if p.grad is view or has_grad(p):
                    p.grad = view
                    self._attached.add(id(p))

    def without_grads(self) -> list[str]:
        """Names of the params whose ``.grad`` is None now (their step skips them: [Note:
        params without a grad])."""
        with torch._C.DisableTorchFunctionSubclass():
            hidden = [self.names[id(p)] for p in self._params if p.grad is None]
            return hidden + [name for name, p in self._exposed if p.grad is None]

    @property
    def count(self) -> int:
        """How many params these grads are of (hidden and exposed)."""
        return len(self._params) + len(self._exposed)

    def dropped_by_hand(self) -> list[str]:
        """Names of the params whose ``ShardedGrad`` was attached and has since been set to
        None by code other than flatshard's ``zero_grad`` (while others kept theirs)."""
        with torch._C.DisableTorchFunctionSubclass():
            return [self.names[id(p)] for p in self._params if id(p) in self._attached and p.grad is None]

    def unattach_all(self) -> None:
        """``zero_grad``: no view is attached any more."""
        self._attached.clear()

    def forget(self) -> None:
        """The grads changed under the views (a new backward, ``zero_grad``)."""
        self._norms.clear()

    def check_assigned(self) -> None:
        """Refuse a ``.grad`` assigned by hand since the backward (see the note)."""
        with torch._C.DisableTorchFunctionSubclass():
            mine: list[tuple[str, Any, torch.Tensor]] = [
                (self.names[id(p)], p, self._grads[id(p)]) for p in self._params
            ]
            for name, p, held in mine + [(n, p, p.main_grad) for n, p in self._exposed]:
                grad = p.grad
                if grad is not None and grad is not held:
                    instead = (
                        "torch.autograd.backward(params, grads), which reduces it like any grad"
                        if not self._gathers_units
                        else "loss.backward() (at stage 3 params are gathered only inside the "
                        "model's forward and backward)"
                    )
                    raise ShardedGradError(
                        f"param {name!r} has a .grad assigned by hand after backward "
                        f"(stage {self.stage}): flatshard reduces only the grads backward accumulates, "
                        f"so this one would be ignored. Accumulate it instead with {instead}"
                    )

    # -- reads and writes -----------------------------------------------------------------------
    def _require_reduced(self, key: int, op: str) -> None:
        if not self._reduced():
            raise ShardedGradError(
                f"param {self.names[key]!r}'s .grad was read by {op} while its grads are accumulated "
                "under no_sync() and not reduced yet: run the last backward of the accumulation "
                "outside no_sync() first"
            )

    def pieces(self, key: int) -> list[torch.Tensor]:
        """This rank's pieces of the param's reduced grad (views of the grad buffers)."""
        return [buffer.grad_shard(bucket)[where] for buffer, bucket, where in self._pieces[key]]

    def norm(self, key: int, ord: float, op: str) -> torch.Tensor:
        """The 2-, p-, 0- or inf-norm of the param's whole grad (fp32 or wider, 0-d)."""
        self._require_reduced(key, op)
        ord = float(ord)
        if math.isnan(ord) or ord < 0:
            raise ShardedGradError(f"{op} of param {self.names[key]!r}'s sharded grad: ord must be >= 0")
        if ord not in self._norms:
            self._norms[ord] = self._global_norms(ord)
        return self._norms[ord][key]

    def norm_dtype(self, grad: ShardedGrad) -> torch.dtype:
        """A norm's dtype: the wider of the param's and the grad flatshard holds (a 16-bit
        param's norm is its fp32 grad's, not that rounded to 16 bits)."""
        return torch.promote_types(grad.dtype, self._held[grad._key])

    def _global_norms(self, ord: float) -> dict[int, torch.Tensor]:
        """Every param's norm, from one all-reduce of the partial norms per world (an expert
        param's over its world and the expert-parallel group) and one over tp."""
        by_world: dict[int, tuple[World, bool, list[nn.Parameter]]] = {}
        for p in self._params:
            world, sharded = self._world[id(p)]
            by_world.setdefault(id(world), (world, sharded, []))[2].append(p)
        op = "max" if math.isinf(ord) else "sum"
        sums: dict[int, torch.Tensor] = {}
        for world, sharded, params in by_world.values():
            partial = torch.stack([_partial(self.pieces(id(p)), ord, p) for p in params])
            experts = self._experts if self._experts is not None and world is self._experts.world else None
            _reduce_partials(partial, world, sharded, experts, op, self._stats)
            sums.update(zip((id(p) for p in params), partial.unbind(), strict=True))
        tp = self._tensor_parallel
        if tp is not None and tp.world.size > 1:  # (the same params, in order, on every tp rank)
            self._over_tp(sums, tp, op)
        if math.isinf(ord) or ord in (0.0, 1.0):
            return sums
        return {key: total.pow(1.0 / ord) for key, total in sums.items()}

    def _over_tp(self, sums: dict[int, torch.Tensor], tp: TensorParallel, op: str) -> None:
        """The partial norms of the params tp splits summed over tp; those of the others
        checked alike on every tp rank (a sum: their total and its square ride along)."""
        split = [key for key in sums if self.names[key] in tp.split]
        rest = [sums[key] for key in sums if self.names[key] not in tp.split]
        total = torch.stack(rest).sum() if rest and op == "sum" else None
        parts = [sums[key] for key in split]
        if not parts and total is None:
            return
        device = (parts or rest)[0].device
        joined = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
        if total is not None:
            joined = torch.cat([joined, torch.stack([total, total.square()])])
        _reduce(joined, tp.world, op, self._stats)
        if total is not None:
            check_alike_over_tp(joined[-2], joined[-1], tp)
        sums.update(zip(split, joined[: len(split)].unbind(), strict=True))

    def write(self, key: int, op: str, apply: Callable[[torch.Tensor], Any]) -> None:
        """``apply`` to each of this rank's pieces of the param's grad."""
        if op not in ("zero_", "_foreach_zero_"):  # (zeros are zeros, reduced or not)
            self._require_reduced(key, op)
        for piece in self.pieces(key):
            apply(piece)
        self._norms.clear()
        self._changed()

    def refusal(self, key: int, func: object) -> ShardedGradError:
        op = getattr(func, "__name__", str(func))
        where = (
            "holds the reduced grad of this param as shards across ranks (each rank has only its part)"
            if self._world[key][1]
            else "holds this 16-bit param's grad in fp32 as param.main_grad"
        )
        return ShardedGradError(
            f"param {self.names.get(key, '?')!r}'s .grad was used by {op} at stage {self.stage}: flatshard "
            f"{where}, so this operation has no answer on one rank. Norms, clipping (torch.nn.utils."
            "clip_grad_norm_, clip_grad_value_), scaling and zero_ work on .grad; to step, use "
            "flatshard.DistributedOptimizer; to read the full grad, use "
            "`with model.summon_full_params(with_grads=True):`"
        )


def _reduce_partials(
    partial: torch.Tensor,
    world: World,
    sharded: bool,
    experts: ExpertSpread | None,
    op: str,
    stats: CommStats,
) -> None:
    """One world's partial norms made whole in place: summed (or maxed) over the world where
    its grads are sharded; expert params' also over the expert-parallel group, or over the
    main world whose copies of ``world`` each hold whole grads at stage 0."""
    if experts is not None and experts.in_main:
        if experts.over.size > 1:
            _reduce(partial, experts.over, op, stats)
        if not sharded and op == "sum":
            partial /= world.size
        return
    if sharded and world.size > 1:
        _reduce(partial, world, op, stats)
    if experts is not None and experts.over.size > 1:
        _reduce(partial, experts.over, op, stats)


def _reduce(partial: torch.Tensor, world: World, op: str, stats: CommStats) -> None:
    """Partial norms summed over ``world``, or maxed (an inf-norm: NaN where any rank's is,
    as DDP's norm of the whole grad is)."""
    if op == "max":
        all_reduce_max(partial, world, stats=stats)
    else:
        all_reduce(partial, world, stats=stats, op=op).wait()


NORM_CHUNK = 1 << 16
"""Elements per norm computed in fp32 before the fp64 sum: torch's CPU norm of one fp32
tensor accumulates in fp32, 1e-5 off at 1e6 elements and 7e-5 at 4e6 (a bucket's shard);
chunks of 2**16 keep it near 2e-7, as fast as one call."""


def norm_chunks(pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``pieces`` cut into views of at most ``NORM_CHUNK`` elements (1-D pieces; others whole)."""
    return [c for t in pieces for c in (t.split(NORM_CHUNK) if t.dim() == 1 else (t,))]


def _partial(pieces: list[torch.Tensor], ord: float, param: nn.Parameter) -> torch.Tensor:
    """This rank's share of a param's norm: sum of ``|x|**ord`` (a count for 0, the max for
    inf) over its pieces, in fp64, on the param's device (its pieces may be on the host:
    [Note: memory tiers] in ``planner/offload.py``)."""
    if not pieces:
        return torch.zeros((), dtype=torch.float64, device=param.device)
    wide = torch.promote_types(pieces[0].dtype, torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(t, ord, dtype=wide) for t in norm_chunks(pieces)]).double()
    if math.isinf(ord):
        return norms.max().to(param.device)
    return (norms.sum() if ord in (0.0, 1.0) else norms.pow(ord).sum()).to(param.device)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


# -- the operations a ShardedGrad answers ([Note: grads seen by torch]) -------------------------
def _norm(views: GradViews, args, kwargs):
    grad, ord = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is not None:
        raise views.refusal(grad._key, "linalg_vector_norm over a dim")
    return views.norm(grad._key, ord, "a norm").to(kwargs.get("dtype") or views.norm_dtype(grad))


def _foreach_norm(views: GradViews, args, kwargs):
    grads, ord = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype")
    for g in grads:
        if not isinstance(g, ShardedGrad):
            raise views.refusal(grads[0]._key, "_foreach_norm over sharded and plain grads together")
    return [views.norm(g._key, ord, "a norm").to(dtype or views.norm_dtype(g)) for g in grads]


def _scalar(value) -> torch.Tensor | float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or isinstance(value, ShardedGrad):
            raise TypeError("a sharded grad is scaled by a number or a one-element tensor")
        return value.reshape(())
    return value


def _near(value, piece: torch.Tensor):
    """A scalar operand where ``piece`` lives (a grad piece on the host, [Note: memory tiers]
    in ``planner/offload.py``, is scaled by a device tensor's value)."""
    return value.to(piece.device) if isinstance(value, torch.Tensor) else value


def _inplace(method: str, op: str):
    def handler(views: GradViews, args, kwargs):
        grad, rest = args[0], [_scalar(a) if a is not None else None for a in args[1:]]
        extra = {k: _scalar(v) if v is not None else None for k, v in kwargs.items()}

        def apply(piece: torch.Tensor) -> None:
            near = {k: _near(v, piece) for k, v in extra.items()}
            getattr(piece, method)(*(_near(a, piece) for a in rest), **near)

        views.write(grad._key, op, apply)
        return grad

    return handler


def _foreach_inplace(method: str, op: str):
    def handler(views: GradViews, args, kwargs):
        grads, values = args[0], args[1] if len(args) > 1 else None
        each = list(values) if isinstance(values, (list, tuple)) else [values] * len(grads)
        for grad, value in zip(grads, each, strict=True):
            if not isinstance(grad, ShardedGrad):
                raise views.refusal(grads[0]._key, f"{op} over sharded and plain grads together")
            rest: tuple = () if value is None else (_scalar(value),)
            views.write(grad._key, op, partial(_call, method, rest))

    return handler


def _call(method: str, rest: tuple, piece: torch.Tensor) -> None:
    getattr(piece, method)(*(_near(a, piece) for a in rest))


def _accumulate(views: GradViews, args, kwargs):
    """``grad += new``: autograd accumulating into a ``ShardedGrad`` during backward."""
    grad, new = args[0], args[1]
    inside_backward = torch._C._current_graph_task_id() != -1
    if not inside_backward or isinstance(new, ShardedGrad) or kwargs.get("alpha", 1) != 1:
        raise views.refusal(grad._key, "add_")
    grad._pending = new if grad._pending is None else grad._pending + new
    return grad


def _same(views: GradViews, args, kwargs):
    return args[0]


_HANDLERS: dict[Any, Callable[[GradViews, tuple, dict], Any]] = {
    torch.ops.aten.linalg_vector_norm.default: _norm,
    torch.ops.aten._foreach_norm.Scalar: _foreach_norm,
    torch.ops.aten.mul_.Tensor: _inplace("mul_", "mul_"),
    torch.ops.aten.mul_.Scalar: _inplace("mul_", "mul_"),
    torch.ops.aten.div_.Tensor: _inplace("div_", "div_"),
    torch.ops.aten.div_.Scalar: _inplace("div_", "div_"),
    torch.ops.aten.clamp_.default: _inplace("clamp_", "clamp_"),
    torch.ops.aten.clamp_.Tensor: _inplace("clamp_", "clamp_"),
    torch.ops.aten.clamp_min_.default: _inplace("clamp_min_", "clamp_min_"),
    torch.ops.aten.clamp_max_.default: _inplace("clamp_max_", "clamp_max_"),
    torch.ops.aten.zero_.default: _inplace("zero_", "zero_"),
    torch.ops.aten._foreach_mul_.Scalar: _foreach_inplace("mul_", "_foreach_mul_"),
    torch.ops.aten._foreach_mul_.Tensor: _foreach_inplace("mul_", "_foreach_mul_"),
    torch.ops.aten._foreach_mul_.ScalarList: _foreach_inplace("mul_", "_foreach_mul_"),
    torch.ops.aten._foreach_clamp_min_.Scalar: _foreach_inplace("clamp_min_", "_foreach_clamp_min_"),
    torch.ops.aten._foreach_clamp_max_.Scalar: _foreach_inplace("clamp_max_", "_foreach_clamp_max_"),
    torch.ops.aten._foreach_zero_.default: _foreach_inplace("zero_", "_foreach_zero_"),
    torch.ops.aten.add_.Tensor: _accumulate,
    torch.ops.aten.detach.default: _same,
    torch.ops.aten.detach_.default: _same,
}
