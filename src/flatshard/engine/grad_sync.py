"""Gradient synchronization: accumulate grads into flat buffers and reduce them in buckets.

The reasoning is in the notes below ([Note: grad sync], ...)."""

# [Note: grad sync]
#
# * A post-accumulate-grad hook on every trainable param moves the new grad into
#   ``param.main_grad`` and marks the param ready in its reduction.
# * Reductions are launched strictly in one fixed order (the order backward is expected
#   to complete them: the reduction holding the last-registered param first). A complete reduction
#   launches once every reduction before it has and the other reductions of its launch (the
#   same ``per_launch`` buckets, of other buffers: ``build_reductions``) are complete too;
#   so every rank issues the same collectives in
#   the same order even when control flow differs, and a mismatch can never pair two
#   different tensors in one collective.
# * At the first hook of a backward an end-of-backward callback is queued with autograd's
#   engine. It launches the reductions still waiting (their unused params contribute zeros),
#   waits for every collective, and resets per-backward state. So when ``backward()``
#   returns, grads are reduced: nothing can read them early.
# * Under ``no_sync`` nothing is launched; grads keep accumulating in ``main_grad``.
# * A grad that arrives after its reduction started is an error naming the param,
#   never a silently dropped grad.
# * A param with a post-accumulate-grad hook of the user's (registered after ours) keeps its
#   local grad in ``.grad`` (the running sum, under accumulation) through those hooks, as
#   under DDP; its grad is taken at the next hook of ours or at the end of backward.
#
# Two kinds of buffers:
#
# * *exposed* (the param dtype equals the grad dtype, e.g. fp32 at stage 0): ``param.grad`` is
#   ``param.main_grad`` itself between steps, so torch optimizers work unchanged. A grad of
#   None means "zero" exactly as in torch: the next backward overwrites ``main_grad`` instead
#   of adding to it, so ``optimizer.zero_grad()`` needs no help from us.
# * *hidden* (16-bit params with fp32 grads, and every param at stages 1 and 2):
#   ``param.grad`` is dropped after each accumulation; ``main_grad`` holds the sum since the
#   last ``zero_grad`` of the module or the flatshard optimizer.
#
# At stages 1-3 grads are scaled as they arrive and kept as shards between backwards
# ([Note: sharded grads] in ``engine/reduction.py``). At stage 2 at most ``MAX_SCRATCH_IN_FLIGHT``
# launched reductions hold scratch (at stage 3, where a unit's full params are alive too, one),
# besides the reduction accumulating: before a reduction is launched, the oldest are
# finished (waited for; at stage 3 only where that cannot deadlock with the param gathers,
# [Note: two process groups] in ``units/unshard.py``), and the next reduction reuses their scratch.

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from flatshard.comm.collectives import CommStats
from flatshard.comm.deadline import HERE, Phase
from flatshard.engine.buffer import BufferSet, FlatBuffer, FlatParam
from flatshard.engine.grad_usage import GradUsage
from flatshard.engine.grad_view import ExpertSpread, GradViews, Piece, ShardedGrad
from flatshard.engine.lifecycle import Backward, Grads, advance
from flatshard.engine.reduction import Reduction, ScratchPool, wait_for_host_grads
from flatshard.engine.tensor_parallel import TensorParallel, local_grad
from flatshard.errors import ShardedGradError
from flatshard.planner.layout import BucketLayout
from flatshard.planner.stage import StagePolicy


class WeakHook:
    """A param hook that calls ``method`` without keeping its object alive. Autograd holds a
    param's hooks on the C++ side, which Python's collector cannot see into, so a hook bound
    to the object that owns the param (param -> hook -> GradSync -> buffers -> param) would
    keep the model, its optimizer and their device memory alive after the user drops them.
    (It runs once per param per backward: it holds the plain function and a weak reference,
    so a call makes no bound method.)"""

    __slots__ = ("function", "owner")

    def __init__(self, method) -> None:
        self.function, self.owner = method.__func__, weakref.ref(method.__self__)

    def __call__(self, *args):
        owner = self.owner()
        return None if owner is None else self.function(owner, *args)


MAX_SCRATCH_IN_FLIGHT = 2
"""Stage 2: launched reductions whose scratch may be alive at once."""
STAGE3_SCRATCH_IN_FLIGHT = 1
"""The same at stage 3 (as FSDP, one reduce-scatter in flight while the next unit's grads
accumulate)."""
BLOCK_TIMEOUT_S = 10.0
"""Stage 3: the longest a backward waits for a reduction before giving up the scratch bound
for the rest of that backward ([Note: two process groups])."""


