"""``torch.distributed.checkpoint`` planners for flat pieces of 1-D tensors.

See [Note: checkpoints] in docs/design.md. Every tensor a flatshard checkpoint stores is
the flattened 1-D view of a param-shaped tensor (a param, a main param, a state entry),
keyed by the param's name. A rank contributes ``Piece``s: its range ``[offset, offset +
numel)`` of that 1-D tensor, backed by a view of its own storage (a shard, a run of the
inner optimizer). DCP's resharding does the rest: a load asks for the ranges *this* layout
holds, and DCP reads exactly the overlapping parts of whatever pieces were saved, so a
checkpoint written at any world size, stage or bucket size loads at any other.

Plain tensors and other objects in the same state dict go through DCP's default planners
(plain tensors replicated on several ranks are written once; objects under per-rank keys
by their rank).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
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


class Piece(NamedTuple):
    """Elements ``[offset, offset + tensor.numel())`` of a 1-D tensor of ``numel`` elements."""

    numel: int
    offset: int
    tensor: torch.Tensor  # 1-D, contiguous: the data to write, or where a load puts it

    def chunk(self) -> ChunkStorageMetadata:
        sizes = torch.Size([self.tensor.numel()])
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=sizes)


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
                index=MetadataIndex(fqn, torch.Size([piece.offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=piece.chunk(),
                    properties=TensorProperties.create_from_tensor(piece.tensor),
                    size=torch.Size([piece.numel]),
                ),
            )
            for fqn, piece in self.pieces.items()
            if piece.tensor.numel() > 0
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        piece = self.pieces.get(write_item.index.fqn)
        if piece is not None:
            return piece.tensor.detach()
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
        """Objects land in the caller's state dict, in place of their placeholders."""
        self.target[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        saved = self.metadata.state_dict_metadata
        for fqn, piece in self.pieces.items():
            md = saved.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"the checkpoint has no tensor {fqn!r}")
            if tuple(md.size) != (piece.numel,):
                saved_size = tuple(md.size)
                raise ValueError(f"{fqn!r} has size {saved_size} in the checkpoint, ({piece.numel},) here")
            if piece.tensor.numel() > 0:
                items += create_read_items_for_chunk_list(fqn, md, [piece.chunk()])
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        piece = self.pieces.get(index.fqn)
        if piece is not None:
            return piece.tensor
        return super().lookup_tensor(index)


# DCP warns on every single-process call that it is "assuming the intent": it is ours.
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def save(state_dict: dict[str, Any], path: str, *, single_process: bool) -> None:
    """``state_dict`` (``Piece``s and anything else) into checkpoint directory ``path``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        writer = dcp.FileSystemWriter(path)
        dcp.save(state_dict, storage_writer=writer, planner=PieceSavePlanner(), no_dist=single_process)


def load(state_dict: dict[str, Any], path: str, *, single_process: bool) -> None:
    """Fill ``state_dict``'s ``Piece``s, tensors and placeholders from checkpoint ``path``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        reader = dcp.FileSystemReader(path)
        dcp.load(state_dict, storage_reader=reader, planner=PieceLoadPlanner(), no_dist=single_process)
