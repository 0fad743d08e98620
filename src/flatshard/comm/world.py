"""The data-parallel group ("world") a set of buffers communicates over."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flatshard.comm.deadline import Watched

# torch.distributed does not export it; the backend's options classes all live here
AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions
Options = TypeVar("Options")


@dataclass(frozen=True)
class World:
    """A process group with its rank and size; ``group is None`` means a world of one.
    ``timeout`` is the deadline of each collective issued on it ([Note: deadlines] in
    ``comm/deadline.py``; None: the process group's own)."""

    group: ProcessGroup | None
    rank: int
    size: int
    timeout: timedelta | None = field(default=None, compare=False)

    def options(self, kind: type[Options]) -> Options:
        """A fresh options object of the backend's ``kind`` (``dist.AllreduceOptions``, ...),
        carrying this world's deadline."""
        opts = kind()
        if self.timeout is not None:
            opts.timeout = self.timeout  # type: ignore[attr-defined]  # (every options class has one)
        return opts

    @property
    def pg(self) -> ProcessGroup:
        """The process group of a world of more than one rank (the collectives' own)."""
        if self.group is None:
            raise RuntimeError(f"{self} has no process group: a world of one runs no collective")
        return self.group

    def watch(self, handle: object, op: str) -> Watched:
        """``handle`` of ``op`` (just issued on this world), whose failed wait raises
        ``DesyncError`` naming every rank's position."""
        return Watched(handle, self.group, self.timeout, op)

    @property
    def backend(self) -> str:
        return "none" if self.group is None else str(dist.get_backend(self.group))

    def backend_for(self, device: torch.device) -> str:
        """The name of the backend that carries ``device`` tensors on this world (``"gloo"``,
        ``"nccl"``, ...): a group made with ``"cpu:gloo,cuda:nccl"`` has one per device type,
        and gloo alone carries both. ``"none"`` in a world of one, or where no backend takes
        that device type."""
        if self.group is None:
            return "none"
        try:
            backend = self.group._get_backend(device)
        except RuntimeError:  # no backend for that device type
            return "none"
        return type(backend).__name__.removeprefix("ProcessGroup").lower()

    @property
    def control_device(self) -> torch.device:
        """Where the small tensors of this world's control collectives (digests, flags) live:
        the host when the group's backend takes host tensors (gloo, mpi, or a
        ``"cpu:gloo,cuda:nccl"`` pair), else the backend's device type, which a tensor
        resolves to the current device (NCCL: the one ``torch.cuda.set_device`` chose)."""
        if self.group is None:
            return torch.device("cpu")
        types = [d.type for d in getattr(self.group, "_device_types", ())]
        if not types or "cpu" in types:
            return torch.device("cpu")
        return torch.device(types[0])

    def completes_on_host(self, device: torch.device) -> bool:
        """Whether this world's backend for ``device`` tensors (gloo, mpi) finishes a
        collective on the host, so that a ``wait()`` returns once it has completed; NCCL's
        ``wait()`` only orders streams."""
        if self.group is None:
            return True
        name = self.backend_for(device)
        return name in ("gloo", "mpi") or (name == "none" and device.type == "cpu")

    def __str__(self) -> str:
        return f"world(rank {self.rank} of {self.size}, {self.backend})"


ONE = World(None, 0, 1)


def resolve_worlds(group: object = None, timeout: timedelta | None = None) -> tuple[World, World]:
    """``(shard world, replicate world)`` of ``group``: a 2-D DeviceMesh is (replicate,
    shard), replicated sharding as in FSDP2's HSDP; anything else shards over ``resolve_world(group)``
    and replicates over a world of one."""
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        mesh: Any = group
        if mesh.ndim == 2:
            return _of_group(mesh.get_group(1), timeout), _of_group(mesh.get_group(0), timeout)
    return resolve_world(group, timeout), ONE


def _of_group(group: ProcessGroup, timeout: timedelta | None) -> World:
    size = dist.get_world_size(group)
    return ONE if size == 1 else World(group, dist.get_rank(group), size, timeout)


def resolve_world(group: object = None, timeout: timedelta | None = None) -> World:
    """Turn ``group`` (a ProcessGroup, a 1-D DeviceMesh or None) into a ``World`` whose
    collectives have the deadline ``timeout``.

    ``None`` means the default process group when one is initialized, else a world of one.
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ONE
        group = dist.group.WORLD
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        mesh: Any = group
        if mesh.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh must be 1-D here, got a {mesh.ndim}-D mesh of shape "
                f"{tuple(mesh.shape)} (2-D replicate x shard meshes need stage >= 1 replicated sharding)"
            )
        group = mesh.get_group()
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
    return _of_group(group, timeout)


_MADE: dict[tuple, tuple[ProcessGroup | None, ProcessGroup]] = {}


def made_group(purpose: str, world: World, backend: str, timeout: timedelta | None = None) -> ProcessGroup:
    """A ``backend`` group over ``world``'s ranks for ``purpose``, made on first use (only
    ``world``'s members take part) and kept for the job: made anew once the job's default
    group is a new one (the process joined again after ``destroy_process_group``, which
    destroyed the old groups). Every rank of ``world`` must call this at the same point."""
    ranks = tuple(dist.get_process_group_ranks(world.group))
    key = (purpose, backend, ranks, timeout)
    made = _MADE.get(key)
    if made is None or made[0] is not dist.group.WORLD:
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout, use_local_synchronization=True)
        made = _MADE[key] = (dist.group.WORLD, group)
    return made[1]


def side_world(world: World) -> World:
    """A second process group over ``world``'s ranks (one per rank list, created once), so
    that collectives issued on it are ordered independently of those on ``world`` (stage 3
    issues param gathers on it, grad reductions on ``world``). Only ``world``'s members
    take part in creating it."""
    if world.group is None:
        return world
    return World(made_group("side", world, world.backend), world.rank, world.size, world.timeout)


def timed_group(world: World) -> ProcessGroup | None:
    """A gloo group over ``world``'s ranks whose every collective has ``world``'s deadline,
    for the collectives flatshard hands to another library (``torch.distributed.checkpoint``
    issues its own, with no per-op options). Created once per job, ranks and deadline; every
    rank of ``world`` must call this at the same point."""
    if world.group is None or world.timeout is None:
        return world.group
    return made_group("timed", world, "gloo", world.timeout)


def _device_mesh_type() -> type | None:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    return DeviceMesh


def check_ranks_agree(world: World, description: list[str], what: str, among: str = "") -> None:
    """Raise on every rank if ranks' ``description`` lines differ, naming the first difference.
    ``among``: compare only ranks whose ``among`` is equal (those holding the same params, when
    a pipeline's stages hold different ones), each with the first of them.

    One all-gather of two 64-bit digests in the common case; the lines themselves are
    exchanged only when the digests disagree.
    """
    if world.group is None:
        return
    digests = [hashlib.sha256(text.encode()).digest()[:8] for text in (among, "\n".join(description))]
    mine = torch.tensor(
        [int.from_bytes(d, "little", signed=True) for d in digests],
        dtype=torch.int64,
        device=world.control_device,
    )
    everyone = [tuple(t.tolist()) for t in _all_gather(mine, world)]
    first: dict[int, int] = {}  # each kind of rank's reference: the lowest rank of that kind
    for rank, (kind, _) in enumerate(everyone):
        first.setdefault(kind, rank)
    if all(everyone[first[kind]][1] == digest for kind, digest in everyone):
        return
    lines = [blob.decode().split("\n") for blob in all_gather_bytes("\n".join(description).encode(), world)]
    for rank, (kind, _) in enumerate(everyone):
        ref_rank = first[kind]
        ref, other = lines[ref_rank], lines[rank]
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else "<nothing>"
            b = other[i] if i < len(other) else "<nothing>"
            if a != b:
                raise ValueError(
                    f"ranks disagree on {what}: rank {rank} has {b!r} where rank {ref_rank} has {a!r}"
                )
    raise AssertionError("digests differ but descriptions are equal")  # pragma: no cover


def all_gather_bytes(data: bytes, world: World) -> list[bytes]:
    """Every rank's ``data``, in rank order (``all_gather_object`` without its numpy need)."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    everyone = all_gather_varied(mine.to(world.control_device), world)
    return [bytes(t.tolist()) for t in everyone]


def all_gather_varied(tensor: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` (of any length; the same dtype and device on all), in rank
    order, within ``world``'s deadline."""
    sizes = _all_gather(torch.tensor([tensor.numel()], dtype=torch.int64, device=world.control_device), world)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
    mine[: tensor.numel()] = tensor
    everyone = _all_gather(mine, world)
    return [t[: int(n)] for t, n in zip(everyone, sizes, strict=True)]


def _all_gather(tensor: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all), within ``world``'s deadline."""
    everyone = [torch.empty_like(tensor) for _ in range(world.size)]
    work = world.pg.allgather([everyone], [tensor], world.options(AllgatherOptions))
    world.watch(work, "all_gather (control)").wait()
    return everyone
