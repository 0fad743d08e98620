"""``OwnerShardedOptimizer``: ZeRO-1 by ownership: each param is updated by one rank, which
then broadcasts it (flattened into buckets) to the others.

A composite optimizer ([Note: composite optimizers] in ``optim/composite.py``). It needs
every rank to hold the same reduced grads (torch DDP, or flatshard stage 0) and keeps
optimizer state only for the params this rank owns: about 1/N of it.

The reasoning is [Note: ownership] below."""

# [Note: ownership]
#
# every rank runs the same deterministic
# assignment (balanced: largest param first to the least-loaded rank; round robin: param i to
# rank i mod N), so ownership needs no communication, and a digest of the params' shapes and
# dtypes is compared across ranks at construction. Each owner packs its params into buckets
# (same device and dtype, up to ``bucket_cap_bytes``; a larger param is its own bucket), each
# with its own sub-optimizer. The broadcast order interleaves the owners' buckets (bucket 0 of
# every rank, then bucket 1, ...), and it is the same on every rank; with ``overlap=True`` an
# owner steps a bucket just before broadcasting it, so its compute overlaps the broadcasts
# already in flight. ``bucket_cap_bytes=0`` broadcasts each param in place: the per-param
# baseline.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm.collectives import CommStats, Handle, broadcast
from flatshard.comm.deadline import DEFAULT_TIMEOUT, HERE, Phase, publish_positions
from flatshard.comm.world import World, check_ranks_agree, resolve_world
from flatshard.engine.tensor_parallel import refuse_distributed_params
from flatshard.optim.composite import CompositeOptimizer, SubOptimizer, run_closure
from flatshard.planner.layout import balance

ASSIGNMENTS = ("balanced", "round_robin")
FORMAT = "OwnerShardedOptimizer/1"


@dataclass
class _Bucket:
    """Params of one owner, one device and one dtype, broadcast together."""

    owner: int
    params: list[torch.Tensor]
    sub: SubOptimizer | None  # on the owner only

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def launch(self, world: World, stats: CommStats) -> tuple[Handle, Callable[[], None]]:
        """Start the broadcast from the owner; returns its handle and what to run after it."""
        first = self.params[0]
        if len(self.params) == 1 and first.is_contiguous():
            return broadcast(first.detach(), world, src=self.owner, stats=stats), _nothing
        if world.rank == self.owner:
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            return broadcast(flat, world, src=self.owner, stats=stats), _nothing
        flat = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        handle = broadcast(flat, world, src=self.owner, stats=stats)
        return handle, lambda: _unflatten(flat, self.params)


def _nothing() -> None:
    return None


