"""``DistributedOptimizer``: an ordinary torch optimizer stepping this rank's shards
([Note: distributed optimizer] below)."""

# [Note: distributed optimizer]
#
# ``DistributedOptimizer(model, torch.optim.AdamW, lr=...)`` composes an *inner* torch
# optimizer over flat fp32 tensors ("runs", [Note: optimizer runs] in ``shard_map.py``) that
# cover this rank's shard of every bucket. A step is three phases, each one flat op (or one
# small collective) per bucket shard, never a loop over params (except the whole-param runs
# of a rule that needs each param whole, below):
#
# 1. **grads**: backward has already reduced them into the shards ([Note: sharded grads]);
#    their global norm is computed over the shards (each element counted once, padding is
#    zero) with one 1-element all-reduce. A non-finite norm means some rank overflowed; all
#    ranks see the same sum, so all skip the step together (and a loss scaler backs off).
#    Unscaling by the loss scale and clipping are one multiply.
# 2. **update**: the inner optimizer steps the runs. For fp32 params the runs *are* views of
#    the param buffer's shard; for 16-bit params they are views of an fp32 *main param*
#    frame, copied back into the param shard after the step (at stage 3 there is no 16-bit
#    shard: the main params are gathered, [Note: main-backed shards] in ``engine/buffer.py``).
# 3. **gather**: each bucket's params are all-gathered from the shards ([Note: param
#    gather]), overlapped with the next forward unless ``overlap_param_gather=False``.
#
# A param group may name its own class (``{"params": matrices, "optimizer_class":
# torch.optim.Muon}``); groups of several classes step through one ``GroupedOptimizer``. A
# class not known to be elementwise steps *whole-param runs* ([Note: optimizer runs]): real
# tensors of their params' shapes, which the layout must hold whole on one rank (``shard(...,
# whole_params=...)``, [Note: whole-param buckets]).
#
# ``param_groups`` and ``state`` are the inner optimizer's own objects, so LR schedulers,
# ``optimizer.param_groups[i]["lr"] = ...`` and per-group hyperparameters work unchanged.
# At stage 0 the "shard" of a bucket is the whole bucket: the same class is an unsharded
# optimizer with fp32 main params for a 16-bit model.

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from flatshard.comm.deadline import HERE, Phase
from flatshard.comm.trace import span
from flatshard.engine.buffer import FlatBuffer
from flatshard.engine.dynamo import uncompiled
from flatshard.engine.lifecycle import Grads
from flatshard.optim.agreement import SettingsCheck
from flatshard.optim.blockwise import adopt, piece_params, state_block
from flatshard.optim.composite import run_closure
from flatshard.optim.grad_prep import GradPreparation
from flatshard.optim.held import HeldBack
from flatshard.optim.host_step import budget_offload, ready_host_frames, resolve_offload
from flatshard.optim.inner import check_optimizer_class, make_inner, param_groups, steps_flat, whole_shapes
from flatshard.optim.loss_scale import StaticLossScaler, make_loss_scaler
from flatshard.optim.precision import PrecisionAwareOptimizer, resolve_precision
from flatshard.optim.rank_state import load_rank_state, rank_state
from flatshard.optim.shards import BufferShards, build_shards, check_fp8_record
from flatshard.optim.streamed_step import StreamedStep
from flatshard.planner.mixed_precision import OptimizerPrecision
from flatshard.planner.offload import host_homed, unit_ids
from flatshard.wrap.arguments import check_flags
from flatshard.wrap.module import ShardedModule, ShardState, job_world

NONFINITE = ("raise", "skip", "step")


