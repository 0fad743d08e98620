"""Stage 3: gathering each unit's params just before it runs and freeing them after.

The reasoning is in the notes below ([Note: unsharding], ...)."""

# [Note: unsharding]
#
# Between uses a rank holds only its shard of every bucket (``FlatBuffer.param_shard_data``,
# or the optimizer's fp32 main params, [Note: main-backed shards] in ``engine/buffer.py``);
# each param's ``.data`` is a placeholder. A unit ([Note: units]) is *sharded*, *gathering*
# (its buckets' all-gathers are in flight) or *full* (its params are views into full buckets):
#
# * **forward**: the unit's forward pre-hook makes it full, then *prefetches* the next
#   ``forward_prefetch`` units. The forward hook frees it again (a merged unit, [Note:
#   merged units], once each of its modules has run; if one did not, at the end of the
#   forward) unless ``reshard_after_forward=False``, or it is *kept*: the root or the last unit (backward
#   needs both at once), and with ``backward_prefetch="pre"`` the unit before the last, which
#   that prefetch would gather again as soon as backward reaches the last unit (so keeping it
#   saves a gather and never raises the peak: forward had as many units full just before);
#   its outputs get a hook that fires when backward reaches them.
# * **backward**: that hook makes the unit full again and (``backward_prefetch="pre"``)
#   prefetches the unit backward reaches next. Once every param of the unit has its grad
#   (the grad buckets then reduce-scatter it, see [Note: sharded grads]) the unit is freed
#   (``"post"`` prefetches at this point instead); a unit holding frozen params waits for its
#   inputs' grads too ([Note: frozen params] in ``units/build.py``). At the end of backward
#   every unit is freed.
# * **bounded memory**: prefetches start only while fewer than ``limit`` gathers are in
#   flight; a unit's full buckets exist only from its gather to its release, and their storage
#   is resized to zero on release. Saved activations that reference a param's storage see
#   it refilled with the same values before backward uses them.
# * **no grad**: a forward under ``torch.no_grad`` frees every unit after it, the root too.
# * **activation checkpointing**: a forward that autograd recomputes during backward only
#   makes sure its unit is full; the unit's backward follows and frees it as usual.
#
# **The gather schedule.** Gathers are collectives: every rank must issue the same ones in
# the same order, even when ranks take different control flow. So they are issued in a
# fixed *schedule* on a process group of their own (``side_world``: the grad reductions'
# order, which depends on when grads arrive, cannot interleave with them). The forward
# schedule is the order in which the first forward ran the units (registration order until
# then, and kept only if every rank recorded the same one); the backward schedule is its
# reverse without the kept units. A hook that needs a unit issues every entry up
# to it; prefetching issues entries ahead. At the end of a forward a rank issues the entries
# it never reached (units it skipped) and frees them as they land; a backward does the same
# for units that did not run since the last backward. So a rank that skips a block or exits
# early issues exactly the gathers the others do, and the result equals DDP's (tested with
# ranks skipping different blocks). A unit that runs a second time after it was freed is
# gathered again outside the schedule: ranks must agree on such repeats.
#
# [Note: forward entry points]
#
# A forward need not begin at the root. ``generate()`` on a peft model calls the wrapped
# ``transformers`` model's forward, not the ``PeftModel``'s; code that wants hidden states calls
# ``model.model(...)``; code that builds ``inputs_embeds`` calls the embedding alone. Each reads
# the root unit's params (embeddings, final norm, head), which only the root's pre-hook would
# gather: a forward that began below it computed on NaN placeholders, and ``generate()`` returned
# token 0 on every rank. So the root's hooks sit on every module of the root's own that holds
# params in its subtree (``units.unit_tree.entry_points``; for our GPT the root, its embeddings,
# its final norm and head). The first of them whose forward begins while no forward is under
# way is the forward's *entry*: its pre-hook does what the root's does (gather the root unit,
# prefetch), and its forward hook ends the forward (free what is done, issue what was skipped,
# hook backward). Inside that forward the others do nothing. Invariants:
#
# * every forward that reads a root-unit param has its root unit full, whichever module it
#   began at, and ends with the same collectives as one that began at the root;
# * a forward that raised leaves its entry set; the entry's next forward starts afresh, and
#   ``settle()`` (after every backward and step) clears it;
# * ``generate()`` must run the same number of forwards on every rank (each gathers): a
#   sharded module with a ``generate`` method passes ``synced_gpus=True`` to it at stage 3 on
#   more than one rank, unless the caller says otherwise (``wrap/module.py``), so ranks that
#   finish early keep running forwards until all have, as ``transformers`` does by itself for
#   DeepSpeed ZeRO-3 and FSDP (it marks FSDP modules with an attribute that also changes how
#   Dynamo traces them, so flatshard does not set it).
#
# Under a whole-model ``torch.compile`` each entry point's hooks are two more graph breaks
# (per-block compile puts none inside a block).
#
# [Note: two process groups]
#
# A stage-3 backward issues collectives on two groups, each in an order every rank shares:
# gathers in the backward schedule, grad reductions in bucket-group order, each launched once
# its grads are complete. Their interleaving is the same on every rank only when the ranks'
# backwards are alike. A rank whose unit (or one param of it) got no grad completes that
# reduction only at the end of its backward, after issuing every gather; a rank that
# blocked on that reduction before issuing its own remaining gathers would wait forever, and
# so would the first rank, on those gathers. So grad sync blocks on a reduction during a
# backward (to bound grad scratch, ``engine.grad_sync``) only where no cycle can form:
#
# * this rank has issued every gather of its backward schedule: a rank blocked on a gather
#   then waits for ranks that are not blocked on a reduction, so the gathers all land;
# * or every rank's forwards since the last backward ran the same units (compared by an
#   all-reduce of a digest, issued at the end of each forward on the gather group, at the
#   same place in its order on every rank, so waiting for it is safe) and
#   ``find_unused_parameters`` is False, which as in DDP promises that every param of a unit
#   that ran gets a grad on every rank. Then every rank's backward issues the same
#   collectives in the same order, and each waits only for what the others issue before.
#   A user can break that promise, so this wait happens on the host with a deadline (where
#   gloo runs the collective, on CPU or CUDA tensors, it blocks on it; on NCCL, where a
#   stream wait alone would only move the cycle into the streams, it polls) and gives up
#   after ``BLOCK_TIMEOUT_S`` with a warning (the grads stay right, as below).
#
# Elsewhere a reduction that has completed is finished, and one that has not is left until
# the end of the backward, whose callback issues the remaining gathers before it waits: the
# scratch bound is given up for that backward. Tested with ranks skipping different blocks
# and different params of one block (with ``find_unused_parameters`` True and False). On
# CUDA both groups' collectives run on their process groups' own NCCL streams, ordered
# against the compute stream by events (at issue and at ``wait()``); since torch 2.8
# ProcessGroupNCCL keeps an async collective's tensors alive until ``wait()`` instead of
# recording streams, and a full bucket or grad scratch is freed or reused only after that
# wait (tested on gloo: ``tests/comm/test_collective_lifetimes.py``), so the caching allocator
# reuses the memory in stream order and does not grow. None of this is verified on a GPU.
#
# [Note: stage-3 memory]
#
# Memory at the peak (tested on a 4-block GPT at 2 ranks): 16Ψ/N of shards during backward and
# step (bf16 + AdamW: fp32 main params 4, fp32 grad shards 4, AdamW 8, as FSDP2 keeps; ZeRO-3
# as the paper describes it keeps a 16-bit shard next to the fp32 one, 2Ψ/N more), 12Ψ/N from
# ``zero_grad()`` through the next forward (the grad shards' storage is freed, as FSDP2 drops
# its sharded grads; stage 2 too), plus at most two of the largest unit in full (params and
# grads: the one running and the one prefetched or reducing; merged units hold at most
# ``unit_bytes`` of params unless one module's unit alone is larger) plus the root unit's
# params, which stay full for the whole step. A meta-device model is initialized unit by unit
# ([Note: meta init] in ``units/build.py``) and never holds more than one unit in full.

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from flatshard.comm.collectives import CommStats, Handle, all_reduce
from flatshard.comm.deadline import HERE
from flatshard.comm.trace import span
from flatshard.comm.world import World
from flatshard.engine.dynamo import eager, eager_pre_hook, whole_outside_graphs
from flatshard.engine.lifecycle import Gather, advance
from flatshard.errors import ShardedParamError
from flatshard.planner.stage import Stage3
from flatshard.units.entries import agree_on_entry
from flatshard.units.parts import Part, start_gather
from flatshard.units.placeholder import label
from flatshard.units.unit_tree import Unit, entry_points


