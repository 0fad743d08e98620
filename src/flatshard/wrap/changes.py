"""Changes to a module after ``shard()`` are noticed at its next forward ([Note: never
silent] in ``errors.py``).

The reasoning is in [Note: changes after wrapping] and [Note: writes through the params] below."""

# [Note: changes after wrapping]
#
# ``shard`` lays params out once: which are trainable (in flat buffers, reduced, stepped) and
# which frozen, each bound by identity. A param replaced by a new ``nn.Parameter``, a frozen
# param made trainable, or a module or param added after wrapping would then be ignored: the
# new param never trained or synchronised. So each forward first compares the module tree
# with what was wrapped, by identity and a flag per param (a loop of plain attribute reads,
# no tensor work), and raises ``RuntimeError`` naming the param or module before anything runs.
#
# A param whose ``.data`` was rebound at stages 0-2 (``vector_to_parameters``, an EMA swap
# ``p.data, ema.data = ema.data, p.data``) left its flat buffer: it would never move again.
# The same check finds it (its data pointer is not its buffer view's) and puts it back: the
# values are copied into the view, ``.data`` points at the view again, and an optimizer's
# main params take the values (``rebound``).
#
# A trainable param may be frozen for a while (peft's ``disable_adapter()`` sets its
# adapters' ``requires_grad`` to False and back; DeepSpeed users train a different part of the
# model each step): it stays in its buffer, gets no grad from a backward it is frozen in, and
# the step keeps its values and state, as torch's optimizers skip a param whose ``.grad`` is
# None ([Note: params without a grad] in ``optim/held.py``), on every rank alike. At stage 3
# pass ``find_unused_parameters=True`` when a backward runs with such params frozen (a unit's
# backward would otherwise wait for their grads).

# [Note: writes through the params]
#
# A 16-bit param stepped from fp32 main params (``MixedPrecision``, stages 0-2) written in
# place through torch (``p.mul_(...)``, ``p.copy_(ema)``, an ``nn.init`` function, a hand-made
# weight decay between backward and step) holds the new values, but the next step would start
# from the main params and overwrite them. Such writes bump the param's own version counter,
# which flatshard's writes never touch (they go through the buffer, whose views count apart
# from the ``nn.Parameter`` bound to them), so each look compares the counters and hands the
# written params' values to ``rebound`` like a rebinding's. The look runs at each forward and
# wherever the values of record are about to be read or stepped (``ShardState.wait_for_params``:
# the step, ``full_state_dict``, a checkpoint): a loop of attribute reads over the 16-bit
# params, no tensor work. A write through ``p.data`` (``p.data.mul_(...)``) bypasses the
# counter and is not seen: write through the param under ``torch.no_grad()``.
#
# Such code reaches the params through ``parameters()`` or ``named_parameters()``, which first
# wait for the param all-gathers a step at stages 1-2 leaves running: the gathers would
# otherwise land after the write, or under a read (an EMA taken right after the step averaged
# half-written buffers). ``zero_grad`` does not wait, so the gathers still overlap the loop's
# own work.
#
# A ``load_state_dict`` writes through torch too, but it must not reach the main params as
# its 16-bit rounding, nor under a gather still in flight, and it need not come through the
# sharded model's own method (a wrapper's ``nn.Module.load_state_dict``, a submodule's): so
# every wrapped module carries load hooks (``LoadHooks``) that wait before torch writes its
# params and hand the state dict's own values to ``rebound`` after.

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from flatshard.engine.tensor_parallel import local, rebind
from flatshard.errors import ShardedParamError
from flatshard.planner.mixed_precision import HALF_DTYPES

Rebound = Callable[[dict[str, torch.Tensor]], None]