class DistributedOptimizer(GradPreparation, torch.optim.Optimizer):
    """Step ``model`` (returned by ``flatshard.shard``) with ``optimizer_class`` over this
    rank's fp32 shards; see [Note: distributed optimizer].

    Args:
        model: the sharded module. Build the optimizer before its first backward.
        optimizer_class: a ``torch.optim`` class. An elementwise one (SGD, Adam, AdamW, ...:
            ``flatshard.optim.inner.ELEMENTWISE``) steps flat shards; any other (Muon) steps
            its params whole, which the model's layout must keep whole on one rank
            (``shard(..., whole_params=...)``; [Note: elementwise optimizers]).
        params: param groups over the model's own params, as for any torch optimizer
            (e.g. ``[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]``);
            None: every trainable param in one group. A param in no group is not updated.
            A group's ``"optimizer_class"`` entry steps it with that class instead (e.g.
            Muon for the matrices, AdamW for the rest); ``defaults`` reach each class that
            takes them.
        overlap_param_gather: wait for each bucket's all-gather in the forward pre-hook of
            the modules that use it (True) or at the end of ``step`` (False). At stage 3,
            True starts gathering the root and first unit for the next forward at the end
            of ``step``; False leaves every unit sharded between steps.
        loss_scale: None, a number (static) or ``"dynamic"`` (or a scaler from
            ``flatshard.optim.loss_scale``): scale the loss with ``scale_loss`` before backward.
        nonfinite: what a step does when grads hold inf or NaN on any rank, without a loss
            scaler: ``"raise"`` a ``NonFiniteGradError`` naming the params, before anything
            changes (the default: outside fp16 overflow, a non-finite grad is a bug
            upstream); ``"skip"`` the step with a ``RuntimeWarning`` naming them; ``"step"``
            anyway. With a loss scaler an overflow skips the step and backs the scale off.
        elementwise: declare that ``optimizer_class`` updates each element from its own
            grad and state alone, so that it steps flat shards although it is not in
            ``ELEMENTWISE`` (see [Note: elementwise optimizers]).
        precision: an ``OptimizerPrecision``: bf16 main params (of a bf16 model) and/or bf16
            state, stored with stochastic rounding ([Note: precision-aware optimizer] in
            ``optim/precision.py``); None keeps both in fp32.
        **defaults: the inner optimizer's keyword arguments (``lr``, ``weight_decay``, ...).

    A param without a grad (frozen through the backward, or its ``.grad`` set to None) keeps
    its values and state, as torch's optimizers skip it ([Note: params without a grad]).
    """

    _step_supports_amp_scaling = True  # GradScaler.step hands step its check ([Note: grad scaler])

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        params: Iterable[Any] | None = None,
        overlap_param_gather: bool = True,
        loss_scale: float | str | StaticLossScaler | None = None,
        nonfinite: str = "raise",
        elementwise: bool = False,
        precision: OptimizerPrecision | None = None,
        **defaults: Any,
    ) -> None:
        check_flags(overlap_param_gather=overlap_param_gather, elementwise=elementwise)
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        model = uncompiled(model)
        state = _sharded_state(model)
        if not state.sets:
            raise ValueError(
                f"{type(model).__name__} has no parameter that requires grad: nothing to optimize (a "
                "stage-3 model of frozen params serves forward passes: a reference model, a teacher)"
            )
        params = None if params is None else list(params)  # (offload may lay the groups out again)
        groups, group_of, classes = param_groups(state, params, optimizer_class)
        self.offload = budget_offload(  # (with a device budget: the share it decided)
            state.offload, state.budget_specs, state.stage, optimizer_class, defaults, precision
        )
        offload, optimizer_class, defaults = resolve_offload(self.offload, optimizer_class, classes, defaults)
        if classes and optimizer_class not in classes:  # (a share on the host: a HybridDeviceOptimizer)
            groups, group_of, classes = param_groups(state, params, optimizer_class)
        check_optimizer_class(
            optimizer_class, defaults, elementwise=elementwise, groups=groups, classes=classes
        )
        # (a blockwise class steps piece runs even if declared elementwise: [Note: blockwise state])
        blockwise = [state_block(cls, defaults) is not None for cls in classes]
        flat = [
            steps_flat(cls, optimizer_class, elementwise) and not b
            for cls, b in zip(classes, blockwise, strict=True)
        ]
        whole = [not f and not b for f, b in zip(flat, blockwise, strict=True)]
        low = resolve_precision(precision, state, classes, [not f for f in flat])
        shapes = whole_shapes(state, group_of, classes, whole)
        pieces = piece_params(state, group_of, classes, defaults)  # ([Note: blockwise state])
        main_dtype = torch.float32 if low is None else low.main_dtype
        self._model = model
        self._sharded: ShardState = state
        self._group_names = group_of  # optimized param name -> its param group
        named = offload.units if offload is not None else None  # ([Note: unit homes])
        ids = None if named is None else unit_ids(named, state.unit_modules)
        self._buffer_shards = [
            build_shards(buffer, bset.world, group_of, shapes, main_dtype, pieces=pieces, host=home)
            for bset in state.sets.values()
            for buffer in bset.buffers
            for home in [offload if host_homed(offload, buffer.layout.unit, ids) else None]
        ]
        check_fp8_record(self._buffer_shards, state.fp8_values())
        state.home_frozen_shards(offload, ids)  # (a budget's decision: its units' frozen shards too)
        originals = state.take_originals()
        for shards in self._buffer_shards:
            shards.load_main_values(originals)
            if shards.main_data is not None and shards.buffer.sharded_params:  # [Note: main-backed shards]
                shards.buffer.adopt_main(shards.main_data, host=shards.on_host)
        inner_groups = [{**hyper, "params": []} for hyper in groups]
        for shards in self._buffer_shards:
            for run, tensor in zip(shards.runs, shards.tensors, strict=True):
                inner_groups[run.group]["params"].append(tensor)
        self.inner: torch.optim.Optimizer
        if low is None:
            self.inner = make_inner(optimizer_class, classes, inner_groups, defaults, self._describe_run)
            adopt(self.inner, self._buffer_shards, pieces)
        else:
            grads = {
                id(t): g for sh in self._buffer_shards for t, g in zip(sh.tensors, sh.grads, strict=True)
            }
            self.inner = PrecisionAwareOptimizer(optimizer_class, inner_groups, defaults, low, grads)
        self._streamed = None  # ([Note: streamed step])
        if offload is not None and offload.step == "device":
            self._streamed = StreamedStep(self._buffer_shards, state.stats, offload.stream_chunk)
        self._init_base()
        self.overlap_param_gather = overlap_param_gather
        self.loss_scaler = make_loss_scaler(loss_scale)
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._held = HeldBack()  # params without a grad: [Note: params without a grad]
        self._init_grads()
        members = [[n for n, g in group_of.items() if g == i] for i in range(len(groups))]
        self._settings = SettingsCheck(job_world(model), members)
        self._settings.check(self.inner)
        if loss_scale is None and any(s.buffer.layout.dtype == torch.float16 for s in self._buffer_shards):
            warnings.warn(
                "fp16 params without loss scaling: small grads underflow to zero in fp16; pass "
                "loss_scale='dynamic' and scale the loss with optimizer.scale_loss(loss)",
                stacklevel=2,
            )
        state.attach(self)

    def _describe_run(self, tensor: torch.Tensor) -> str:
        """What an inner tensor is, for an error: a whole param's name, or a flat run."""
        shards, run = next(
            (sh, r)
            for sh in self._buffer_shards
            for r, t in zip(sh.runs, sh.tensors, strict=True)
            if t is tensor
        )
        bucket = shards.buffer.layout.buckets[run.bucket]
        if run.shape is None:
            return f"a flat run of bucket {bucket.index}"
        pieces = bucket.local_ranges(shards.buffer.rank)
        return f"param {next(p.name for p in pieces if p.in_shard == run.in_shard)!r}"

    @property
    def shards(self) -> tuple[BufferShards, ...]:
        """One record per flat buffer: its shards, fp32 main params and the inner optimizer's
        runs over them (checkpoints read these)."""
        return tuple(self._buffer_shards)

    def main_frame(self, buffer: FlatBuffer) -> torch.Tensor | None:
        """The fp32 main params of ``buffer``'s shard frame, None where its params are
        their own record (fp32) ([Note: values of record] in ``wrap/record.py``)."""
        return next((s.record_main for s in self._buffer_shards if s.buffer is buffer), None)

    @property
    def group_of(self) -> Mapping[str, int]:
        """Optimized param name -> the index of its param group (read-only)."""
        return MappingProxyType(self._group_names)

    def _init_base(self) -> None:
        """The parts of ``torch.optim.Optimizer.__init__`` that apply: hook registries and
        the profiled step; ``param_groups``, ``state`` and ``defaults`` are the inner's."""
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

    # The inner optimizer's own objects, looked up each time: its load_state_dict replaces them.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of this rank's shards, then the param all-gathers; see the note."""
        self._sharded.check_resident("optimizer.step() was called")
        loss = run_closure(closure)
        without = self._check_grads_synced()
        scaled = self._scaled_step()
        if self._sharded.grad_sync.grads is Grads.EMPTY:
            return loss  # no backward since zero_grad: nothing to step, as in torch
        if not scaled:
            self._refuse_nonfinite()
        HERE.enter(Phase.STEP)
        with span("optimizer step"):  # ([Note: profiler ranges] in comm/trace.py)
            self._update(scaled, without)
        HERE.step_done()
        return loss

    def _update(self, scaled: bool, without: list[str]) -> None:
        """The step proper: skipped where grads overflowed, else the inner optimizer's update
        of the shards (``without``: the params without a grad, held back) and the gathers
        that publish the new params."""
        if self.nonfinite != "step" or scaled:
            self._prepare_grads()
            if self._found_inf:
                self.skipped_steps += 1
                if self.loss_scaler is not None:
                    self.loss_scaler.update(True)
                elif not scaled:
                    self._warn_skipped()
                return
        if not self._norm_checked_settings:
            self._settings.after_step(self.inner)
        self._norm_checked_settings = False
        self._apply_grad_factor()
        ready_host_frames(self._buffer_shards, self._sharded.stats)  # (offloaded: [Note: memory tiers])
        self._sharded.wait_for_params()  # a shard may still be the source of a gather
        with self._held.step(self.inner, self._buffer_shards, without):
            if self._streamed is not None:
                self._streamed.step(self.inner)
            else:
                self.inner.step()
        if without:
            self.main_params_changed()  # (an inner keeping its own copies stepped them)
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        self._publish_params()
        self._sharded.mark_stepped(without)

    def check_settings(self) -> None:
        """Raise ``ValueError`` on every rank (every rank calls this) if the ranks' param
        groups or hyperparameters differ, naming the first difference; checkpoints call it
        before saving ([Note: never silent] in ``errors.py``)."""
        self._settings.check(self.inner)

    def _publish_params(self) -> None:
        for shards in self._buffer_shards:
            shards.store_main_to_params(self._sharded.stats)
        gather = self._sharded.param_gather
        if gather is not None:
            gather.launch()
            if not self.overlap_param_gather:
                gather.wait_all()
        unsharder = self._sharded.unsharder
        if unsharder is not None and self.overlap_param_gather:
            unsharder.prefetch_first()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's grads (the shards the inner optimizer reads included)."""
        self._model.zero_grad(set_to_none=set_to_none)

    def main_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates (fp32 main params, or param views)."""
        held = (
            s.main_data if s.main_data is not None else s.buffer.param_storage() for s in self._buffer_shards
        )
        return [t for t in held if t is not None]  # (a buffer without main params holds its params)

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors whose home is the host, by role ([Note: memory tiers]): empty unless the
        model was sharded with ``Offload(optimizer=True)`` (its named units', [Note: unit
        homes])."""
        offloaded = [s for s in self._buffer_shards if s.on_host]
        if not offloaded:  # (an inner optimizer may keep its own: a HybridDeviceOptimizer)
            inner = getattr(self.inner, "host_tensors", None)
            return inner() if callable(inner) else {}
        homed = [self.inner.state.get(t, {}) for s in offloaded for t in s.tensors]
        state = [v for st in homed for v in st.values() if isinstance(v, torch.Tensor)]
        shards = [g for s in offloaded if s.buffer.grads_on_host for g in s.buffer.grad_storage()]
        return {
            "grads": [*(s.host_grads for s in offloaded if s.host_grads is not None), *shards],
            "main_params": [s.main_data for s in offloaded if s.main_data is not None],
            "optimizer_state": state,
        }

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model's params into the fp32 main params (after loading model weights)."""
        self._sharded.wait_for_params()
        for shards in self._buffer_shards:
            shards.load_main_from_params()
        self.main_params_changed()

    @torch.no_grad()
    def load_main_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """The main params from full-precision ``values`` by param name, each piece from its
        own (``ShardedModule.load_state_dict`` calls this; names not given keep theirs)."""
        self._sharded.wait_for_params()
        for shards in self._buffer_shards:
            shards.load_main_values(values)
        self.main_params_changed()

    def main_params_changed(self) -> None:
        """Let an inner optimizer that keeps its own copies (``HybridDeviceOptimizer``)
        refresh them from the main params (after they were written other than by a step)."""
        reload = getattr(self.inner, "reload_model_params", None)
        if reload is not None:
            reload()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "DistributedOptimizer lays out its param groups at construction; pass every group in params="
        )

    def __deepcopy__(self, memo):
        raise TypeError(
            "copy.deepcopy of a DistributedOptimizer: it steps shards bound to one sharded model; "
            "copy its state with state_dict() (or flatshard.save_checkpoint) and load it into "
            "another DistributedOptimizer"
        )

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: the inner optimizer's, the fp32 main params, the
        loss scaler; loadable by the same rank of the same layout (world size and stage)."""
        return rank_state(
            self._buffer_shards, self._sharded, self.inner, self.loss_scaler, self.skipped_steps
        )

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` of this rank; every rank must call it (params are re-gathered)."""
        shards, scaler = self._buffer_shards, self.loss_scaler
        self.skipped_steps = load_rank_state(state_dict, shards, self._sharded, self.inner, scaler)
        self._publish_params()

    def __repr__(self) -> str:
        runs = sum(len(s.runs) for s in self._buffer_shards)
        return f"DistributedOptimizer(stage={self._sharded.stage}, {runs} runs, inner={self.inner!r})"


def _sharded_state(model: nn.Module) -> ShardState:
    if not isinstance(model, ShardedModule):
        raise TypeError(
            f"DistributedOptimizer takes a module returned by flatshard.shard(), got {type(model).__name__}"
        )
    return model.flatshard_state