@torch.no_grad()
def _unflatten(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    for param, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
        param.copy_(piece.view_as(param))


class OwnerShardedOptimizer(CompositeOptimizer):
    """``optimizer_class`` over ``params``, each param updated by the one rank that owns it
    and then broadcast to the others in flat buckets.

    Args:
        params: params or param groups, as for any torch optimizer; the same on every rank.
        optimizer_class: any torch optimizer class (each owner runs it over whole params).
        group: the process group (None: the default group, or a world of one).
        assignment: ``"balanced"`` (largest param first to the rank owning the fewest
            elements) or ``"round_robin"`` (param i to rank i mod N).
        bucket_cap_bytes: most bytes per broadcast; a larger param goes alone. 0 broadcasts
            every param on its own, in place.
        overlap: step each bucket just before broadcasting it, while earlier broadcasts are
            in flight (True), or step everything first (False).
        **defaults: the optimizer's hyperparameters (``lr``, ...).

    Use it with grads that are already the same on every rank (torch DDP, flatshard stage 0).
    ``state`` holds only this rank's params; ``state_dict()`` is this rank's shard and
    ``consolidate_state_dict(to)`` gathers a plain torch state dict on rank ``to``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        group: Any = None,
        assignment: str = "balanced",
        bucket_cap_bytes: int = 25 * 2**20,
        overlap: bool = True,
        **defaults: Any,
    ) -> None:
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
        if int(bucket_cap_bytes) < 0:
            raise ValueError(f"bucket_cap_bytes must be >= 0, got {bucket_cap_bytes!r}")
        self.world = resolve_world(group, DEFAULT_TIMEOUT)
        if self.world.group is not None:
            publish_positions()
        self.assignment = assignment
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.overlap = overlap
        self.optimizer_class = optimizer_class
        self.stats = CommStats()
        self._owner: dict[torch.Tensor, int] = {}
        self._loads = [0] * self.world.size
        self._buckets: list[list[_Bucket]] = [[] for _ in range(self.world.size)]
        self._order: list[_Bucket] = []
        self._ready = False
        super().__init__(params, [optimizer_class], defaults)
        self._ready = True
        self._place(self.ordered_params())

    # -- ownership and buckets ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (the same on every rank); its params get owners and buckets of their own."""
        before = sum(len(g["params"]) for g in self.param_groups)
        super().add_param_group(param_group)
        if self._ready:
            self._place(self.ordered_params()[before:])

    def _place(self, new: list[tuple[int, torch.Tensor]]) -> None:
        """Assign owners to ``new`` params, bucket them, and build this rank's sub-optimizers."""
        refuse_distributed_params([p for _, p in new], "OwnerShardedOptimizer")
        check_ranks_agree(
            self.world,
            [f"{g} {tuple(p.shape)} {p.dtype} {p.device.type}" for g, p in new],
            "the params given to OwnerShardedOptimizer",
        )
        owners = self._assign([p for _, p in new])
        for rank in range(self.world.size):
            mine = [(g, p) for (g, p), owner in zip(new, owners, strict=True) if owner == rank]
            for chunk in self._chunks(mine):
                sub = None
                if rank == self.world.rank:
                    sub = self.add_sub(self.optimizer_class, [(g, p, p) for g, p in chunk])
                self._buckets[rank].append(_Bucket(rank, [p for _, p in chunk], sub))
        depth = max(len(b) for b in self._buckets)
        self._order = [b[i] for i in range(depth) for b in self._buckets if i < len(b)]
        self.link_state()

    def _assign(self, params: list[torch.Tensor]) -> list[int]:
        owners = [0] * len(params)
        if self.assignment == "round_robin":
            start = len(self._owner)
            owners = [(start + i) % self.world.size for i in range(len(params))]
        else:  # the planner of whole-param buckets too ([Note: whole-param buckets])
            owners = balance([p.numel() for p in params], self.world.size, self._loads)
        for p, owner in zip(params, owners, strict=True):
            self._owner[p] = owner
            if self.assignment == "round_robin":
                self._loads[owner] += p.numel()
        return owners

    def _chunks(self, members: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        """``members`` packed in order into buckets of one device and dtype, at most
        ``bucket_cap_bytes`` each (a larger param alone)."""
        chunks: list[list[tuple[int, torch.Tensor]]] = []
        open_: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        size: dict[tuple, int] = {}
        for g, p in members:
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            chunk = open_.get(key)
            if chunk is None or size[key] + nbytes > self.bucket_cap_bytes:
                chunk = open_[key] = []
                size[key] = 0
                chunks.append(chunk)
            chunk.append((g, p))
            size[key] += nbytes
        return chunks

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank that updates ``param``."""
        return self._owner[param]

    @property
    def owned_numel(self) -> list[int]:
        """Elements owned by each rank."""
        return list(self._loads)

    # -- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's params, then broadcast every bucket from its owner."""
        loss = run_closure(closure)
        with HERE.during(Phase.STEP):
            self._step_and_broadcast()
        return loss

    def _step_and_broadcast(self) -> None:
        self.push_hyperparameters()
        if not self.overlap:
            for bucket in self._buckets[self.world.rank]:
                if bucket.sub is not None:  # (set on its owner: this rank)
                    bucket.sub.step()
        pending = []
        for bucket in self._order:
            if self.overlap and bucket.sub is not None:
                bucket.sub.step()
            pending.append(bucket.launch(self.world, self.stats))
        for handle, after in pending:
            handle.wait()
            after()
        self.link_state()

    # -- state dicts --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: torch's format with state for the params this rank owns, plus
        the ownership it was saved under (loads on the same rank of the same ownership)."""
        out = super().state_dict()
        out.update(flatshard=FORMAT, world_size=self.world.size, rank=self.world.rank, owners=self._owners())
        return out

    def _owners(self) -> list[int]:
        return [self._owner[p] for _, p in self.ordered_params()]

    def consolidate_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Gather every rank's state into one plain torch state dict (CPU tensors) on rank
        ``to``, loadable by the plain optimizer or by this class at any world size; None
        on the other ranks. Every rank must call it."""
        if not 0 <= to < self.world.size:
            raise ValueError(f"to must be a rank in [0, {self.world.size}), got {to!r}")
        mine = super().state_dict()
        local = {i: _to_cpu(entry) for i, entry in mine["state"].items()}
        parts: list[Any] | None = [local]
        if self.world.group is not None:
            parts = [None] * self.world.size if self.world.rank == to else None
            dst = dist.get_global_rank(self.world.group, to)
            dist.gather_object(local, parts, dst=dst, group=self.world.group)
        if self.world.rank != to or parts is None:
            return None
        state = {i: entry for part in parts for i, entry in part.items()}
        return {"state": dict(sorted(state.items())), "param_groups": mine["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` saved by this rank under the same ownership, or a full
        (consolidated or plain torch) state dict at any world size."""
        if state_dict.get("flatshard") == FORMAT:
            saved = (state_dict["world_size"], state_dict["rank"], state_dict["owners"])
            here = (self.world.size, self.world.rank, self._owners())
            if saved != here:
                raise ValueError(
                    f"this optimizer shard was saved by rank {saved[1]} of {saved[0]}"
                    f"{' with another param ownership' if saved[:2] == here[:2] else ''}; here rank "
                    f"{here[1]} of {here[0]}: load a consolidate_state_dict() result instead"
                )
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"OwnerShardedOptimizer({self.optimizer_class.__name__}, rank {self.world.rank} of "
            f"{self.world.size}, {self.assignment}, {len(self._order)} buckets, owns "
            f"{self._loads[self.world.rank]} of {sum(self._loads)} elements)"
        )


def _to_cpu(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