class Unsharder:
    """The state machine of [Note: unsharding] over every unit of one module."""

    def __init__(
        self,
        units: list[Unit],
        parts: list[list[Part]],
        stats: CommStats,
        options: Stage3 | None = None,
    ) -> None:
        options = options or Stage3()
        self.units = units
        self.parts = parts
        self.stats = stats
        self.options = options
        self.state = [Gather.SHARDED] * len(units)
        self._handles: dict[int, list[Handle]] = {}
        self._packed: dict[int, list[tuple[Part, torch.Tensor]]] = {}  # fp8 bytes in flight, by unit
        scales = (p.scales for ps in parts for p in ps if p.scales is not None)
        self._fp8 = list({id(s): s for s in scales}.values())  # (one a buffer set)
        self._recording: list[int] | None = []  # units in the order the first forward runs them
        self._ran: set[int] = set()  # units whose forward ran since the last backward
        self._ran_now: set[int] = set()  # units whose forward ran in the current forward
        self._same_units: list[tuple[torch.Tensor, Handle]] = []  # the last forward's check of _ran
        self._ranks_agree: bool | None = None  # their outcome, once waited for in this backward
        self._fwd = self._bwd = _Schedule([])
        self._set_schedule([unit.index for unit, ps in zip(units, parts, strict=True) if ps])
        self._params = [
            {id(p.params[s.index]) for p in ps if p.buffer.has_grads for s in p.bucket.params} for ps in parts
        ]
        self._waiting: list[set[int]] = [set(s) for s in self._params]  # params without grad yet
        # [Note: frozen params] in units/build.py: a unit holding frozen params is freed in
        # backward only once the grads of its forward's inputs are computed too
        self._holds_frozen = [any(not p.buffer.has_grads for p in ps) for ps in parts]
        # ... and one that encloses other units (the root) not before the end of backward
        self._kept_in_backward = [
            frozen and any(other.parent == unit.index for other in units)
            for unit, frozen in zip(units, self._holds_frozen, strict=True)
        ]
        self._inputs_pending = [0] * len(units)  # forwards whose inputs' grads are still to come
        self._in_backward = False
        self.summoned = False
        self.full_bytes = 0  # bytes of full buckets alive now
        self.peak_full_bytes = 0  # the most ever alive at once
        self._hooks = []
        self._members_done: list[set[int]] = [set() for _ in units]  # modules whose forward ran
        self._entry: nn.Module | None = None  # the module whose forward began the current one
        for unit, unit_parts in zip(units, parts, strict=True):
            if unit_parts and unit.index != 0:
                held = {id(p.params[s.index]) for p in unit_parts for s in p.bucket.params}
                for member, module in enumerate(unit.modules):
                    pre = eager_pre_hook(self._pre_forward_hook(unit.index))
                    self._hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                    # (a member holding none of the unit's params, an activation in a merged
                    # unit, needs no gather for its backward: its output's grad would gather the
                    # unit again after the members that hold them freed it, on the ranks that
                    # ran them all only: [Note: merged units])
                    uses = any(id(q) in held for q in module.parameters())
                    post = eager(self._post_forward_hook(unit.index, member, backward=uses))
                    self._hooks.append(module.register_forward_hook(post))
                    whole_outside_graphs(module)
        # the root's hooks (which also end each forward) on every module a forward may begin at
        for module in entry_points(units):
            pre = eager_pre_hook(self._entry_pre_hook(self._pre_forward_hook(0)))
            self._hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(eager(self._entry_post_hook())))
            whole_outside_graphs(module)
        # grad sync tells each param's grad (grad_ready): no hook of its own per param
        self._unit_of_param = {key: u for u, keys in enumerate(self._params) for key in keys}
        for unit, unit_parts in zip(units, parts, strict=True):  # what a refused read names
            for part in unit_parts:
                for slot in part.bucket.params:
                    where = f"param {slot.name!r} of unit {unit.index} ({unit.name or 'the root'})"
                    label(part.params[slot.index], where)

    # -- the three states ----------------------------------------------------------------------
    def unshard(self, u: int, *, exact: bool = False) -> None:
        """Start gathering unit ``u`` (nothing if it is gathering or full); ``exact``: in the
        param dtype, for a reader of values (for compute, fp8 weights are gathered in fp8:
        see [Note: fp8 gathers])."""
        if self.state[u] is not Gather.SHARDED:
            return
        handles = []
        with torch.no_grad(), span("gather unit {} ({})", u, self.units[u].name or "root"):
            for part in self.parts[u]:
                full = self.allocate(part)
                fp8 = part.scales is not None and not exact
                if part.scales is not None and fp8 and part.scales.scales is None:
                    self._refresh_scales()  # (a gather outside the forward schedule, before any)
                handle, packed = start_gather(part, full, self.stats, fp8=fp8)
                handles.append(handle)
                if packed is not None:
                    self._packed.setdefault(u, []).append((part, packed))
                    self._count_full(packed.numel())
        self._handles[u] = handles
        self.state[u] = advance(self.state[u], Gather.GATHERING, "a unit")

    def _refresh_scales(self) -> None:
        """Every fp8 weight's scale from the values of record (one all-reduce a world)."""
        for scales in self._fp8:
            scales.refresh(lambda buffer, bucket: buffer.gather_source(bucket), self.stats)

    def _drop_packed(self, u: int, *, decode: bool) -> None:
        """Free unit ``u``'s fp8 bytes, first decoding them into its full buckets."""
        for part, packed in self._packed.pop(u, []):
            if decode:
                assert part.scales is not None
                part.scales.decode(part.buffer, part.bucket, packed, part.full_tensor())
            self._count_full(-packed.numel())

    def wait(self, u: int, *, exact: bool = False) -> None:
        """Make unit ``u`` full: wait for its gathers and point its params at them
        (``exact`` as in ``unshard``)."""
        self.unshard(u, exact=exact)
        if self.state[u] is not Gather.GATHERING:
            return
        with span("wait unit {} ({})", u, self.units[u].name or "root"):
            for handle in self._handles.pop(u):
                handle.wait()
            with torch.no_grad():
                self._drop_packed(u, decode=True)
        for part in self.parts[u]:
            part.point(full=True)
        self.state[u] = advance(self.state[u], Gather.FULL, "a unit")

    def reshard(self, u: int) -> None:
        """Free unit ``u``'s full buckets; its params become placeholders again."""
        self._members_done[u].clear()
        if self.state[u] is Gather.SHARDED:
            return
        if self.state[u] is Gather.GATHERING:
            for handle in self._handles.pop(u):
                handle.wait()
            self._drop_packed(u, decode=False)
        for part in self.parts[u]:
            part.point(full=False)
            self.free(part)
        self.state[u] = advance(self.state[u], Gather.SHARDED, "a unit")

    def allocate(self, part: Part) -> torch.Tensor:
        """The part's full bucket with its storage allocated (counted in ``full_bytes``)."""
        full = part.allocate()
        self._count_full(full.numel() * full.element_size())
        return full

    def _count_full(self, nbytes: int) -> None:
        self.full_bytes += nbytes
        self.peak_full_bytes = max(self.peak_full_bytes, self.full_bytes)

    def free(self, part: Part) -> None:
        full = part.full_tensor()
        self.full_bytes -= full.numel() * full.element_size()
        part.free()

    def settle(self) -> None:
        """Free every unit (before a step writes shards, and after each backward)."""
        if self.summoned:
            raise RuntimeError("params are summoned (summon_full_params): leave the block first")
        for u in range(len(self.units)):
            self.reshard(u)
        self._fwd.restart()  # the next forward issues its gathers from the start
        self._entry = None  # (and begins wherever it begins: [Note: forward entry points])

    def prefetch_first(self) -> None:
        """Start gathering the units the next forward runs first (the root and the next
        ``forward_prefetch``), so they overlap whatever runs between a step and the next
        forward."""
        if self._fwd.pos == 0:
            self._advance(self._fwd, self.options.forward_prefetch)

    @property
    def in_flight(self) -> int:
        return sum(1 for s in self.state if s is Gather.GATHERING)

    # -- the gather schedules ----------------------------------------------------------------
    def _advance(self, schedule: _Schedule, pos: int) -> None:
        """Issue the schedule's gathers up to entry ``pos`` (in order, each once); in backward
        a unit that did not run since the last backward is freed as soon as it lands."""
        while schedule.pos <= min(pos, len(schedule.units) - 1):
            if schedule is self._fwd and schedule.pos == 0 and self._fp8:  # (a new forward's first gather)
                self._refresh_scales()
            v = schedule.units[schedule.pos]
            schedule.pos += 1
            self.unshard(v)
            if schedule is self._bwd and v not in self._ran:
                self.reshard(v)

    def _need(self, schedule: _Schedule, u: int) -> None:
        """Make ``u`` full, issuing the schedule up to its entry (or, for a second call of
        a unit already freed again, one gather outside it)."""
        pos = schedule.index.get(u)
        schedule.needed = max(
            schedule.needed, schedule.lead.get(u, -len(schedule.lead) - 1) if pos is None else pos
        )
        if self.state[u] is Gather.SHARDED and pos is not None and pos >= schedule.pos:
            self._advance(schedule, pos)
        self.wait(u)

    def _prefetch(self, schedule: _Schedule, count: int) -> None:
        """Issue entries up to ``count`` past the last one needed while fewer than ``limit``
        gathers fly; in backward only as far as units that ran (others are issued when
        reached)."""
        while (
            schedule.pos <= schedule.needed + count
            and schedule.pos < len(schedule.units)
            and self.in_flight < self.options.limit_all_gathers
        ):
            if schedule is self._bwd and schedule.units[schedule.pos] not in self._ran:
                return
            self._advance(schedule, schedule.pos)

    def _end_forward(self) -> None:
        """Issue what this rank's forward skipped (so every rank issues the same gathers)
        and free the units gathered for nothing; fix the schedule after the first forward."""
        self._advance(self._fwd, len(self._fwd.units))
        for v in self._fwd.units:  # (a merged unit some of whose modules did not run, too)
            if v not in self._ran_now or (self._members_done[v] and self._frees_after_forward(v)):
                self.reshard(v)
        self._fwd.restart()
        self._ran_now = set()
        if self._recording is not None:
            recorded, self._recording = self._recording, None
            self._set_schedule(self._agreed(recorded))
        if torch.is_grad_enabled():  # (a backward may follow)
            _all_equal(self._same_units)  # the previous forward's, which this one's covers
            self._same_units = self._compare_across_ranks(sorted(self._ran))

    def _set_schedule(self, order: list[int]) -> None:
        """Forward gathers follow ``order``; backward ones its reverse, without the kept
        units (they stay full from their forward into their backward)."""
        order = order + [u for u in self._fwd.units if u not in order]
        self._fwd = _Schedule(order)
        self._kept = {0, *order[-2 if self.options.backward_prefetch == "pre" else -1 :]}
        backward = [u for u in reversed(order) if u != 0]  # (the kept ones first)
        self._bwd = _Schedule(
            [u for u in backward if u not in self._kept] if self.options.reshard_after_forward else [],
            first=[u for u in backward if u in self._kept],
        )

    def _agreed(self, recorded: list[int]) -> list[int]:
        """``recorded`` if every rank recorded the same order, else the registration order."""
        return recorded if _all_equal(self._compare_across_ranks(recorded)) else list(self._fwd.units)

    @property
    def gather_worlds(self) -> list[World]:
        """The worlds this model's units are gathered over (one each)."""
        return list({id(p.world): p.world for ps in self.parts for p in ps}.values())

    def agree(self, what: str, detail: object = None) -> None:
        """Every rank is about to ``what`` ([Note: gather entries] in ``units/entries.py``)."""
        agree_on_entry(self.gather_worlds, what, detail)

    def _compare_across_ranks(self, value: list[int]) -> list[tuple[torch.Tensor, Handle]]:
        """Start comparing ``value`` across the ranks of every gather world: an all-reduce
        (max) of its digest and minus its digest, on the gather group, so it takes the same
        place in its order on every rank."""
        digest = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little")
        checks = []
        for world in self.gather_worlds:
            if world.size > 1:
                both = torch.tensor([digest, -digest], device=world.control_device)
                checks.append((both, all_reduce(both, world, op="max")))
        return checks

    # -- waiting across the two process groups ([Note: two process groups]) -------------------
    def backward_issued(self) -> bool:
        """Whether this backward has issued every gather of its schedule."""
        return self._bwd.pos >= len(self._bwd.units)

    def ranks_ran_the_same_units(self) -> bool:
        """Whether every rank's forwards since the last backward ran the same units (waits for
        the comparison each forward started; every rank started it before its backward)."""
        if self._ranks_agree is None:
            checks, self._same_units = self._same_units, []
            self._ranks_agree = _all_equal(checks)
        return self._ranks_agree

    def issue_backward(self) -> None:
        """Issue what is left of this backward's gathers (before waiting on reductions)."""
        if self._in_backward:
            self._advance(self._bwd, len(self._bwd.units))

    # -- hooks ---------------------------------------------------------------------------------
    def _pre_forward_hook(self, u: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if _in_backward():  # activation checkpointing recomputes the unit's forward
                self.wait(u)
                return
            HERE.forward()
            if self._holds_frozen[u] and torch.is_grad_enabled():
                self._watch_inputs(u, (args, kwargs))
            if self._recording is not None and u not in self._recording:
                self._recording.append(u)
            self._ran.add(u)
            self._ran_now.add(u)
            self._need(self._fwd, u)
            self._prefetch(self._fwd, self.options.forward_prefetch)

        return hook

    def _entry_pre_hook(self, root_pre):
        """The root unit's pre-hook, run by the first module of the root's own whose forward
        begins a forward ([Note: forward entry points]); inside that forward, nothing."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if _in_backward():
                self.wait(0)
            elif self._entry is None or self._entry is module:  # (the latter: a forward that raised)
                if self._entry is None:  # (a rank that freed what a step prefetched differs)
                    started = [u for u, s in enumerate(self.state) if s is not Gather.SHARDED]
                    self.agree(f"run a forward with units {started} gathered or in flight")
                self._entry = module
                root_pre(module, args, kwargs)

        return hook

    def _entry_post_hook(self):
        root_post = self._post_forward_hook(0, 0)

        def hook(module: nn.Module, args: object, output: object) -> None:
            if module is self._entry and not _in_backward():
                self._entry = None
                root_post(module, args, output)

        return hook

    def _frees_after_forward(self, u: int) -> bool:
        """Whether ``u`` is freed once its forward is done (not kept full for backward)."""
        return not torch.is_grad_enabled() or (self.options.reshard_after_forward and u not in self._kept)

    def _post_forward_hook(self, u: int, member: int, backward: bool = True):
        """After a member of ``u`` ran: free ``u`` once all ran (if it is freed after forward);
        ``backward``: gather ``u`` again before the backward of its output."""

        def hook(module: nn.Module, args: object, output: object) -> None:
            if _in_backward():  # a recomputation: its backward follows at once
                return
            if self.summoned:
                return
            if self._frees_after_forward(u):  # once each of its modules ran ([Note: merged units])
                done = self._members_done[u]
                done.add(member)
                if len(done) == len(self.units[u].modules):
                    self.reshard(u)
            if u == 0:
                self._end_forward()
            if not backward:
                return
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if len(tensors) == 1 and torch.is_grad_enabled():  # (the usual block; a cheaper hook)
                tensors[0].register_hook(lambda grad: self._pre_backward(u))
            elif tensors and torch.is_grad_enabled():
                register_multi_grad_hook(tensors, lambda grads: self._pre_backward(u), mode="any")

        return hook

    def _pre_backward(self, u: int) -> None:
        if torch.is_grad_enabled():  # (autograd records the backward: create_graph=True)
            raise _second_derivative(self.units[u])
        if not self._in_backward:
            self.agree("run a backward")
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._need(self._bwd, u)
        if self.options.backward_prefetch == "pre":
            self._prefetch(self._bwd, 1)

    def grad_ready(self, param: nn.Parameter) -> None:
        """Called by grad sync for each param's accumulated grad ([Note: unsharding])."""
        u = self._unit_of_param[id(param)]
        self._waiting[u].discard(id(param))
        self._release_after_backward(u)

    def _watch_inputs(self, u: int, inputs: object) -> None:
        """Count this forward of ``u`` until the grads of its inputs are computed (its frozen
        params serve those grads: [Note: frozen params] in ``units/build.py``)."""
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._inputs_pending[u] += 1
            register_multi_grad_hook(tensors, lambda grads: self._inputs_done(u), mode="all")

    def _inputs_done(self, u: int) -> None:
        self._inputs_pending[u] -= 1
        self._release_after_backward(u)

    def _release_after_backward(self, u: int) -> None:
        """Free ``u`` once backward is done with it: every param of it has its grad and every
        forward's inputs theirs."""
        if self._waiting[u] or self._inputs_pending[u] > 0 or self.summoned or self._kept_in_backward[u]:
            return
        self.reshard(u)
        if self.options.backward_prefetch == "post":
            self._prefetch(self._bwd, 1)

    def _end_backward(self) -> None:
        self.issue_backward()
        self._in_backward = False
        self._waiting = [set(s) for s in self._params]
        self._inputs_pending = [0] * len(self.units)
        self._bwd.restart()
        self._ran = set()
        self.ranks_ran_the_same_units()  # (waits for the check if nobody has)
        self._ranks_agree = None
        if not self.summoned:
            self.settle()


@dataclass
class _Schedule:
    """A fixed order of gathers and how far this pass has issued it. ``first`` are units the
    pass reaches before its first entry but never gathers (kept full): entries -len(first)
    to -1, so that needing them prefetches only as far as needing an entry there would."""

    units: list[int]
    first: list[int] = field(default_factory=list)
    pos: int = 0  # entries before this one are issued
    needed: int = -1  # the furthest entry a hook has needed in this pass

    def __post_init__(self) -> None:
        self.index = {u: i for i, u in enumerate(self.units)}
        self.lead = {u: i - len(self.first) for i, u in enumerate(self.first)}
        self.restart()

    def restart(self) -> None:
        self.pos, self.needed = 0, -len(self.first) - 1


def _all_equal(checks: list[tuple[torch.Tensor, Handle]]) -> bool:
    """Wait for digest comparisons; True if every rank had the same value in each."""
    agree = True
    for both, handle in checks:
        handle.wait()
        agree = agree and int(both[0]) == -int(both[1])  # the largest and (minus) the smallest
    return agree


def _second_derivative(unit: Unit) -> ShardedParamError:
    return ShardedParamError(
        f"a backward with create_graph=True reached unit {unit.name or '(root)'!r} at stage 3 (a gradient "
        "penalty, a double backward): the graph it records reads the unit's full params, which are "
        "freed as soon as the unit's grads are reduced, so a second backward would read freed "
        "storage. Use stage 2 (params stay replicated on every rank), or a penalty without second derivatives"
    )


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (e.g. recomputing a
    checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1
