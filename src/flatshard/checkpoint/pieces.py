"""``torch.distributed.checkpoint`` planners for flat pieces of 1-D tensors.

See [Note: checkpoints] in ``checkpoint/directory.py``. Every tensor a flatshard checkpoint stores is
the flattened 1-D view of a param-shaped tensor (a param, a main param, a state entry),
keyed by the param's name. A rank contributes ``Piece``s: its range ``[offset, offset +
numel)`` of that 1-D tensor, backed by a view of its own storage (a shard, a run of the
inner optimizer). DCP's resharding does the rest: a load asks for the ranges *this* layout
holds, and DCP reads exactly the overlapping parts of whatever pieces were saved, so a
checkpoint written at any world size, stage or bucket size loads at any other.

Plain tensors and other objects in the same state dict go through DCP's default planners
(plain tensors replicated on several ranks are written once; objects under per-rank keys
by their rank).

The reasoning is [Note: checkpoint checksums] below."""

# [Note: checkpoint checksums]
# Every item DCP writes (a piece, an object) passes through ``Crc32Trailer`` on its way to
# the file: the CRC-32 of its bytes is computed as they are written, with no second pass, and
# stored as 4 bytes right after them; DCP's metadata records the trailer's descriptor with the
# item. A read of an item checks the trailer before DCP unpickles anything, and a mismatch is
# a ``ChecksumError`` naming the file, the key and the byte range. Items written before the
# trailer existed carry no descriptor and load unchecked.
#
# A trailer also binds its item to its save and its place ([Note: checkpoints] in
# ``checkpoint/directory.py``): since version 2 the CRC starts not from 0 but from
# ``binding(save_id, key, offset)``, the save's id (in ``flatshard.json``) and the item's index.
# A piece file left by another save of the same model, or two files of equal size swapped,
# then fail their checks exactly as corrupted bytes do, naming the file and the key. Version-1
# trailers (unbound) still load. A failure on any rank, in a save or
# a load, reaches every rank as one ``CheckpointError`` that names each failing rank's cause
# (DCP's own ``CheckpointException`` is a ``BaseException``, which ``except Exception`` misses).

from __future__ import annotations

import dataclasses
import io
import os
import struct
import warnings
import zlib
from typing import IO, Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from flatshard.errors import CheckpointError, ChecksumError, DesyncError


class Piece(NamedTuple):
    """Elements ``[offset, offset + tensor.numel())`` of a 1-D tensor of ``numel`` elements;
    with ``runs``, elements ``[start, start + hi - lo)`` for each ``(start, lo, hi)`` of
    them, held by ``tensor[lo:hi]`` (a tensor-parallel shard, whose elements are runs of the
    full param: ``global_runs`` in ``engine/tensor_parallel.py``)."""

    numel: int
    offset: int
    tensor: torch.Tensor  # 1-D, contiguous: the data to write, or where a load puts it
    runs: tuple[tuple[int, int, int], ...] = ()

    def parts(self) -> list[tuple[int, torch.Tensor]]:
        """(offset in the 1-D tensor, the elements there) of each contiguous part."""
        if not self.runs:
            return [(self.offset, self.tensor)]
        return [(start, self.tensor[lo:hi]) for start, lo, hi in self.runs]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([part.numel()]))
            for start, part in self.parts()
        ]

    def at(self, offset: int) -> torch.Tensor:
        """The part that starts at ``offset``."""
        return next(part for start, part in self.parts() if start == offset)


def split_pieces(state_dict: dict[str, Any]) -> tuple[dict[str, Piece], dict[str, Any]]:
    pieces = {k: v for k, v in state_dict.items() if isinstance(v, Piece)}
    rest = {k: v for k, v in state_dict.items() if not isinstance(v, Piece)}
    return pieces, rest