class BackwardGathers(Protocol):
    """What grad sync needs of stage 3's ``Unsharder`` ([Note: two process groups])."""

    def backward_issued(self) -> bool: ...

    def ranks_ran_the_same_units(self) -> bool: ...

    def issue_backward(self) -> None: ...

    def grad_ready(self, param: nn.Parameter) -> None:
        """``param``'s grad of this backward is accumulated (called once grad sync took it)."""


def build_reductions(
    sets: Sequence[BufferSet],
    buckets_per_launch: int | None,
    stats: CommStats,
    reduce_dtype: torch.dtype | None = None,
) -> list[Reduction]:
    """Reductions of every buffer, in launch order (see [Note: grad sync]).

    Each set's buckets, of all its buffers (dtypes), are taken in the order backward is
    expected to complete them and cut into *launches* of ``buckets_per_launch`` (None:
    all of them). A launch's buckets of one buffer are consecutive there and form one
    ``Reduction``; the reductions of a launch follow each other in the launch order, share its
    ``launch`` number, and start together once all of them are complete (Megatron's bucket
    groups across dtypes)."""
    launches: list[tuple[int, int, BufferSet, list[tuple[FlatBuffer, list[BucketLayout]]]]] = []
    for bset in sets:
        ordered = sorted(
            ((buffer, bucket) for buffer in bset.buffers for bucket in buffer.layout.buckets),
            key=lambda pair: -max(slot.index for slot in pair[1].params),
        )
        step = len(ordered) if buckets_per_launch is None else buckets_per_launch
        for i in range(0, len(ordered), step):
            chunk = ordered[i : i + step]
            by_buffer: dict[int, tuple[FlatBuffer, list[BucketLayout]]] = {}
            for buffer, bucket in chunk:
                by_buffer.setdefault(buffer.layout.index, (buffer, []))[1].append(bucket)
            key = max(slot.index for _, bucket in chunk for slot in bucket.params)
            launches.append((-key, len(launches), bset, list(by_buffer.values())))
    launches.sort(key=lambda item: item[:2])
    pool = ScratchPool(MAX_SCRATCH_IN_FLIGHT + 1)
    reductions: list[Reduction] = []
    for launch, (_, _, bset, parts) in enumerate(launches):
        for buffer, buckets in parts:
            slots = [slot for bucket in buckets for slot in bucket.params]
            params, names = [bset.params[s.index] for s in slots], [s.name for s in slots]
            reductions.append(
                Reduction(
                    len(reductions), buffer, buckets, params, names, bset.world, bset.scale, stats, pool,
                    bset.replicate, reduce_dtype, launch=launch,
                )
            )  # fmt: skip
    return reductions


