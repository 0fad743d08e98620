"""The mixin every module returned by ``flatshard.shard`` gains (its class is swapped, as in
FSDP2, so the user's ``forward``, parameter names and state-dict keys stay as they were)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from flatshard.comm.collectives import CommStats
from flatshard.comm.deadline import DEFAULT_TIMEOUT, HERE, Phase
from flatshard.comm.world import World, resolve_world
from flatshard.engine.buffer import BufferSet, FlatBuffer
from flatshard.engine.dynamo import uncompiled
from flatshard.engine.grad_sync import GradSync
from flatshard.engine.param_gather import ParamGather
from flatshard.engine.tensor_parallel import full_value
from flatshard.engine.wrapper_tensors import copy_to
from flatshard.planner.layout import Layout
from flatshard.planner.offload import Offload, host_homed
from flatshard.planner.stage import StagePolicy
from flatshard.units.full_params import (
    full_state_dict,
    load_full_state_dict,
    replicate_rank,
    summon,
    summon_grads,
)
from flatshard.units.unshard import Unsharder
from flatshard.wrap.changes import WrappedTree
from flatshard.wrap.pipeline import Pipeline
from flatshard.wrap.record import cast, check_dtype, main_values


class AttachedOptimizer(Protocol):
    """What a wrapped module asks of the optimizer built over it (``DistributedOptimizer``):
    the module never imports the optimizer; the optimizer attaches itself."""

    def main_params_changed(self) -> None:
        """Params were written outside a step (a load, a writeback): refresh what is derived
        from them."""

    @property
    def group_of(self) -> Mapping[str, int]:
        """Optimized param name -> its param group."""

    def main_frame(self, buffer: FlatBuffer) -> torch.Tensor | None:
        """The fp32 main params of ``buffer``'s shard frame, if it keeps them."""

    def load_main_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Main params from full-precision values by param name (a ``load_state_dict``)."""


@dataclass
class ShardState:
    """Everything flatshard attaches to a wrapped module."""

    policy: StagePolicy  # what the stage keeps sharded ([Note: stage policy])
    sets: dict[str, BufferSet]  # "main", and "expert" when shard(expert=Experts(...)) is given
    grad_sync: GradSync
    stats: CommStats
    param_gather: ParamGather | None = None  # stages 1 and 2
    optimizer: AttachedOptimizer | None = None  # the DistributedOptimizer built over this module
    originals: dict[str, torch.Tensor] | None = None  # fp32 values before a MixedPrecision cast
    unsharder: Unsharder | None = None  # stage 3
    frozen: BufferSet | None = None  # stage 3: the frozen params' shards ([Note: frozen params])
    tree: WrappedTree | None = None  # what was wrapped ([Note: writes through the params])
    pipeline: Pipeline | None = None  # the pipeline this is a chunk of ([Note: pipeline chunks])
    offload: Offload | None = None  # host homes ([Note: memory tiers] in planner/offload.py)
    unit_modules: tuple[tuple[str, ...], ...] = ()  # stage 3: each unit's modules' names, by index
    # the bytes offload_states moved to the host ([Note: states between phases] in flatshard/phases.py)
    parked: Any = None
    # what an Offload(device_budget=...) is decided from ([Note: device budget] in planner/budget.py)
    budget_specs: Any = None
    _materialized: int = 0  # depth of param_dtype_shards() blocks
    _decoded_shards: list = field(default_factory=list)  # (shard, its fp8 values) in such a block
    _warned_fp8: bool = False  # state_dict() said once that fp8-gathered params hold fp8 values
    # while set, settle_gathers does nothing: the root's forward (it waits for the gathers
    # bucket by bucket) or zero_grad (it reads no value) is running
    settle_paused: bool = False
    # while set, forwards are outside the data-parallel rule for buffers: a host that runs
    # them without its DDP (the HF Trainer's evaluation) neither sends nor arms the broadcast
    buffers_as_unwrapped: bool = False

    @property
    def stage(self) -> int:
        return self.policy.stage

    def home_frozen_shards(self, offload: Offload | None, ids: frozenset[str] | None) -> None:
        """Stage 3: the frozen params' shards of the units ``offload`` homes on the host (all
        of them, or those of ``ids``) move there; a LoRA base then costs the device only its
        units in flight ([Note: memory tiers] in ``planner/offload.py``)."""
        if self.frozen is None:
            return
        for buffer in self.frozen.buffers:
            if host_homed(offload, buffer.layout.unit, ids) and not buffer.params_on_host:
                assert offload is not None  # (homed)
                buffer.home_params_on_host(offload.pin_memory and buffer.device.type == "cuda")

    @property
    def timeout(self) -> timedelta | None:
        """The deadline of this module's collectives ([Note: deadlines] in ``comm/deadline.py``)."""
        return next((bset.world.timeout for bset in self.param_sets()), None)

    @property
    def device(self) -> torch.device:
        """Where this model's flat buffers live (one device: ``check_devices`` in
        ``wrap/arguments.py``)."""
        return next(b.device for bset in self.param_sets() for b in bset.buffers)

    def param_sets(self) -> list[BufferSet]:
        """Every buffer set holding params: the trainable ones (``sets``), then the frozen
        one at stage 3 (no grads, no optimizer)."""
        return [*self.sets.values(), *([self.frozen] if self.frozen is not None else [])]

    def attach(self, optimizer: AttachedOptimizer) -> None:
        """Record the optimizer built over this module (one per module)."""
        if self.optimizer is not None:
            raise ValueError("this module already has a DistributedOptimizer; build one per sharded module")
        self.optimizer = optimizer
        self.grad_sync.attach_optimizer()

    def take_originals(self) -> dict[str, torch.Tensor]:
        """The pre-cast fp32 values (once: they are dropped after)."""
        originals, self.originals = self.originals or {}, None
        return originals

    @contextmanager
    def param_dtype_shards(self, loading: bool = False) -> Iterator[None]:
        """Stage-3 16-bit shards that exist inside the block, for code that reads or writes
        them; what was written reaches the main params on exit ([Note: main-backed shards]
        in ``engine/buffer.py``). At stages 1-2, the shards of weights gathered in fp8 hold
        their main params rounded inside it, and their fp8 values after (recast from what was
        written, ``loading``: [Note: fp8 gathers after the step]). Blocks nest."""
        buffers = [b for bset in self.sets.values() for b in bset.buffers if b.main_backed]
        gather = self.param_gather
        if self._materialized == 0:
            for buffer in buffers:
                buffer.materialize_shard()
            if gather is not None and self.optimizer is not None and not loading:
                self._decoded_shards = gather.exact_shards(self.optimizer.main_frame)
        self._materialized += 1
        try:
            yield
        finally:
            self._materialized -= 1
            if self._materialized == 0:
                written = [buffer.release_shard() for buffer in buffers]
                if any(written) and self.optimizer is not None:
                    self.optimizer.main_params_changed()
                kept, self._decoded_shards = self._decoded_shards, []
                if gather is not None and loading:
                    gather.recast(gather.fp8_values())
                else:
                    for shard, decoded in kept:
                        shard.copy_(decoded)

    def check_resident(self, what: str) -> None:
        """Refuse ``what`` while ``offload_states`` holds the model's bytes on the host."""
        if self.parked is not None:
            raise RuntimeError(
                f"{what} while the model's states are offloaded (flatshard.offload_states): call "
                "flatshard.reload_states(model) first ([Note: states between phases] in flatshard/phases.py)"
            )

    def check_resident_hook(self, module: nn.Module, args: tuple) -> None:
        self.check_resident("a forward ran")

    def wait_for_params(self) -> None:
        """Wait for every param all-gather still in flight after a step; at stage 3, free
        every unit (so a step never leaves a stale full copy); at stages 0-2, params written
        by torch since the last look reach the main params ([Note: writes through the params])."""
        self.check_resident("the params were read (a state dict, a checkpoint, summon_full_params)")
        if self.param_gather is not None:
            self.param_gather.wait_all()
        if self.unsharder is not None:
            self.unsharder.settle()
        if self.tree is not None:
            self.tree.absorb_writes()

    def mark_stepped(self, without: Collection[str]) -> None:
        """The params a step changed (all but ``without``) are marked changed in place, as
        torch's optimizers' in-place updates mark them: a backward through a graph recorded
        before the step raises as torch's does, instead of pairing the new values with
        activations of the old (the step writes flat buffers, which autograd does not see).
        The marks are flatshard's own writes, not the user's ([Note: writes through the
        params])."""
        named = [(n, p) for bset in self.sets.values() for n, p in zip(bset.names, bset.params, strict=True)]
        skipped = set(without)  # (usually none: every param, one call; the frozen set never steps)
        stepped = [p for n, p in named if n not in skipped] if skipped else [p for _, p in named]
        if stepped:
            torch.autograd.graph.increment_version(stepped)
        if self.tree is not None:
            self.tree.forget_writes()

    def take_dropped_grads(self, module: nn.Module, args: tuple) -> None:
        """Before the root's forward: a ``zero_grad`` that bypassed flatshard's is taken as
        one ([Note: params without a grad] in ``optim/held.py``)."""
        self.grad_sync.check_dropped()

    def forward_began(self, module: nn.Module, args: tuple) -> None:
        self.settle_paused = True
        HERE.forward()  # (counted: a desync names ranks that ran different numbers of micro-batches)

    def forward_ended(self, module: nn.Module, args: tuple, output: object) -> None:
        self.settle_paused = False

    def settle_gathers(self) -> None:
        """The gathers' part of ``wait_for_params``, for reads of the model by any path (walks,
        attributes): wait for the param all-gathers a step left running (stages 1-2), so a
        param read is the stepped one. Paused inside the root's forward and ``zero_grad``."""
        if not self.settle_paused and self.param_gather is not None and self.param_gather.pending:
            self.param_gather.wait_all()

    def take_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Values written into params other than by a step (by name) reach what the next step
        starts from: the optimizer's main params, or, before one is built, the fp32 values
        it will take them from (``originals``)."""
        if self.optimizer is not None:
            self.optimizer.load_main_values(values)
        elif self.originals:
            for name, value in values.items():
                if name in self.originals:
                    self.originals[name].copy_(value)
        if self.param_gather is not None:  # ([Note: fp8 gathers after the step])
            self.param_gather.recast(values.keys())

    def fp8_values(self) -> set[str]:
        """The params that hold their fp8 values decoded between steps (stages 1-2 with
        ``MixedPrecision(fp8_gathers=True)``)."""
        return set() if self.param_gather is None else self.param_gather.fp8_values()


class ShardedModule(nn.Module):
    """Methods added to a module by ``flatshard.shard``."""

    _flatshard: ShardState

    @property
    def flatshard_state(self) -> ShardState:
        return self._flatshard

    @property
    def layouts(self) -> dict[str, Layout]:
        """The layout of each world's buffers ("main", and "expert" if any)."""
        return {key: bset.layout for key, bset in self._flatshard.sets.items()}

    @property
    def comm_stats(self) -> CommStats:
        """Collectives issued for this module and the bytes they moved (resettable)."""
        return self._flatshard.stats

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward passes reduce grads (False: accumulate locally)."""
        self._flatshard.grad_sync.sync_enabled = bool(requires_gradient_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads of the backward passes inside the block without communicating."""
        sync = self._flatshard.grad_sync
        previous = sync.sync_enabled
        sync.sync_enabled = False
        try:
            yield
        finally:
            sync.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Wait for grad reductions; only needed if a backward was interrupted by hand.

        Backward already waits for them in its end-of-backward callback.
        """
        self._flatshard.grad_sync.finish()

    def wait_for_params(self) -> None:
        """Wait for the param all-gathers a sharded step left running (stages 1 and 2).

        The forward waits for them bucket by bucket; ``parameters()``, ``named_parameters()``,
        ``modules()``, ``children()``, ``apply``, the root's attributes, ``state_dict`` and
        ``load_state_dict`` call it. Call it before reading a param through a reference (a
        tensor, a submodule) kept from before the step.
        """
        self._flatshard.wait_for_params()

    def state_dict(self, *args, **kwargs):
        """The plain state dict; at stage 3 only inside ``summon_full_params`` (copies of the
        full params, as the model computes with them), else an error."""
        state = self._flatshard
        if state.policy.shards_params and not state.unsharder.summoned:
            raise RuntimeError(
                "at stage 3 each rank holds only shards of the params: use model.full_state_dict() "
                "(every rank calls it; rank 0 gets a CPU state dict) or call state_dict() inside "
                "summon_full_params()"
            )
        if not state.policy.shards_params:
            state.wait_for_params()
            if state.fp8_values() and not state._warned_fp8:
                state._warned_fp8 = True
                warnings.warn(
                    "state_dict(): the params gathered in fp8 after each step "
                    "(MixedPrecision(fp8_gathers=True)) hold their fp8 values; model.full_state_dict() "
                    "and flatshard's checkpoints give the exact ones, from the fp32 main params "
                    "([Note: fp8 gathers after the step])",
                    stacklevel=2,
                )
            return super().state_dict(*args, **kwargs)
        out = super().state_dict(*args, **kwargs)
        if not kwargs.get("keep_vars", False):  # (copies: summon_full_params frees the gathered
            for k, v in out.items():  # values on exit, and a view read after it would crash the kernel)
                if isinstance(v, torch.Tensor):
                    out[k] = v.clone()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (at stage 3 every rank passes it and keeps its shards). An
        optimizer that keeps fp32 main params of 16-bit params takes them from the state
        dict's values at their own precision (no ``reload_model_params()`` needed)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the flat buffers' views")
        state = self._flatshard
        if state.policy.shards_params:  # (the main params hold the shards: loaded in place)
            plain = partial(nn.Module.state_dict, self)
            load = partial(nn.Module.load_state_dict, self)
            missing, unexpected, loaded = load_full_state_dict(state, state_dict, strict, plain, load)
            if state.optimizer is None:  # (the optimizer to come takes the pre-cast values)
                state.take_values(loaded)
            return _IncompatibleKeys(missing, unexpected)
        # (its load hooks wait for gathers, and hand the values to the main params: LoadHooks)
        return super().load_state_dict(state_dict, strict=strict)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A plain state dict on rank 0 (CPU tensors; other ranks get ``{}``), gathered one
        unit at a time at stage 3; every rank must call it. Params the optimizer keeps fp32
        main params for are those, not their 16-bit rounding ([Note: values of record] in
        ``wrap/record.py``); ``dtype`` casts every floating-point entry."""
        state = self._flatshard
        check_dtype(dtype)  # (on every rank, before any gather)
        if "expert" in state.sets:
            raise NotImplementedError(
                "full_state_dict of a model with experts: each rank holds only its own experts. "
                "save_checkpoint stores them whole (with shard(expert=Experts(..., ep=...))), and "
                "flatshard.export_checkpoint writes the full model from that checkpoint"
            )
        state.wait_for_params()
        rank0 = state.param_sets()[0].world.rank == 0 and replicate_rank(state) == 0
        with HERE.during(Phase.GATHER):
            covered, main = main_values(list(state.sets.values()), state.optimizer, keep=rank0)
            if state.policy.shards_params:
                out = full_state_dict(state, partial(nn.Module.state_dict, self), skip=covered)
            else:
                out = {  # (a tp shard is gathered full by every tp rank: [Note: tensor-parallel params])
                    k: copy_to(full_value(v, v.detach()), "cpu") for k, v in super().state_dict().items()
                }
        if not rank0:
            return {}
        params = nn.Module.state_dict(self, keep_vars=True)
        return cast({k: main.get(id(params[k]), v) for k, v in out.items()}, dtype)

    @contextmanager
    def summon_full_params(
        self, writeback: bool = True, rank0_only: bool = False, with_grads: bool = False
    ) -> Iterator[None]:
        """Full params inside the block ([Note: full params] in ``units/full_params.py``); every rank
        must enter it. Below stage 3 params are always full: this waits for their gathers and,
        ``with_grads``, gathers the reduced grads into ``param.grad``. At stage 3 the full
        params' memory is freed on exit: ``clone()`` what outlives the block (a view read after
        it reads freed memory); ``state_dict()`` inside gives copies."""
        if not self._flatshard.policy.shards_params:
            self._flatshard.wait_for_params()
            grads = self._flatshard.grad_sync.grads
            with summon_grads(self._flatshard.param_sets(), grads) if with_grads else nullcontext():
                yield
            return
        with (
            HERE.during(Phase.GATHER),
            summon(
                self._flatshard,
                writeback=writeback,
                rank0_only=rank0_only,
                with_grads=with_grads,
                grads=self._flatshard.grad_sync.grads,
            ),
        ):
            yield

    def named_parameters(self, *args, **kwargs):
        """torch's, once the param all-gathers a step left running are done (stages 1-2): code
        that reads or writes the params between a step and the next forward (an EMA,
        ``parameters_to_vector``, a logged norm, an in-place write) sees the stepped values, not
        a buffer that a gather is still writing ([Note: writes through the params])."""
        self._flatshard.settle_gathers()
        return super().named_parameters(*args, **kwargs)

    def named_modules(self, *args, **kwargs):
        """torch's (``modules()``, ``apply``, ``get_submodule`` walk it), after the gathers a
        step left running, as ``named_parameters``: a param reached through a module is the
        stepped one."""
        self._flatshard.settle_gathers()
        return super().named_modules(*args, **kwargs)

    def named_children(self, *args, **kwargs):
        """torch's (``children()``, ``apply`` walk it), after the gathers, as ``named_modules``."""
        self._flatshard.settle_gathers()
        return super().named_children(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """torch's (the root's submodules, params and buffers: ``model.layer.weight``), after
        the gathers a step left running, outside the forward (which waits bucket by bucket)."""
        value = super().__getattr__(name)
        state = self.__dict__.get("_flatshard")
        if state is not None:
            state.settle_gathers()
        return value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, without waiting for the param all-gathers (grads only)."""
        self._flatshard.check_resident("zero_grad was called")
        state, paused = self._flatshard, self._flatshard.settle_paused
        state.settle_paused = True
        try:
            self._zero_grads(set_to_none)
        finally:
            state.settle_paused = paused
        state.grad_sync.zero_grad(set_to_none=set_to_none)

    def _zero_grads(self, set_to_none: bool) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # (a placeholder's .grad: no dispatch)
            for _, p in nn.Module.named_parameters(self):
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def _apply(self, fn, recurse: bool = True):
        """``to()``, ``cuda()``, ``half()``, ... after ``shard()``: a move or cast that leaves every
        param where it is (the device and dtype it has) converts the buffers only; one that
        would move or cast a param is refused, naming it (its values live in flat buffers
        laid out for one device and dtype)."""
        moved = _moved_param(self, fn)
        if moved is not None:
            name, p, out = moved
            raise RuntimeError(
                f"{type(self).__name__}._apply (to, cuda, half, ...) after flatshard.shard() would turn "
                f"param {name!r} from {p.device}, {p.dtype} into {out.device}, {out.dtype}: its values "
                "live in flat buffers laid out at wrap time for one device and dtype. Move or cast the "
                "model before shard(); for bf16 compute with fp32 main params pass "
                "shard(..., mixed_precision=flatshard.MixedPrecision(torch.bfloat16))"
            )
        for module in self.modules() if recurse else [self]:
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = fn(buf)
        return self

    def __deepcopy__(self, memo):
        raise TypeError(
            f"copy.deepcopy of a {type(self).__name__} that flatshard.shard() wrapped: its params are "
            "views of flat buffers bound to its process groups. For an EMA or reference copy, "
            "deepcopy the model before shard() (and shard the copy too, or keep it whole), or load "
            "model.full_state_dict() into a new model"
        )

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"torch.save or pickle of a {type(self).__name__} that flatshard.shard() wrapped: its params "
            "are views of flat buffers bound to its process groups (and its class is made at wrap "
            "time). Save torch.save(model.full_state_dict(), path) (every rank calls it; rank 0 gets "
            "the values), or flatshard.save_checkpoint(path, model, optimizer), which loads at any "
            "world size and stage"
        )

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """Read by ``DistributedDataParallel`` as it wraps a module: a DDP around a sharded
        model would all-reduce grads flatshard already reduces, and hand torch's utilities
        its own: refused where it is built."""
        raise RuntimeError(
            f"DistributedDataParallel around a {type(self).__name__} that flatshard.shard() wrapped: "
            "flatshard already makes it data-parallel (stage 0 is DDP). Use the sharded model "
            "itself; under a host library use its flatshard integration instead of its DDP "
            "(flatshard.hosts.hf.Trainer; for accelerate, import flatshard.hosts.accelerate before "
            "accelerator.prepare; Lightning's strategy='flatshard')"
        )


def _moved_param(module: nn.Module, fn) -> tuple[str, nn.Parameter, torch.Tensor] | None:
    """The first param ``fn`` would move or cast (probed on an empty tensor of each param's
    device and dtype), with what it would become; None when ``fn`` leaves every param as it is."""
    seen: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    with torch._C.DisableTorchFunctionSubclass():  # (stage-3 placeholders: metadata only)
        for name, p in module.named_parameters():
            key = (p.dtype, p.device)
            if key not in seen:
                seen[key] = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            out = seen[key]
            if out.dtype != p.dtype or out.device != p.device:
                return name, p, out
    return None


class SyncedGenerate:
    """Mixed in with ``ShardedModule`` where the module has a ``generate`` method
    (``transformers`` and peft models): at stage 3 on several ranks, ``synced_gpus=True``
    unless given ([Note: forward entry points] in ``units/unshard.py``)."""

    _flatshard: ShardState

    def generate(self, *args, **kwargs):
        if self._flatshard.policy.shards_params and "synced_gpus" not in kwargs:
            kwargs["synced_gpus"] = any(s.world.size > 1 for s in self._flatshard.param_sets())
        return super().generate(*args, **kwargs)  # type: ignore[misc]


_CLASS_CACHE: dict[type, type] = {}


def job_world(model: nn.Module | None) -> World:
    """Every rank of the job (the default process group), for collectives outside a step
    (checkpoints, ``even_batches``), with the deadline of ``model``'s collectives; the
    default deadline for a model flatshard did not wrap, or none."""
    state = None if model is None else getattr(uncompiled(model), "flatshard_state", None)
    return resolve_world(None, DEFAULT_TIMEOUT if state is None else state.timeout)


def make_sharded(module: nn.Module, state: ShardState) -> ShardedModule:
    """Swap ``module``'s class for a subclass that mixes in ``ShardedModule``."""
    cls = module.__class__
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        # the user's class name, as code that records it expects (Hugging Face's save_pretrained
        # writes it into config.json's "architectures"); isinstance(m, ShardedModule) tells them apart
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        generates = callable(getattr(cls, "generate", None))
        mixins = (ShardedModule, SyncedGenerate) if generates else (ShardedModule,)
        new_cls = type(cls.__name__, (*mixins, cls), names)
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls
    setattr(module, "_flatshard", state)  # noqa: B010 (nn.Module.__setattr__'s stub types values as tensors or modules)
    _SHARDED.add(module)
    return module  # type: ignore[return-value]


_SHARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every module shard() returned


def sharded_root(module: nn.Module) -> tuple[ShardedModule, str] | None:
    """The sharded module that holds ``module`` as a submodule (a LightningModule sharded
    whole holds its ``transformers`` model), and ``module``'s name in it; None if none does."""
    for root in list(_SHARDED):
        for name, sub in root.named_modules():
            if sub is module and name:
                return root, name  # type: ignore[return-value]
    return None