class PieceSavePlanner(DefaultSavePlanner):
    """Writes each ``Piece`` as a shard of its 1-D tensor; everything else as DCP does."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces: dict[str, Piece] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.pieces, rest = split_pieces(state_dict)
        super().set_up_planner(rest, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(piece.tensor),
                    size=torch.Size([piece.numel]),
                ),
            )
            for fqn, piece in self.pieces.items()
            for chunk in piece.chunks()
            if chunk.sizes[0] > 0
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        piece = self.pieces.get(write_item.index.fqn)
        if piece is not None:
            assert write_item.index.offset is not None  # (every piece's item has its offset)
            return piece.at(write_item.index.offset[0]).detach()
        return super().resolve_data(write_item)


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into each ``Piece`` the saved elements of its range; everything else as DCP
    does. A key the checkpoint lacks, or whose size differs, is an error naming it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces: dict[str, Piece] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.target = state_dict
        self.pieces, rest = split_pieces(state_dict)
        super().set_up_planner(rest, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        """Objects land in the caller's state dict, in place of their placeholders, their
        tensors on the host."""
        # (on the host: tensors saved from a device, e.g. a callback's best score, would come
        # back on the saving rank's, which this rank may not have or not own)
        self.target[read_item.dest_index.fqn] = torch.load(value, weights_only=False, map_location="cpu")

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        assert self.metadata is not None  # (set_up_planner ran: DCP's load sets it first)
        saved = self.metadata.state_dict_metadata
        for fqn, piece in self.pieces.items():
            if piece.numel == 0:
                continue  # a tensor of no elements: nothing was written, nothing to read
            md = saved.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"the checkpoint has no tensor {fqn!r}")
            if tuple(md.size) != (piece.numel,):
                saved_size = tuple(md.size)
                raise ValueError(f"{fqn!r} has size {saved_size} in the checkpoint, ({piece.numel},) here")
            chunks = [c for c in piece.chunks() if c.sizes[0] > 0]
            if chunks:
                items += create_read_items_for_chunk_list(fqn, md, chunks)
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        piece = self.pieces.get(index.fqn)
        if piece is not None:
            return piece.at(index.offset[0]) if index.offset is not None else piece.tensor
        return super().lookup_tensor(index)


# -- checksums -----------------------------------------------------------------------------------
DESCRIPTOR = "flatshard.crc32/1"  # recorded with each item in DCP's metadata: unbound
BOUND = "flatshard.crc32/2"  # the CRC starts from the item's binding to its save and index


def binding(save_id: str, index: MetadataIndex) -> int:
    """The CRC-32 an item's trailer starts from: its save's id, its key and its offset."""
    offset = None if index.offset is None else tuple(index.offset)
    return zlib.crc32(f"{save_id}\0{index.fqn}\0{offset}".encode())


class _CrcWriter(io.RawIOBase):
    """Passes bytes through to ``output``, then appends their CRC-32 (started from
    ``seed``) when closed."""

    def __init__(self, output: IO[bytes], seed: int = 0) -> None:
        super().__init__()
        self.output = output
        self.crc = seed

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self.output.write(b)

    def close(self) -> None:
        if not self.closed:
            self.output.write(struct.pack("<I", self.crc))
            self.output.close()  # DCP's wrapper: flushes the file, leaves it open
        super().close()


class Crc32Trailer(StreamTransformExtension):
    """An item's bytes followed by their CRC-32 (little-endian, 4 bytes)."""

    @staticmethod
    def registry_name() -> str:
        return DESCRIPTOR.split("/")[0]

    @staticmethod
    def from_descriptor(version: str) -> Crc32Trailer:
        if version != "1":
            raise CheckpointError(
                f"unknown checksum version flatshard.crc32/{version} (this flatshard reads 1)"
            )
        return Crc32Trailer()

    def get_descriptor(self) -> str:
        return DESCRIPTOR

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _CrcWriter(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        data = input.read(-1)
        if not trailer_intact(data):
            raise ChecksumError("the bytes read do not match the checksum written with them")
        return io.BytesIO(data[:-4])


def trailer_intact(data: bytes, seed: int = 0) -> bool:
    """Whether one stored item (its bytes, then their CRC-32 started from ``seed``) is as written."""
    return len(data) >= 4 and zlib.crc32(memoryview(data)[:-4], seed) == struct.unpack("<I", data[-4:])[0]


def item_seed(descriptors, save_id: str | None, index: MetadataIndex) -> int | None:
    """What an item's trailer starts from (None: it has no trailer)."""
    descriptors = tuple(descriptors or ())
    if BOUND in descriptors:
        if save_id is None:
            raise CheckpointError(f"{index.fqn!r} is bound to a save, but the manifest names no save id")
        return binding(save_id, index)
    return 0 if DESCRIPTOR in descriptors else None


def mismatch(path: str, info, key: str) -> ChecksumError:
    """The error for item ``key`` of checkpoint ``path`` whose bytes (``info``: DCP's
    storage info) do not match their trailer."""
    where = os.path.join(path, info.relative_path)
    span = f"bytes {info.offset}..{info.offset + info.length}"
    return ChecksumError(
        f"{where}: {key!r} ({span}) does not match the checksum written with it: corrupted, or "
        "the file belongs to another save"
    )


class _NamingTransforms(_StorageReaderTransforms):
    """DCP's read transforms, with each item checked against its trailer (bound to save
    ``save_id`` and the item's index) and a mismatch named by file, key and byte range."""

    def __init__(self, reader: dcp.FileSystemReader, save_id: str | None) -> None:
        registry = ExtensionRegistry()
        registry.register(Crc32Trailer)
        super().__init__(registry)
        self.reader, self.save_id = reader, save_id

    def transform_load_stream(self, read_item: ReadItem, transform_descriptors, raw_stream):
        index = read_item.storage_index
        seed = item_seed(transform_descriptors, self.save_id, index)
        if seed is None:  # no trailer (written before checksums)
            return super().transform_load_stream(read_item, transform_descriptors, raw_stream)
        data = raw_stream.read(-1)
        if not trailer_intact(data, seed):
            raise mismatch(str(self.reader.path), self.reader.storage_data[index], index.fqn)
        return io.BytesIO(data[:-4])


class _BindingTransforms(_StorageWriterTransforms):
    """Each item's bytes followed by their CRC-32 started from ``binding(save_id, index)``."""

    def __init__(self, save_id: str) -> None:
        super().__init__(())
        self.save_id = save_id

    def transform_save_stream(self, write_item: WriteItem, raw_stream):
        stream, _ = super().transform_save_stream(write_item, raw_stream)
        return _CrcWriter(stream, binding(self.save_id, write_item.index)), [BOUND]


def reader(path: str, save_id: str | None = None) -> dcp.FileSystemReader:
    """A DCP reader of ``path`` that checks every item's checksum trailer (bound to save
    ``save_id``, the id in the checkpoint's manifest)."""
    out = dcp.FileSystemReader(path)
    out.transforms = _NamingTransforms(out, save_id)
    return out


def _rank_failures(error: CheckpointException, action: str, path: str) -> CheckpointError:
    causes = {rank: exc for rank, (exc, _) in sorted(error.failures.items())}
    lines = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in causes.items())
    kind = ChecksumError if any(isinstance(e, ChecksumError) for e in causes.values()) else CheckpointError
    return kind(f"{action} {path} failed on rank(s) {sorted(causes)}: {lines}")


