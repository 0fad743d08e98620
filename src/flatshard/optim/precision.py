"""A precision-aware inner optimizer: main params and state below fp32, updates in fp32.

The reasoning is [Note: precision-aware optimizer] below."""

# [Note: precision-aware optimizer]
#
# ``DistributedOptimizer(..., precision=OptimizerPrecision(main_dtype, state_dtype))`` keeps
# its main params (``main_dtype``) and every elementwise state tensor (``state_dtype``) in
# bf16 where asked, while each update is computed in fp32 by the user's own torch class:
#
# * **Stored low, stepped in fp32, a chunk at a time.** A step walks each param group's runs
#   in chunks of at most ``CHUNK`` elements (``DEVICE_CHUNK`` on an accelerator). For a
#   chunk, the main params (where they are bf16) and the state are widened into fp32
#   scratch, the grads are the fp32 grad shards themselves, the torch class steps that chunk
#   (one ``step`` call over all its pieces), and the results are rounded back. Extra memory
#   is the scratch of one chunk per state tensor, not an fp32 copy of anything.
# * **Stochastic rounding, not round-to-nearest.** An Adam moment changes by a factor
#   ``beta`` (0.9, 0.999) a step; for the second moment that is a relative change of 1e-3,
#   below half a bf16 ulp (2**-9), so round-to-nearest would freeze it. Likewise an update
#   ``lr * u`` smaller than half an ulp of its weight would vanish every step. Rounding up
#   with probability equal to the remainder's fraction of an ulp is unbiased: the expected
#   stored value is the fp32 value, and updates below an ulp still land on average. It costs
#   no memory, where a Kahan compensation term would cost 2 more bytes a param; its noise is
#   of the order of an ulp, far below the gradient noise of a mini-batch (measured by
#   ``benchmarks/precision.py``).
# * **Random bits that replay.** Each element's bits are a hash of its place in its run and
#   of ``(seed, the step count, the group, the run, the state key)`` ([Note: rounding bits]
#   in ``optim/rounding.py``), the same on every rank. Replicated state (stage 0) stays
#   replicated, and a resume at the same layout rounds as the uninterrupted run would have
#   (for classes that count steps in their state; SGD does not, and then the count is this
#   optimizer's own).
# * **Adam and AdamW in one pass.** Groups of torch's ``Adam`` or ``AdamW`` skip the widening
#   and take a fused step ([Note: fused Adam step] in ``optim/fused_adam.py``): the same
#   arithmetic, state and rounding bits, one compiled kernel a chunk on an accelerator.
#   ``fused=False`` keeps the chunked path for every class.
# * **torch's state format.** ``state[run]`` holds the class's own keys (``exp_avg``,
#   ``exp_avg_sq``, ``step``) with elementwise tensors in ``state_dtype``, so checkpoints
#   write them as they do fp32 state, and a checkpoint of either loads into the other
#   (values widened, or rounded to nearest once, on load). bf16 main params are the params:
#   the checkpoint holds them under ``model/``, and an fp32-state optimizer loading it starts
#   its main params from them.
# * Elementwise classes only (``[Note: elementwise optimizers]``): a state tensor of another
#   shape than its param's is refused, naming the class and the key.

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

from flatshard.optim import fused_adam
from flatshard.optim.composite import CompositeOptimizer, class_defaults, run_closure
from flatshard.optim.rounding import round_into, salt, shift_of
from flatshard.optim.shards import run_dtype
from flatshard.planner.mixed_precision import OptimizerPrecision

CHUNK = 1 << 21
"""Elements stepped at once on the CPU (8 MiB of fp32 scratch per widened tensor, freed after the step)."""
DEVICE_CHUNK = 1 << 25
"""Elements stepped at once on an accelerator (128 MiB of scratch per widened tensor): the
step is a few dozen kernels a chunk, so small chunks leave the GPU waiting on launches. On
an H200 a Llama-3-8B step took 1763 ms of optimizer at ``CHUNK`` and 514 ms at this size
(``benchmarks/gpu_showcase.py``)."""

Piece = tuple[torch.Tensor, int, int]  # (run tensor, start, end) of its flat view


class PrecisionAwareOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``groups`` of run tensors, keeping them (where they are
    bf16) and the class's elementwise state in the dtypes of ``precision``."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        groups: list[dict[str, Any]],
        defaults: dict[str, Any],
        precision: OptimizerPrecision,
        grads: Mapping[int, torch.Tensor],
        chunk: int | None = None,
        fused: bool = True,
    ) -> None:
        """``grads``: each run's grad by ``id(run)`` (a bf16 run cannot hold an fp32 ``.grad``);
        ``chunk``: elements stepped at once (default ``CHUNK`` on the CPU, else ``DEVICE_CHUNK``);
        ``fused``: Adam and AdamW groups take the fused step ([Note: fused Adam step])."""
        full = class_defaults(optimizer_class, defaults, groups)
        super().__init__(groups, full)
        self.optimizer_class = optimizer_class
        self.precision = precision
        self.chunk = chunk
        self.fused = fused
        self._grads = grads
        # each run's (group, place in it), for its rounding bits
        self._places: dict[int, tuple[int, int]] = {}
        probe = torch.zeros(1, requires_grad=True)
        self._base = optimizer_class([probe], **defaults)  # steps each chunk's fp32 pieces
        self._steps = 0  # this optimizer's own count, for classes that keep none
        self._scratch: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._counts: dict[int, dict[str, Any]] = {}  # each run's scalar state before this step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = run_closure(closure)
        self.step_runs(None)
        return loss

    def step_runs(self, only: Collection[int] | None, count: bool = True) -> None:
        """Step the runs whose ``id`` is in ``only`` (None: every run), counting a step of this
        optimizer's own where ``count`` (a step streamed a chunk at a time is one step, counted
        at its first call: [Note: streamed step] in ``optim/streamed_step.py``)."""
        self._steps += int(count)
        self._places = {
            id(p): (i, j) for i, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])
        }
        # every chunk of a run starts from the run's counts before this step (a run cut into
        # chunks would otherwise count one step per chunk)
        self._counts = {
            id(p): {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
            for p, state in self.state.items()
            if state
        }
        try:
            for group in self.param_groups:
                params = [p for p in group["params"] if only is None or id(p) in only]
                if self.fused and fused_adam.fusable(self.optimizer_class, group):
                    self._step_fused(group, params)
                    continue
                hyper = {k: v for k, v in group.items() if k != "params"}
                for chunk in self._chunks(params):
                    self._step_chunk(hyper, chunk)
        finally:
            self._scratch.clear()  # (between steps only the stored dtypes stay)

    def _step_fused(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:
            where = (self.precision.seed, *self._places[id(p)])
            grad = self._grads[id(p)]
            size = self.chunk or (CHUNK if p.device.type == "cpu" else fused_adam.FUSED_CHUNK)
            fused_adam.step_run(p, grad, self.state[p], group, where, size, self.precision.state_dtype)

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[Piece]]:
        """The group's runs cut into lists of pieces of at most ``chunk`` elements in all."""
        chunk: list[Piece] = []
        size = self.chunk or (CHUNK if not params or params[0].device.type == "cpu" else DEVICE_CHUNK)
        room = size
        for p in params:
            start = 0
            while start < p.numel():
                end = min(p.numel(), start + room)
                chunk.append((p, start, end))
                room -= end - start
                start = end
                if room == 0:
                    yield chunk
                    chunk, room = [], size
        if chunk:
            yield chunk

    def _widened(self, name: str, device: torch.device, numel: int) -> torch.Tensor:
        """fp32 scratch ``name`` of at least ``numel`` elements (kept through the step)."""
        key = (name, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, device=device)
        return buf[:numel]

    def _step_chunk(self, hyper: dict[str, Any], chunk: list[Piece]) -> None:
        device = chunk[0][0].device
        total = sum(end - start for _, start, end in chunk)
        main = self._widened("main", device, total)
        pieces: list[torch.Tensor] = []
        offset = 0
        for p, start, end in chunk:
            flat = p.view(-1)[start:end]
            if p.dtype == torch.float32:
                w = flat  # fp32 main params: stepped in place
            else:
                w = main[offset : offset + end - start]
                w.copy_(flat)
            grad = self._grads[id(p)].view(-1)[start:end]
            w.grad = grad if grad.dtype == torch.float32 else grad.float()
            self._base.state[w] = self._widen_state(p, start, end, offset, total)
            pieces.append(w)
            offset += end - start
        self._base.param_groups[0] = {**hyper, "params": pieces}
        try:
            self._base.step()
            self._store(chunk, pieces)
        finally:
            self._base.state = defaultdict(dict)
            for w in pieces:
                w.grad = None

    def _widen_state(self, p: torch.Tensor, start: int, end: int, offset: int, total: int) -> dict[str, Any]:
        """The run's state for elements ``start:end``, elementwise tensors widened into
        scratch; empty before the first step (the class then creates its own)."""
        counts = self._counts.get(id(p))
        if counts is None:  # the run's first step: the class creates its state, every chunk alike
            return {}
        out: dict[str, Any] = {}
        for key, value in self.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                wide = self._widened(key, p.device, total)[offset : offset + end - start]
                out[key] = wide.copy_(value.view(-1)[start:end])
        for key, value in counts.items():  # (each piece steps its own copy)
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return out

    def _store(self, chunk: list[Piece], pieces: list[torch.Tensor]) -> None:
        """Round the stepped fp32 pieces back into the runs and their stored state."""
        for (p, start, end), w in zip(chunk, pieces, strict=True):
            stepped = self._base.state[w]
            state = self.state[p]
            count = stepped.get("step", self._steps)
            count = int(count.item()) if isinstance(count, torch.Tensor) else int(count)
            where = (self.precision.seed, count, *self._places[id(p)])
            for key, value in stepped.items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    state[key] = value
                    continue
                if value.shape != w.shape:
                    raise ValueError(
                        f"{self.optimizer_class.__name__} keeps state {key!r} of shape {tuple(value.shape)} "
                        f"for a piece of {w.numel()} elements: only elementwise state can be kept in "
                        f"{self.precision.state_dtype} ([Note: elementwise optimizers])"
                    )
                if key not in state or not isinstance(state[key], torch.Tensor):
                    state[key] = torch.zeros(p.shape, dtype=self.precision.state_dtype, device=p.device)
                round_into(state[key].view(-1)[start:end], value, salt(*where, key), start, shift_of(key))
            if p.dtype != torch.float32:  # bf16 main params: the params themselves
                round_into(p.view(-1)[start:end], w, salt(*where, "param"), start)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load (which casts state to each param's dtype), then elementwise state to
        ``state_dtype`` (rounded to nearest: once, not every step)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                    state[key] = value.to(self.precision.state_dtype)

    def __repr__(self) -> str:
        p = self.precision
        return (
            f"PrecisionAware({self.optimizer_class.__name__}, main {p.main_dtype}, "
            f"state {p.state_dtype}, stochastic rounding)"
        )


def resolve_precision(
    precision: object, state: Any, classes: list[type], whole: list[bool]
) -> OptimizerPrecision | None:
    """What a ``PrecisionAwareOptimizer`` must keep: ``precision`` where it lowers anything,
    fp32 where grads of another dtype than their runs (``MixedPrecision(grad_dtype=...)``)
    must be widened, None where the class steps the runs itself. Refuses, naming the value,
    what it cannot do: bf16 main params of params that are not bf16, a class stepped whole,
    several classes at once, an optimizer that keeps its own copies."""
    if precision is not None and not isinstance(precision, OptimizerPrecision):
        raise TypeError(f"precision must be a flatshard.OptimizerPrecision or None, got {precision!r}")
    precision = precision or OptimizerPrecision()
    layouts = [b.layout for bset in state.sets.values() for b in bset.buffers]
    widened = any(lay.grad_dtype != run_dtype(lay.dtype, precision.main_dtype) for lay in layouts)
    if not (precision.lowered or widened):
        return None
    composite = [c for c in classes if issubclass(c, CompositeOptimizer)]
    if any(whole) or len(set(classes)) > 1 or composite:
        names = sorted({c.__name__ for c in classes})
        why = " (stepped per param)" if any(whole) else " (keeps its own copies)" if composite else ""
        what = f"precision={precision}" if precision.lowered else "MixedPrecision(grad_dtype=torch.bfloat16)"
        raise ValueError(
            f"{what} steps one elementwise torch optimizer class over flat shards; "
            f"these groups use {names}{why}"
        )
    dtypes = {lay.dtype for lay in layouts}
    if precision.main_dtype == torch.bfloat16 and dtypes - {torch.bfloat16}:
        raise ValueError(
            f"OptimizerPrecision(main_dtype=torch.bfloat16) updates bf16 params in place, but the "
            f"model's trainable params are {sorted(map(str, dtypes))}: shard the model with "
            "mixed_precision=flatshard.MixedPrecision(torch.bfloat16)"
        )
    return precision