class WrappedTree:
    """What ``shard`` wrapped: every module's own params (by identity, with
    ``requires_grad``) and its numbers of child modules and params."""

    def __init__(
        self,
        module: nn.Module,
        rebound: Rebound | None = None,
        watch_fp32: bool = False,
        fp8_values: frozenset[str] = frozenset(),
    ) -> None:
        """``rebound``: when given (stages 0-2), params whose ``.data`` left their buffer view
        are put back, and it is called with their names and values; ``watch_fp32``: writes to
        fp32 params are looked for too (their optimizer steps a host copy: [Note: memory tiers]);
        ``fp8_values``: params that hold their fp8 values between steps, written in place only
        at a loss ([Note: fp8 gathers after the step] in ``engine/fp8_gathers.py``)."""
        self.fp8_values = fp8_values
        self.versions: list[int] = []
        named = list(module.named_modules(remove_duplicate=False))
        self.modules = [(name or "(root)", m, len(m._modules), len(m._parameters)) for name, m in named]
        self.params = [
            (name or "(root)", m, attr, p, p.requires_grad)
            for name, m in named
            for attr, p in m._parameters.items()
            if p is not None
        ]
        self.rebound = rebound
        # (name, param, its buffer view, that view's data pointer) of the params in flat buffers
        in_buffers = [] if rebound is None else [e for e in self.params if hasattr(e[3], "main_grad")]
        self.bound = [
            (_qualified(n, attr), p, local(p), local(p).data_ptr()) for n, _, attr, p, _ in in_buffers
        ]  # (a DTensor's local shard: [Note: tensor-parallel params])
        # the 16-bit ones, with their version counters ([Note: writes through the params])
        self.watched = [(name, p) for name, p, _, _ in self.bound if watch_fp32 or p.dtype in HALF_DTYPES]
        self.forget_writes()

    def check(self) -> None:
        """Raise naming the first change (measured: 73 µs a forward for the deep GPT preset's
        198 modules and 292 params, 13 µs for the small one's 38 and 52). Reading
        ``requires_grad`` of a stage-3 placeholder goes through its ``__torch_function__``
        (2.4 µs against 0.1), so the params are read with subclass dispatch off."""
        for name, m, children, params in self.modules:
            if len(m._modules) != children or len(m._parameters) != params:
                _raise(
                    f"module {name!r} has child modules {list(m._modules)} and params "
                    f"{list(m._parameters)}, {children} and {params} when wrapped"
                )
        with torch._C.DisableTorchFunctionSubclass():
            for name, m, attr, p, flag in self.params:
                if m._parameters.get(attr) is not p:
                    _raise(f"param {_qualified(name, attr)!r} was replaced by another nn.Parameter")
                if p.requires_grad and not flag:  # (trainable and frozen for now: allowed)
                    _raise(
                        f"param {_qualified(name, attr)!r} has requires_grad={not flag}, {flag} when wrapped"
                    )
        self.absorb_writes()

    def absorb_writes(self) -> None:
        """Params whose ``.data`` was rebound go back to their buffer views, keeping the
        values; they and the 16-bit params written in place since the last look go to
        ``rebound`` ([Note: writes through the params])."""
        if self.rebound is None:
            return
        moved = {name: local(p) for name, p, _, ptr in self.bound if local(p).data_ptr() != ptr}
        versions = zip(self.watched, self.versions, strict=True)
        written = {name: local(p) for (name, p), seen in versions if p._version != seen}
        if not (moved or written):
            return
        lossy = sorted(self.fp8_values.intersection(written))
        if lossy:
            raise ShardedParamError(
                f"param {lossy[0]!r} was written in place, but between steps it holds its fp8 value "
                "(MixedPrecision(fp8_gathers=True) at stages 1-2), so the write would reach its fp32 main "
                "params at fp8 precision. Load values whole instead (load_state_dict, "
                "flatshard.load_weights), or leave fp8_gathers unset"
            )
        with torch.no_grad():
            for name, p, view, _ in self.bound:
                if name in moved:
                    view.copy_(moved[name])
                    rebind(p, view)
        self.forget_writes()  # (before rebound, which may look again)
        self.rebound({**written, **moved})

    def drop_fp8_writes(self) -> None:
        """Forget writes in place through params that hold their fp8 values (about to be
        loaded over, [Note: fp8 gathers after the step] in ``engine/fp8_gathers.py``)."""
        self.versions = [
            p._version if name in self.fp8_values else seen
            for (name, p), seen in zip(self.watched, self.versions, strict=True)
        ]

    def take_storages(self) -> None:
        """The buffer views' storages were reallocated by flatshard itself (``reload_states``,
        [Note: states between phases] in ``flatshard/phases.py``): their pointers and the
        params' versions as they are now are the ones to compare with."""
        self.bound = [(name, p, view, local(p).data_ptr()) for name, p, view, _ in self.bound]
        self.forget_writes()

    def forget_writes(self) -> None:
        """Take the params' values as they are now as seen (after flatshard wrote them itself)."""
        self.versions = [p._version for _, p in self.watched]

    def hook(self, module: nn.Module, args: tuple) -> None:
        self.check()


class LoadHooks:
    """Any ``load_state_dict`` that reaches a wrapped module's params (the model's own, a
    submodule's, ``nn.Module.load_state_dict`` called by a wrapper around it) at stages 0-2:
    gathers in flight land first, and the loaded values reach the main params at their own
    precision ([Note: writes through the params])."""

    def __init__(self, tree: WrappedTree, wait: Callable[[], None]) -> None:
        self.tree = tree
        self.wait = wait  # (the param gathers a step left running, and earlier writes)
        self.names: dict[int, str] = {}  # (a tied param by its first name, as the layout has it)
        for name, p, _, _ in tree.bound:
            self.names.setdefault(id(p), name)
        self.loading: dict[str, torch.Tensor] = {}
        self.sources: dict[int, tuple[Mapping[str, torch.Tensor], str]] = {}  # (by module id)

    def register(self, module: nn.Module) -> None:
        for m in module.modules():
            m.register_load_state_dict_pre_hook(self.before)
            m.register_load_state_dict_post_hook(self.after)

    def before(self, module: nn.Module, state_dict, prefix: str, *rest) -> None:
        """Before torch copies values into ``module``'s own params: note where they come from.
        The values are read in ``after``: load hooks the user registered later on the same
        module (a rename of an old key) run between the two, as torch's copy does. A refused
        write through a param that holds its fp8 value is what a load replaces: not refused
        again here."""
        self.tree.drop_fp8_writes()
        self.wait()
        self.sources[id(module)] = (state_dict, prefix)

    def after(self, module: nn.Module, incompatible_keys) -> None:
        """After: the loaded values (not their 16-bit rounding) are what the next step starts from."""
        state_dict, prefix = self.sources.pop(id(module), ({}, ""))
        for attr, p in module._parameters.items():
            name = self.names.get(id(p))
            if name is not None and prefix + attr in state_dict:
                self.loading[name] = state_dict[prefix + attr]
        if self.loading and self.tree.rebound is not None:
            loaded, self.loading = self.loading, {}
            self.tree.forget_writes()  # (the load's own writes: taken at their own precision)
            self.tree.rebound(loaded)


def _qualified(module_name: str, attr: str) -> str:
    return attr if module_name == "(root)" else f"{module_name}.{attr}"


def _raise(what: str) -> None:
    raise RuntimeError(
        f"{what} after shard(): flatshard laid the params out when it wrapped the model, so the "
        "change would be ignored (a new param never trained or synchronised, a frozen one still "
        "stepped). Make such changes before shard(); to load values, copy them into the params "
        "(load_state_dict, flatshard.load_weights)"
    )