METADATA = ".metadata"  # DCP's index of the items: where each one lies, in which file

# DCP warns on every single-process call that it is "assuming the intent": it is ours.
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def save(state_dict: dict[str, Any], path: str, *, save_id: str, group=None, single_process: bool) -> None:
    """``state_dict`` (``Piece``s and anything else) into checkpoint directory ``path``,
    every item bound to save ``save_id``; DCP's collectives run on ``group``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        writer = dcp.FileSystemWriter(path)
        writer.transforms = _BindingTransforms(save_id)
        try:
            dcp.save(
                state_dict,
                storage_writer=writer,
                planner=PieceSavePlanner(),
                process_group=group,
                no_dist=single_process,
            )
        except CheckpointException as e:
            raise _rank_failures(e, "saving", path) from None
        except RuntimeError as e:  # one of DCP's collectives failed: a rank stopped, or ran past the deadline
            raise _collective_failure(e, "saving", path) from e


def load(
    state_dict: dict[str, Any], path: str, *, save_id: str | None, group=None, single_process: bool
) -> None:
    """Fill ``state_dict``'s ``Piece``s, tensors and placeholders from checkpoint ``path``
    (of save ``save_id``); DCP's collectives run on ``group``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        try:
            dcp.load(
                state_dict,
                storage_reader=reader(path, save_id),
                planner=PieceLoadPlanner(),
                process_group=group,
                no_dist=single_process,
            )
        except CheckpointException as e:
            raise _rank_failures(e, "loading", path) from None
        except RuntimeError as e:
            raise _collective_failure(e, "loading", path) from e


def _collective_failure(error: RuntimeError, action: str, path: str) -> DesyncError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DesyncError(
        f"{action} {path}: a collective of torch.distributed.checkpoint failed on this rank, past "
        f"the deadline or because a rank stopped (every rank must save and load together): {first}"
    )
