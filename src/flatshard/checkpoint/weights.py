"""Plain weights in and out of flatshard: ``export_checkpoint`` turns a sharded checkpoint
into one state dict file; ``load_weights`` seeds a sharded model from one.

Both stream: an export reads the checkpoint a bounded number of bytes at a time (DCP reads
exactly the requested ranges of the saved pieces) and writes each tensor as it arrives
(``checkpoint.files``); a load reads, on each rank, only the ranges of each tensor that the rank
holds (its shards at stage 3, whole params below) and writes them in place, through the
same ``Piece`` destinations as ``load_checkpoint``. No rank ever holds the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from flatshard.checkpoint import pieces
from flatshard.checkpoint import state as cs
from flatshard.checkpoint.directory import read_manifest, resolve_checkpoint
from flatshard.checkpoint.files import Entry, Source, open_source, write_state_file
from flatshard.checkpoint.pieces import Piece
from flatshard.engine.dynamo import uncompiled
from flatshard.engine.tensor_parallel import refuse_tensor_parallel
from flatshard.optim.distributed import DistributedOptimizer

DEFAULT_CHUNK_BYTES = 256 * 2**20
PRETRAINED_INSTEAD = (
    "full tensors would land in tp-sharded params. Load them into the model before "
    "parallelize_module (every rank the same values), or resume from a flatshard checkpoint"
)
WEIGHTS = ("main", "model")


# -- export ---------------------------------------------------------------------------------------
PEFT_PREFIX = "base_model.model."
"""How a peft model's names begin ([Note: pretrained directories] in ``pretrained.py``)."""
READ_BY_FROM_PRETRAINED = (
    "model.safetensors",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    weights: str = "main",
    dtype: torch.dtype | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[Entry]:
    """Write the model of ``checkpoint`` (saved at any world size and stage) as one plain
    state dict, ``out`` ending in ``.safetensors`` or ``.pt``, that the unwrapped
    ``nn.Module`` loads with ``load_state_dict`` (tied params appear under each name).

    ``weights="main"`` takes each param's fp32 main param where the checkpoint has one (the
    values the optimizer updates), ``"model"`` the params as the model held them.
    ``dtype`` casts floating-point tensors. At most ``chunk_bytes`` (or one saved piece, if
    larger) are read at a time. Runs on one process; returns what was written.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    path = resolve_checkpoint(checkpoint)
    manifest = read_manifest(path)
    _refuse_peft_for_from_pretrained(path, manifest["params"], os.fspath(out))
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    entries: dict[str, Entry] = {}
    for name, (shape, _) in manifest["params"].items():
        key = cs.MAIN + name if weights == "main" and cs.MAIN + name in saved else cs.MODEL + name
        if key not in saved:
            raise ValueError(f"checkpoint {path} is corrupted: it has no data for {name!r}")
        stored_meta = saved[key]
        if not isinstance(stored_meta, TensorStorageMetadata):
            raise ValueError(f"checkpoint {path} is corrupted: its data for {name!r} is not a tensor")
        stored = stored_meta.properties.dtype
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        entries[name] = Entry(name, tuple(shape), cast, key)
    for alias, name in manifest.get("aliases", {}).items():
        entries[alias] = entries[name]._replace(name=alias)
    listed = list(entries.values())
    write_state_file(
        os.fspath(out), listed, partial(_read_checkpoint, path, manifest.get("save_id"), saved, chunk_bytes)
    )
    return listed


def _refuse_peft_for_from_pretrained(path: str, names: Mapping[str, Any], out: str) -> None:
    """A peft model's names under a file name ``from_pretrained`` reads would match none of the
    names it looks for: it would load a random-init model (or adapter) without failing."""
    peft = bool(names) and all(name.startswith(PEFT_PREFIX) for name in names)
    if peft and os.path.basename(out) in READ_BY_FROM_PRETRAINED:
        raise ValueError(
            f"checkpoint {path} holds a peft model (its names start with {PEFT_PREFIX!r}), and "
            f"{os.path.basename(out)!r} is a file from_pretrained reads: it would find none of the names it "
            "expects and load random weights. Load the checkpoint into the sharded peft model and write "
            "flatshard.save_pretrained(model, directory) (the adapter) or save_pretrained(..., merged=True) "
            "(the base model with the adapter merged); or export under another name, for "
            "peft_model.load_state_dict"
        )


def _read_checkpoint(
    path: str, save_id: str | None, saved: dict[str, Any], chunk_bytes: int, entries: list[Entry]
) -> Iterator[tuple[Entry, torch.Tensor]]:
    """Each entry's data in order, as 1-D chunks of at most ``chunk_bytes``, read from the
    checkpoint a batch of chunks at a time."""
    batch: dict[str, Piece] = {}
    order: list[tuple[Entry, Piece]] = []
    held = 0
    for entry in entries:
        stored = saved[entry.source].properties.dtype
        step = max(1, chunk_bytes // stored.itemsize)
        for lo in range(0, max(entry.numel, 1), step):
            hi = min(entry.numel, lo + step)
            if entry.source in batch or (order and held + (hi - lo) * stored.itemsize > chunk_bytes):
                yield from _load_batch(path, save_id, batch, order)
                held = 0
            piece = Piece(entry.numel, lo, torch.empty(hi - lo, dtype=stored))
            if hi > lo:
                batch[entry.source] = piece
            order.append((entry, piece))
            held += (hi - lo) * stored.itemsize
    yield from _load_batch(path, save_id, batch, order)


def _load_batch(
    path: str, save_id: str | None, batch: dict[str, Piece], order: list
) -> Iterator[tuple[Entry, torch.Tensor]]:
    if batch:
        pieces.load(batch, path, save_id=save_id, single_process=True)
    for entry, piece in order:
        yield entry, piece.tensor.to(entry.dtype)
    batch.clear()
    order.clear()


# -- import ---------------------------------------------------------------------------------------
@torch.no_grad()
def load_weights(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Seed ``model`` (sharded at any stage, or plain) from a plain state dict: a
    ``.safetensors`` or ``.pt`` file, sharded ``.safetensors`` files by their
    ``*.index.json``, a directory written by Hugging Face's ``save_pretrained`` (its
    ``model.safetensors`` or index), or a dict of tensors. Every rank calls it and reads only
    the parts of each tensor it holds.

    The optimizer's fp32 main params (``optimizer``, else the model's
    ``DistributedOptimizer``) take the source's values at the source's precision, not
    rounded through 16-bit params. Returns ``(missing, unexpected)`` names; with
    ``strict`` either is an error. Names of tied params may appear or not.
    """
    refuse_tensor_parallel(model, "flatshard.load_weights", PRETRAINED_INSTEAD)
    return load_source(model, open_source(source), optimizer, strict=strict)


@torch.no_grad()
def load_source(
    model: nn.Module, src: Source, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """``load_weights`` from an opened source."""
    model = uncompiled(model)
    shapes = {name: shape for name, (shape, _) in src.shapes.items()}
    missing, unexpected = cs.check_shapes(model, shapes, src.description, strict=strict)
    state = getattr(model, "flatshard_state", None)
    optimizer = optimizer if optimizer is not None else getattr(state, "optimizer", None)
    with cs.param_dtype_shards(model, loading=True):
        _copy(src, cs.model_pieces(model, load=True), cs.MODEL)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.reload_model_params()
            _copy(src, {key: piece for key, piece, _ in cs.main_pieces(optimizer)}, cs.MAIN)
            optimizer.main_params_changed()
        elif optimizer is not None and hasattr(optimizer, "masters"):
            cast(Any, optimizer).reload_model_params()  # (a HybridDeviceOptimizer: host masters)
            names = cs.param_names(model)
            masters = optimizer.masters().items()
            _copy(src, {cs.MAIN + names[id(p)]: Piece(p.numel(), 0, m.view(-1)) for p, m in masters}, cs.MAIN)
    return missing, unexpected


def _copy(src: Source, destinations: Mapping[str, Any], prefix: str) -> None:
    """Fill each piece (keyed ``prefix + name``) from the same range of the source's tensor."""
    for key, piece in destinations.items():
        name = key.removeprefix(prefix)
        count = piece.tensor.numel()
        if name in src.shapes and count:
            piece.tensor.copy_(src.read(name, piece.offset, piece.offset + count))