class GradSync:
    """The state machine of [Note: grad sync] for one wrapped module."""

    def __init__(
        self,
        sets: Sequence[BufferSet],
        reductions: Sequence[Reduction],
        *,
        policy: StagePolicy,
        find_unused_parameters: bool,
        stats: CommStats,
        gathers: BackwardGathers | None = None,
        tensor_parallel: TensorParallel | None = None,
        experts: ExpertSpread | None = None,
    ) -> None:
        """``gathers``: at stage 3, the unsharder whose param gathers backward issues (one
        hook per param serves both); ``tensor_parallel``: the tp dimension of a model with
        DTensor params, whose grads are all hidden ([Note: tensor-parallel params]). Until
        ``attach_optimizer``, a synced backward ends a step ([Note: deadlines]) and, where
        ``policy`` shards the optimizer, raises: its grads would exist only as shards no torch
        optimizer sees."""
        self.sets = list(sets)
        self.policy = policy
        self.scratch_in_flight = STAGE3_SCRATCH_IN_FLIGHT if policy.gathers_units else MAX_SCRATCH_IN_FLIGHT
        self.reductions = list(reductions)
        self.find_unused_parameters = find_unused_parameters
        self.tensor_parallel = tensor_parallel
        self.experts = experts  # (expert params' grads are always hidden: their norms span ep)
        self.stats = stats
        self.sync_enabled = True
        self.grads = Grads.EMPTY  # since the last zero_grad ([Note: lifecycles])
        self.backward = Backward.IDLE
        self.generation = 0  # counts backwards that changed grads
        self.optimizer_attached = False
        self.gathers = gathers
        self._reduction_of: dict[int, Reduction] = {}
        self._exposed: set[int] = set()
        self._name: dict[int, str] = {}
        for reduction in self.reductions:
            layout = reduction.buffer.layout
            exposed = (
                layout.dtype == layout.grad_dtype
                and not reduction.sharded
                and tensor_parallel is None
                and (experts is None or reduction.world is not experts.world)
            )
            for name, p in zip(reduction.names, reduction.params, strict=True):
                self._reduction_of[id(p)] = reduction
                self._name[id(p)] = name
                if exposed:
                    self._exposed.add(id(p))
        self._written: set[int] = set()  # hidden params whose main_grad holds a sum
        self.usage = GradUsage()
        self._fired: list[FlatParam] = []  # exposed params whose grad returns after sync
        self._deferred: FlatParam | None = None  # its grad is taken after the user's hooks
        self._pool = self.reductions[0].pool if self.reductions else ScratchPool(0)
        self._next = 0  # first reduction not yet launched in this backward
        self._done = 0  # reductions before this one have finished their reduction
        self.views = self._hidden_views()
        hook = WeakHook(self._on_grad)
        for bset in sets:
            for p in bset.params:
                p.register_post_accumulate_grad_hook(hook)

    def _hidden_views(self) -> GradViews:
        """The ``ShardedGrad`` of every param whose ``.grad`` is not ``main_grad`` itself, with
        the pieces of its reduced grad this rank holds ([Note: grads seen by torch])."""
        hidden, exposed = [], []
        pieces: dict[int, list[Piece]] = {}
        for reduction in self.reductions:
            named = list(zip(reduction.names, reduction.params, strict=True))
            exposed += [(n, p) for n, p in named if id(p) in self._exposed]
            by_name = {n: p for n, p in named if id(p) not in self._exposed}
            for name, p in by_name.items():
                hidden.append(
                    (name, p, reduction.world, reduction.sharded, reduction.buffer.layout.grad_dtype)
                )
                pieces[id(p)] = []
            buffer = reduction.buffer
            for bucket in reduction.buckets:
                for piece in bucket.local_ranges(buffer.rank):
                    if piece.name in by_name:
                        where: Piece = (buffer, bucket, slice(*piece.in_shard))
                        pieces[id(by_name[piece.name])].append(where)
        return GradViews(
            hidden,
            pieces,
            stats=self.stats,
            reduced=lambda: self.grads is not Grads.UNREDUCED,
            changed=self._grads_written,
            stage=self.policy.stage,
            gathers_units=self.policy.gathers_units,
            exposed=exposed,
            tensor_parallel=self.tensor_parallel,
            experts=self.experts,
        )

    def _grads_written(self) -> None:
        self.generation += 1  # (what was derived from the grads, the optimizer's norm, is stale)

    def attach_optimizer(self) -> None:
        """A flatshard optimizer now steps this module: its steps are the steps."""
        self.optimizer_attached = True

    # -- lifecycles ([Note: lifecycles]) -----------------------------------------------------
    def _move(self, new: Backward) -> None:
        self.backward = advance(self.backward, new, "backward")

    def _set_grads(self, new: Grads) -> None:
        self.grads = advance(self.grads, new, "grads")

    # -- hooks -------------------------------------------------------------------------
    def on_backward_start(self) -> None:
        """Queue the end-of-backward callback once per backward (called from autograd)."""
        if self.backward is Backward.IDLE:
            self._move(Backward.RUNNING)
            self.views.forget()
            HERE.enter(Phase.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _on_grad(self, param: nn.Parameter) -> None:
        self.on_backward_start()
        self._take_deferred()
        hooks = param._post_accumulate_grad_hooks  # (ours first: registered at shard time)
        if hooks is not None and len(hooks) > 1:
            self._show_local(param)
            self._deferred = param  # (the user's hooks run next, on the local grad, as under DDP)
            return
        self._take(param)

    def _show_local(self, param: FlatParam) -> None:
        """Before the user's hooks: ``.grad`` is this rank's running sum since the last
        reduction, as under DDP, where autograd added this backward's grad to the ``ShardedGrad``
        of an earlier one (accumulation); ``_take`` then takes it whole. (After a reduction has
        folded earlier sums into shards, they see this backward's grad alone.)"""
        grad = param.grad
        if not isinstance(grad, ShardedGrad) or self.tensor_parallel is not None:
            return
        pending, key = grad.take_pending(), id(param)
        if pending is not None and key in self._written:  # (main_grad holds the sum)
            reduction = self._reduction_of[key]
            pending.add_(param.main_grad, alpha=1 / reduction.scale if reduction.sharded else 1.0)
            self._written.discard(key)  # (what comes back is the whole sum)
        param.grad = pending

    def _take_deferred(self) -> None:
        """Take the grad whose param's hooks of the user's have run since (autograd runs a
        param's hooks one after another, before any other node)."""
        if self._deferred is not None:
            param, self._deferred = self._deferred, None
            if param.grad is not None:  # (a hook may drop it: then no grad arrived, as under DDP)
                self._take(param)

    def _take(self, param: nn.Parameter) -> None:
        """Move ``param``'s new grad into its flat buffer and mark it ready."""
        grad = param.grad
        if isinstance(grad, ShardedGrad):  # (no zero_grad since the last backward: autograd added to it)
            grad = grad.take_pending()
        assert grad is not None  # (the hook runs once autograd has accumulated a grad)
        grad = local_grad(param, grad)  # (a DTensor's: [Note: tensor-parallel params])
        key = id(param)
        reduction = self._reduction_of[key]
        if reduction.launched:
            raise RuntimeError(
                f"param {self._name[key]!r} got a gradient after its reduction had "
                "started in this backward (is it used again after its grad was final, e.g. by "
                "reentrant activation checkpointing?)"
            )
        if not self.sync_enabled:
            self._set_grads(Grads.UNREDUCED)
        reduction.begin()
        if reduction.sharded:
            self._accumulate_prescaled(param, reduction, grad)
        elif self.sync_enabled:
            self._accumulate_scaled(param, reduction, grad)
        else:
            self._accumulate(param, grad)
        self._written.add(key)
        self.usage.mark(param)
        if reduction.mark_ready(param) and self.sync_enabled:
            self._launch_ready()
        if self.gathers is not None:  # (one hook per param serves both: they cost per call)
            self.gathers.grad_ready(param)

    def _accumulate(self, param: FlatParam, grad: torch.Tensor) -> None:
        """Add the new ``grad`` into ``main_grad`` unscaled (a backward that does not sync)."""
        key = id(param)
        main_grad = param.main_grad
        if grad is main_grad:  # autograd already added in place
            return
        if key in self._exposed or key not in self._written:
            main_grad.copy_(grad)
        else:
            main_grad.add_(grad)
        param.grad = main_grad if key in self._exposed else None

    def _accumulate_scaled(self, param: FlatParam, reduction: Reduction, grad: torch.Tensor) -> None:
        """Fold the new grad into ``main_grad`` and apply the reduction's scale in the same pass.

        From a param's first grad in a syncing backward until the sync finishes,
        ``main_grad`` holds the *scaled* sum and ``param.grad`` is None, so a second grad in
        the same backward arrives fresh and is added with the scale too.
        """
        key = id(param)
        main_grad, scale = param.main_grad, reduction.scale
        if reduction.is_ready(param):  # second grad in this backward
            main_grad.add_(grad, alpha=scale)
        else:
            if grad is main_grad:  # autograd added in place onto the unscaled sum
                main_grad.mul_(scale)
            elif key in self._exposed:  # fresh sum, same dtype: one fused pass
                torch.mul(grad, scale, out=main_grad)
            elif key not in self._written:  # fresh sum of a 16-bit grad: scale in fp32
                main_grad.copy_(grad).mul_(scale)
            else:
                main_grad.add_(grad).mul_(scale)
            if key in self._exposed:
                self._fired.append(param)
        param.grad = None

    def _accumulate_prescaled(self, param: FlatParam, reduction: Reduction, grad: torch.Tensor) -> None:
        """``main_grad += scale * grad`` (stages 1 and 2, synced or not): what a shard holds is
        then always a scaled sum, ready to be reduced as it is."""
        main_grad = param.main_grad
        if id(param) in self._written:
            main_grad.add_(grad, alpha=reduction.scale)
        elif grad.dtype == main_grad.dtype:
            torch.mul(grad, reduction.scale, out=main_grad)
        else:  # a 16-bit grad: scale in fp32
            main_grad.copy_(grad).mul_(reduction.scale)
        param.grad = None

    def _bound_scratch(self) -> None:
        """Before a scratch reduction is launched, finish the oldest launched reductions
        until fewer than ``scratch_in_flight`` are left: waiting for them where that cannot
        deadlock with stage 3's param gathers, else only those reduced. (Bounding at launch,
        not when the next reduction takes its scratch, holds the same scratch at the peak but
        gives each reduction the next reduction's whole backward to finish.)"""
        while self._next - self._done >= self.scratch_in_flight:
            oldest = self.reductions[self._done]
            if not self._reduction_done(oldest):
                return
            self._finish_reduction(oldest)
            self._done += 1

    def _reduction_done(self, reduction: Reduction) -> bool:
        """Whether ``reduction``'s reduction may be finished now ([Note: two process groups]).

        * No gathers in backward, or all of this backward's issued: yes (``finish_sync`` waits).
        * Every rank ran the same units and ``find_unused_parameters`` is False (as in DDP, a
          promise that every param of them gets a grad): once it is reduced, waited for at
          most ``BLOCK_TIMEOUT_S``, since a broken promise would hang; on timeout, warn and
          stop waiting for the rest of this backward.
        * Else: only if it is reduced already.
        """
        gathers = self.gathers
        if gathers is None or gathers.backward_issued():
            return True
        unbounded = self.backward is Backward.UNBOUNDED
        if unbounded or self.find_unused_parameters or not gathers.ranks_ran_the_same_units():
            return reduction.reduced()
        if reduction.wait_reduced(BLOCK_TIMEOUT_S):
            return True
        self._move(Backward.UNBOUNDED)  # for the rest of this backward
        warnings.warn(
            f"rank {reduction.world.rank}: waited {BLOCK_TIMEOUT_S:g} s during backward for the "
            f"reduction of the grads of {', '.join(map(repr, reduction.names[:3]))}"
            f"{', ...' if len(reduction.names) > 3 else ''}; going on without the grad-scratch "
            "bound in this backward. If params of a module that ran can get no grad on some "
            "ranks, pass find_unused_parameters=True (as in DDP); else some rank is that far "
            "behind.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False

    def _finish_reduction(self, reduction: Reduction) -> None:
        reduction.finish_sync()
        if not reduction.buffer.full_grads:  # the scratch was folded into the shard and dropped
            self._written.difference_update(id(p) for p in reduction.params)

    def _launch_ready(self) -> None:
        reductions = self.reductions
        while self._next < len(reductions) and self._launch_complete(self._next):
            if not reductions[self._next].buffer.full_grads:
                self._bound_scratch()
            reductions[self._next].start_sync()
            self._next += 1

    def _launch_complete(self, first: int) -> bool:
        """Whether the reductions of ``reductions[first]``'s launch from it on are complete."""
        launch = self.reductions[first].launch
        members = itertools.takewhile(
            lambda g: g.launch == launch, itertools.islice(self.reductions, first, None)
        )
        return all(
            g.complete for g in members
        )  # (no copy of the reduction list: it runs per ready reduction)

    # -- end of backward -----------------------------------------------------------------
    def finish(self) -> None:
        """Launch what is left, wait for every reduction, reset for the next backward."""
        if self.backward is Backward.IDLE:
            return
        self._take_deferred()
        synced, unused = self.sync_enabled, set()
        try:
            if synced:
                unused = self._finish_sync()
        finally:
            for reduction in self.reductions:
                reduction.reset()
            self._fired.clear()
            self._next = self._done = 0
            self._move(Backward.IDLE)
            self.generation += 1
            self._pool.clear()  # scratch is reused within a backward, not held between them
        # (a grad where torch under DDP has one: [Note: params without a grad] in optim/held.py)
        self.views.attach(lambda p: id(p) not in unused if synced else self.usage.used_here(p))
        if synced:
            self.usage.clear()
        if self.sync_enabled and not self.optimizer_attached:
            HERE.step_done()
        else:
            HERE.enter(Phase.AFTER_BACKWARD)
        if self.sync_enabled and not self.optimizer_attached and self.policy.shards_optimizer:
            raise RuntimeError(
                f"{self.policy} shards the optimizer: its grads exist only as shards that a "
                "torch optimizer over model.parameters() never sees. Create "
                "flatshard.DistributedOptimizer(model, torch.optim.AdamW, ...) before the first backward"
            )

    def _finish_sync(self) -> set[int]:
        """Launch and finish every reduction; the params no rank used since the last synced
        backward, which keep no grad."""
        if self.gathers is not None:
            self.gathers.issue_backward()  # before waiting on any reduction
        locally_unused: list[FlatParam] = []
        for reduction in self.reductions[self._next :]:
            reduction.begin()
            for _, param in reduction.pending_params():
                if not self._holds_grad(param):
                    param.main_grad.zero_()
                    if id(param) in self._exposed:
                        locally_unused.append(param)
                elif not reduction.sharded:  # accumulated unscaled under no_sync, none this backward
                    param.main_grad.mul_(reduction.scale)
            reduction.start_sync()
        self._next = len(self.reductions)
        for param in self._fired:  # nobody reads a grad before backward returns
            param.grad = param.main_grad
        for reduction in self.reductions[self._done :]:
            reduction.replicate_shards()  # start every cross-replica reduction before waiting on any
        unused = self.usage.unused_everywhere(self.sets, self._holds_exposed)
        for reduction in self.reductions[self._done :]:
            self._finish_reduction(reduction)
        wait_for_host_grads(self.reductions)
        self._done = len(self.reductions)
        self._set_grads(Grads.REDUCED)
        for param in locally_unused:  # (another rank's grad reached it: it has one, as under DDP)
            if id(param) not in unused:
                param.grad = param.main_grad
        return unused

    def _holds_grad(self, param: FlatParam) -> bool:
        """Whether ``main_grad`` holds a real sum; adopts a grad the user assigned directly."""
        key = id(param)
        if key not in self._exposed:
            return key in self._written
        grad = param.grad
        if grad is None:
            return False
        if grad is not param.main_grad:
            param.main_grad.copy_(grad)
            param.grad = param.main_grad
        return True

    def _holds_exposed(self, param: FlatParam) -> bool:
        return id(param) in self._exposed and param.grad is not None  # (a grad set by hand too)

    def without_grads(self) -> list[str]:
        """The params whose step skips them ([Note: params without a grad] in
        ``optim/held.py``), after a zero_grad that bypassed flatshard's is taken as one."""
        missing = self.views.without_grads()
        if missing and len(missing) == self.views.count and self.grads is not Grads.EMPTY:
            self.zero_grad(set_to_none=True)  # (nn.Module.zero_grad of a wrapper: every .grad is None)
        return missing

    def check_dropped(self) -> None:
        """Before a forward: grads kept since the last backward must be kept whole. A
        ``zero_grad`` that reached flatshard's params but not flatshard (torch.compile's
        wrapper, a module holding the sharded one) set every ``.grad`` to None: it is taken as
        one; some set to None while others were kept would be added to in the next backward:
        refused, naming them."""
        if self.grads is Grads.EMPTY or self.backward is not Backward.IDLE:
            return
        self.without_grads()
        dropped = self.views.dropped_by_hand() if self.grads is not Grads.EMPTY else []
        if dropped:
            raise ShardedGradError(
                f"the .grad of {dropped[:4]}{' ...' if len(dropped) > 4 else ''} was set to None by "
                "hand while other params kept theirs, and a forward follows: flatshard holds the sums "
                "in flat buffers and would add the next backward's grads to theirs. Clear them all "
                "(model.zero_grad() or the optimizer's), or step before the next forward (the step "
                "skips a param without a grad, as torch's optimizers do)"
            )

    def pooled_scratch(self) -> list[torch.Tensor]:
        """Stage-2 scratch released in this backward and kept for reuse by later reductions."""
        return list(self._pool.free)

    # -- user-facing state -----------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated grads (the module's or the flatshard optimizer's zero_grad)."""
        self._written.clear()
        self.usage.clear()
        if set_to_none:
            self.views.unattach_all()
        self._set_grads(Grads.EMPTY if set_to_none else Grads.REDUCED)  # (zeros, as torch steps on)
        self.generation += 1
        self.views.forget()
        for reduction in self.reductions:
            reduction.zero_grad()
        if set_to_none:  # stages 2-3: no grad shards until the next backward's reductions
            for bset in self.sets:
                for buffer in bset.buffers:
                    buffer.free_grad_shards()
        else:
            for bset in self.sets:
                for buffer in bset.buffers:
                    buffer.zero_grads()
            for bset in self.sets:  # (a param without a grad keeps none, as torch's zero_grad leaves it)
                for p in bset.params:
                    if id(p) in self._exposed and p.grad is not None:
                        p.grad = p.main_grad
