"""Sharded checkpoints that load at any world size and stage: ``save_checkpoint`` and
``load_checkpoint``.

Both are collective: every rank of the default
process group calls them with its own model and optimizer. A checkpoint is a directory
(``torch.distributed.checkpoint`` files plus ``flatshard.json``) that appears under its
name only once it is complete. Objects in it (``extra``, param groups) are pickled: load
only checkpoints you trust, as with ``torch.load(weights_only=False)``.

The reasoning is [Note: checkpoints] below."""

# [Note: checkpoints]
#
# A checkpoint is a DCP directory plus ``flatshard.json``. Invariants:
#
# * **Keyed by name, stored flat.** Every param-shaped tensor is stored as the 1-D view of the
#   whole tensor under ``model/<name>`` (the param, in its dtype), ``main/<name>`` (fp32 main
#   param, where one exists) and ``state/<key>/<name>`` (an elementwise optimizer state
#   entry); a scalar entry (``step``) is a 0-d tensor under ``state/<key>/<name>``. Param
#   groups are stored by member names, with their hyperparameters. Nothing in the file depends
#   on the world size, stage, bucket size or optimizer class that wrote it.
# * **Each element is written once, by a rank that holds it.** A rank writes the pieces of its
#   shards (stages 1-3, and the distributed optimizer's state and main params); data every
#   rank holds (stage-0 params, a replicated optimizer's state) is split evenly and each rank
#   writes its part; an owner-sharded optimizer's owner writes its params' state. No rank
#   gathers anything.
# * **Loads read exactly what the new layout holds**, straight into its storage (param shards,
#   main-param shards); optimizer state is read into tensors of the inner optimizer's runs and
#   handed to its own ``load_state_dict``, so lazily created state and device/dtype casts
#   follow torch's rules. Elements of a run outside every param (padding) are zero, as they
#   are in training.
# * **A checkpoint is visible only when complete**: the ranks write ``PATH.partial``; after
#   every rank has finished, rank 0 writes ``flatshard.json`` (the world size, stage, every
#   param's shape and dtype, every file's size) into it, and renames it to ``PATH`` (the
#   previous checkpoint first moves to ``PATH.old``, removed last). A save killed at any
#   moment leaves ``PATH`` or, between the two renames, ``PATH.old`` complete;
#   ``load_checkpoint(PATH)`` falls back to ``PATH.old`` when ``PATH`` is missing.
# * **A checkpoint is one save.** Rank 0 holds ``PATH.lock`` for the whole save, so a second
#   save to ``PATH`` at once (another job, another thread) is refused before it writes; every
#   rank must name the same ``PATH``. The save's id (rank 0's, shared with the destination
#   check) is in the manifest, and every item's checksum trailer is bound to it and to the
#   item's key and offset ([Note: checkpoint checksums]): a file of another save, or files
#   swapped, fail as corrupted ones do. A load checks that every rank opened the same save.
#   ``extra`` is saved per rank and comes back to its own rank; at another world size only
#   values the saved ranks shared load, and one they did not is an error naming its key. Loading
#   checks the manifest against the model (a missing or extra param, a shape) and the files
#   against their sizes before reading, and every piece against its checksum as it reads it
#   ([Note: checkpoint checksums]), and names what is wrong. A save touches only what it wrote
#   ([Note: save destinations] in ``checkpoint/destination.py``).
# * **Resume is exact at the same layout**: params, fp32 main params and state round-trip bit
#   for bit; per-rank RNG states are restored when the world size is the same.
# * **Tied params** are stored once, under their first name; the manifest lists every further
#   name (``aliases``) so that an export can write each name the module's ``state_dict`` has.
# * **Export and import stream** (``checkpoint/weights.py``, ``checkpoint/files.py``). An
#   export reads ``main/<name>`` (else ``model/<name>``) in chunks of at most ``chunk_bytes``
#   through the same piece planner (DCP reads only the overlapping parts of the saved pieces,
#   so memory is bounded by the chunk and the largest saved piece) and writes each chunk where
#   it belongs: a ``.safetensors`` header is known from the manifest alone; a ``.pt`` file is
#   laid out first by ``torch.save`` under ``skip_data`` over fake tensors, then each storage
#   is ``pwrite``n into its zip record and its CRC-32 patched into the data descriptor and
#   central directory (so the file passes ``zipfile.testzip``). Both are written to
#   ``OUT.partial`` and renamed. An import (``load_weights``) fills the same destinations a
#   checkpoint load does (this rank's model pieces, then the main-param pieces at the source's
#   precision), reading only those ranges of the file.

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import random
import uuid
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from flatshard.checkpoint import background, pieces, snapshot
from flatshard.checkpoint import state as cs
from flatshard.checkpoint.chunks import Part, check_covered, chunk_parts, united_groups, whole_model
from flatshard.checkpoint.destination import (
    FORMAT,
    MANIFEST,
    PARTIAL_MARK,
    destination_problem,
    publish,
    remove_saved,
    save_lock,
)
from flatshard.checkpoint.files import verify_state_file
from flatshard.comm.collectives import barrier
from flatshard.comm.deadline import HERE, Phase
from flatshard.comm.trace import span
from flatshard.comm.world import World, all_gather_bytes, check_ranks_agree, timed_group
from flatshard.errors import CheckpointError, ChecksumError
from flatshard.optim.composite import unwrap_optimizer
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.wrap.module import job_world

EXTRA = "extra"


def _stage(model: nn.Module) -> int | None:
    state = getattr(model, "flatshard_state", None)
    return None if state is None else state.stage


def _device(model: nn.Module) -> torch.device:
    """Where ``model`` lives: a sharded model's buffers' device, else its first param's."""
    state = getattr(model, "flatshard_state", None)
    return state.device if state is not None else next(iter(model.parameters())).device


def _optimizer_entries(model, optimizer, *, load: bool, saved=None):
    if optimizer is None:
        return {}, None
    optimizer = unwrap_optimizer(optimizer)  # (accelerate's wrapper: the optimizer it prepared)
    if isinstance(optimizer, DistributedOptimizer):
        if load:
            return cs.distributed_optimizer_to_load(optimizer, saved)
        optimizer.check_settings()  # ranks that drifted apart must not save a mix of both
        return cs.distributed_optimizer_to_save(optimizer), None
    state = getattr(model, "flatshard_state", None)
    if state is not None and state.policy.shards_optimizer:
        raise TypeError(
            f"at stage {state.stage} checkpoints need the model's DistributedOptimizer, got "
            f"{type(optimizer).__name__}"
        )
    if load:
        return cs.param_optimizer_to_load(optimizer, model, saved)
    return cs.param_optimizer_to_save(optimizer, model), None


# -- extra: the rest of a run ---------------------------------------------------------------------
def _rng_state(device: torch.device) -> dict[str, Any]:
    """The generators this rank draws from: the host's, and its model's device's (only that
    one: a rank that resumes on another index, or on a node with fewer devices, gets back the
    stream it drew from)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):  # (saved before 2026-11-30: every visible device's)
        cuda = cuda[device.index] if device.type == "cuda" and device.index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _extra_to_save(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Objects with ``state_dict()`` (schedulers, scalers, samplers) are saved by their state."""
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in (extra or {}).items()}


def _extra_keys(saved: Mapping[str, Any], rank: int, same_world: bool) -> list[str]:
    """Which saved ``extra`` entries this rank reads: its own rank's at the same world size,
    else every saved rank's (to tell values all ranks shared from per-rank ones)."""
    if EXTRA in saved:  # (saved before extra was per rank)
        return [EXTRA]
    if same_world:
        return [f"{EXTRA}/{rank}"]
    return sorted((k for k in saved if k.startswith(EXTRA + "/")), key=lambda k: int(k.split("/")[1]))


def _restore_extra(
    path: str, read: dict[str, dict], saved_size: int, size: int, targets: Mapping[str, Any] | None
) -> dict[str, Any]:
    """This rank's ``extra``, each of ``targets`` with ``load_state_dict`` loaded from it. At
    another world size a value the saved ranks did not share (a data loader's position, say)
    belongs to no rank here: an error naming it, not another rank's value."""
    (first, *others) = read.values()
    for key, value in first.items():
        differ = [i + 1 for i, other in enumerate(others) if not _same_value(other.get(key), value)]
        if differ:
            raise CheckpointError(
                f"checkpoint {path}: extra[{key!r}] differs between the {saved_size} saved ranks "
                f"(rank 0's differs from rank(s) {differ}), and this job has {size} ranks, so no "
                "saved rank's value is this rank's. Resume at the saved world size, or save a "
                "value that every rank shares under that key"
            )
    for key, target in (targets or {}).items():
        if key not in first:
            raise KeyError(f"checkpoint {path} has no extra entry {key!r} (it has {sorted(first)})")
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(first[key])
    return first


def _same_value(a: Any, b: Any) -> bool:
    """Equal values, tensors (inside dicts and sequences too) compared by dtype, shape and
    elements."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # no usable ==: compare what was saved
        return pickle.dumps(a) == pickle.dumps(b)


# -- saving ----------------------------------------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra=None,
    blocking: bool = True,
) -> None:
    """Save ``model`` and ``optimizer`` (every rank calls this) to directory ``path``.

    Each rank writes only what it holds; nothing is gathered. ``extra`` is a dict of
    picklable values or of objects with ``state_dict()`` (LR schedulers, samplers): the step,
    the data position, ... Every rank's RNG states are saved too. ``path`` appears only when
    the checkpoint is complete; a checkpoint already there is replaced only then. A rank
    running several pipeline chunks passes them as a list, and their optimizers as a list
    ([Note: checkpoints of pipeline chunks] in ``checkpoint/chunks.py``).

    ``blocking=False``: return once this rank's part is copied into host memory, and write it
    in the background while training goes on ([Note: background saves] in
    ``checkpoint/background.py``); the next save or load, or ``wait_for_checkpoint()``, waits
    for it and raises ``CheckpointError`` on every rank if it failed.
    """
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, got {blocking!r}")
    path, parts = os.fspath(path), chunk_parts(model, optimizer, "save_checkpoint")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict of values to save with the checkpoint, got {extra!r}")
    background.wait_for_checkpoint()
    with HERE.during(Phase.SAVE):
        _save(path, parts, extra, blocking)


def _save(path: str, parts: list[Part], extra, blocking: bool) -> None:
    """Agree, collect, write, seal.

    [Note: checkpoint pipelines]

    A save is four steps, each a function below and a ``flatshard::save <step>`` range in a
    profiler trace: **agree** (every rank names the same path, which rank 0 may write, under
    ``PATH.lock``; the save's id), **collect** (this rank's pieces: model, optimizer,
    ``extra``, RNG; nothing gathered), **write** (DCP writes them into ``PATH.partial``),
    **seal** (rank 0 writes the manifest and renames the directory into place). A load is
    four too, ``flatshard::load <step>``: **check** (the manifest, the files' sizes, the
    model's shapes; every rank opened the same save), **read** (the pieces this rank's
    layout holds, straight into its storage), **apply** (the optimizer's state through its
    own ``load_state_dict``) and **restore** (RNG states, ``extra``). In the background
    ([Note: background saves]), collect also stages, and a thread writes and seals."""
    world = job_world(parts[0][0])  # (checkpoints are collective over every rank)
    with contextlib.ExitStack() as held:
        lock_problem = held.enter_context(save_lock(path, world.rank == 0))
        with span("save agree"):
            save_id = _agree_on_destination(world, path, lock_problem, blocking)
        with _param_dtype_shards(parts):
            with span("save collect"):
                state, saved = _collect_whole(parts, extra, world)
            if not blocking:
                with span("save stage"):
                    state = background.stage(state)
                writer = background.writer_world(world)
                write = functools.partial(_write_and_seal, state, path, save_id, writer, saved)
                background.start(path, write, held.pop_all(), save_id, state)  # (the lock goes with it)
                return
            with span("save write"):
                partial = _write(state, path, save_id, world)
        with span("save seal"):
            _seal(partial, path, save_id, world, saved)


def _collect_whole(parts: list[Part], extra, world: World) -> tuple[dict[str, Any], tuple]:
    """This rank's state to write, and what the manifest says of the whole model: (model,
    optimizer, every param's shape, tied names)."""
    state = _collect(parts, extra, world.rank)
    shapes = {n: s for m, _ in parts for n, s in cs.model_shapes(m).items()}
    aliases = {a: n for m, _ in parts for a, n in cs.model_aliases(m).items()}
    params, aliases, groups = whole_model(world, shapes, aliases, state.get(cs.GROUPS))
    if cs.GROUPS in state:
        state[cs.GROUPS] = groups
    return state, (*parts[0], params, aliases)


def _write_and_seal(state: dict[str, Any], path: str, save_id: str, writer: World, saved: tuple) -> None:
    """A save's last two steps, on the writers' group ([Note: background saves])."""
    with span("save write"):
        partial = _write(state, path, save_id, writer, writer.group)
    with span("save seal"):
        _seal(partial, path, save_id, writer, saved)


def _param_dtype_shards(parts: list[Part], loading: bool = False) -> contextlib.ExitStack:
    """``cs.param_dtype_shards`` of every model of ``parts`` at once."""
    stack = contextlib.ExitStack()
    for model, _ in parts:
        stack.enter_context(cs.param_dtype_shards(model, loading))
    return stack


def _collect(parts: list[Part], extra, rank: int) -> dict[str, Any]:
    """What this rank writes: its models' pieces, their optimizers' entries (the param groups
    of several united), its ``extra`` and RNG."""
    state: dict[str, Any] = {}
    groups = []
    for model, optimizer in parts:
        part = cs.model_pieces(model, load=False)
        part.update(_optimizer_entries(model, optimizer, load=False)[0])
        cs.globalize(part, model)
        if cs.GROUPS in part:
            groups.append(part.pop(cs.GROUPS))
        state.update(part)
    if groups:
        state[cs.GROUPS] = united_groups(groups)
    state[f"{EXTRA}/{rank}"] = _extra_to_save(extra)
    state[f"rng/{rank}"] = _rng_state(_device(parts[0][0]))
    return state


def _write(state: dict[str, Any], path: str, save_id: str, world: World, group=None) -> str:
    """Every rank's pieces into ``PATH.partial`` (made afresh by rank 0, marked unfinished);
    returns that directory. DCP's collectives run on ``group`` (default: a gloo group with
    ``world``'s deadline)."""
    partial = path + ".partial"
    if world.rank == 0:
        if os.path.lexists(partial):
            remove_saved(partial, PARTIAL_MARK)
        os.makedirs(partial)
        open(os.path.join(partial, PARTIAL_MARK), "w").close()
    barrier(world)
    group = timed_group(world) if group is None else group
    pieces.save(state, partial, save_id=save_id, group=group, single_process=world.size == 1)
    return partial


def _seal(partial: str, path: str, save_id: str, world: World, saved: tuple) -> None:
    """Rank 0 writes the manifest (of ``saved``: model, optimizer, the whole model's params and
    tied names) and publishes ``partial`` as ``path``; the others wait."""
    if world.rank == 0:
        os.remove(os.path.join(partial, PARTIAL_MARK))
        model, optimizer, params, aliases = saved
        _write_manifest(partial, model, optimizer, params, aliases, world.size, save_id)
        publish(partial, path)
    barrier(world)


def _agree_on_destination(world: World, path: str, lock_problem: str | None, blocking: bool) -> str:
    """Every rank saves to the same ``path``, which rank 0 may write, the same way (blocking
    or in the background); returns the save's id (rank 0's)."""
    description = [f"path {os.path.abspath(path)}", f"blocking={blocking}"]
    check_ranks_agree(world, description, "the checkpoint path of one save (and whether it blocks)")
    problem = (lock_problem or destination_problem(path) or "") if world.rank == 0 else ""
    decision = f"{uuid.uuid4().hex}\n{problem}" if world.rank == 0 else ""
    if world.group is not None:
        decision = all_gather_bytes(decision.encode(), world)[0].decode()
    save_id, problem = decision.split("\n", 1)
    if problem:
        raise FileExistsError(problem)
    return save_id


def _write_manifest(
    directory: str, model: nn.Module, optimizer, params: dict, aliases: dict, world_size: int, save_id: str
) -> None:
    """``params`` and ``aliases``: the whole model's ([Note: checkpoints of pipeline chunks])."""
    files = {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}
    with open(os.path.join(directory, pieces.METADATA), "rb") as f:  # small: the index of the pieces
        metadata_crc = zlib.crc32(f.read())
    manifest = {
        "format": FORMAT,
        "save_id": save_id,
        "world_size": world_size,
        "stage": _stage(model),
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "params": params,
        "aliases": aliases,
        "files": files,
        "crc32": {pieces.METADATA: metadata_crc},
    }
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# -- loading ---------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> str:
    """The complete checkpoint behind ``path`` (``path.old`` if a save was killed between
    its renames); raises naming what is missing or incomplete."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        old = path + ".old"
        if os.path.isfile(os.path.join(old, MANIFEST)):
            warnings.warn(
                f"{path} is missing; loading {old}, left complete by a save that was cut off", stacklevel=3
            )
            return old
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MANIFEST} (its save did not finish)"
        )
    return path


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, once every file it lists has its written size
    (and the DCP index its written checksum); raises ``CheckpointError`` naming the file."""
    where = os.path.join(path, MANIFEST)
    try:
        with open(where) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupted: {where} is not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: unknown checkpoint format {found!r} (expected {FORMAT})")
    for name, size in manifest["files"].items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path} is corrupted: file {name} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {name} has {os.path.getsize(full)} bytes, "
                f"{size} when it was written"
            )
    for name, crc in manifest.get("crc32", {}).items():  # absent in checkpoints older than checksums
        with open(os.path.join(path, name), "rb") as f:
            if zlib.crc32(f.read()) != crc:
                raise ChecksumError(f"checkpoint {path} is corrupted: {name} does not match its checksum")
    return manifest


def verify_checkpoint(path: str | os.PathLike) -> dict[str, int]:
    """Check checkpoint directory ``path`` (or a ``.safetensors``/``.pt`` weights file)
    against the sizes and checksums written with it, without loading anything into a model.

    Returns counts: ``{"files": ..., "checked": ..., "unchecked": ...}`` (items written
    before checkpoints had checksums are unchecked). Raises ``ChecksumError`` naming the
    first file and key that differ, ``CheckpointError`` for anything else unreadable.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return {"files": 1, "checked": verify_state_file(path), "unchecked": 0}
    path = resolve_checkpoint(path)
    manifest = read_manifest(path)
    by_file: dict[str, list] = {}
    for index, info in pieces.reader(path).read_metadata().storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info, index))
    counts = {"files": len(manifest["files"]), "checked": 0, "unchecked": 0}
    for name, items in sorted(by_file.items()):
        with open(os.path.join(path, name), "rb") as f:
            for info, index in sorted(items, key=lambda item: item[0].offset):
                seed = pieces.item_seed(info.transform_descriptors, manifest.get("save_id"), index)
                if seed is None:
                    counts["unchecked"] += 1
                    continue
                f.seek(info.offset)
                if not pieces.trailer_intact(f.read(info.length), seed):
                    raise pieces.mismatch(path, info, index.fqn)
                counts["checked"] += 1
    return counts


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint saved at any world size and stage into ``model`` and ``optimizer``
    (every rank calls this); returns the saved ``extra`` dict.

    Each entry of ``extra`` that has ``load_state_dict`` (an LR scheduler, ...) is loaded
    from the saved value of the same key. RNG states are restored when the checkpoint was
    written by as many ranks as there are now (``restore_rng=False``: never). A rank running
    several pipeline chunks passes them as a list, and their optimizers as a list. A load of
    the last save made with ``blocking=False`` reads each rank's snapshot of it in host memory
    instead of the files, when every rank holds one for the same layout ([Note: save
    snapshots] in ``checkpoint/snapshot.py``).
    """
    if not isinstance(restore_rng, bool):
        raise TypeError(f"restore_rng must be True or False, got {restore_rng!r}")
    background.wait_for_checkpoint()
    path, parts = resolve_checkpoint(path), chunk_parts(model, optimizer, "load_checkpoint")
    with HERE.during(Phase.LOAD):
        return _load(path, parts, extra, restore_rng)


def _load(path: str, parts: list[Part], extra, restore_rng: bool) -> dict[str, Any]:
    """check -> read -> apply -> restore ([Note: checkpoint pipelines])."""
    world = job_world(parts[0][0])  # (checkpoints are collective over every rank)
    with span("load check"):
        manifest = _check(path, [model for model, _ in parts], world)
    rng = restore_rng and manifest["world_size"] == world.size
    with _param_dtype_shards(parts, loading=True):
        with span("load read"):
            state, finishes, extra_keys = _read(path, manifest, world, parts, rng)
        with span("load apply"):
            for finish in finishes:
                finish(state)
    with span("load restore"):
        if rng:
            _set_rng_state(state[f"rng/{world.rank}"], _device(parts[0][0]))
        read = {key: state[key] for key in extra_keys}
        return _restore_extra(path, read, manifest["world_size"], world.size, extra)


def _check(path: str, models: list[nn.Module], world: World) -> dict[str, Any]:
    """The manifest, once its files, the models' shapes and every rank's choice of save agree."""
    manifest = read_manifest(path)
    shapes = {n: shape for n, (shape, _) in manifest["params"].items()}
    held: set[str] = set()
    for model in models:
        cs.check_shapes(model, shapes, f"checkpoint {path}", others=True)
        held |= set(cs.model_shapes(model)) | set(cs.model_aliases(model))
    check_covered(world, shapes, held, f"checkpoint {path}")  # (by some rank: pipeline chunks)
    # Every rank loads the same save (within the deadline, before DCP's own collectives).
    save_id = manifest.get("save_id")
    which = f"save {save_id}" if save_id else f"checkpoint {os.path.abspath(path)}"
    try:
        check_ranks_agree(world, [which], "which checkpoint to load")
    except ValueError as e:  # (every rank raises: name the paths too, each with its ranks)
        paths: dict[str, list[int]] = {}
        for rank, blob in enumerate(all_gather_bytes(os.path.abspath(path).encode(), world)):
            paths.setdefault(blob.decode(), []).append(rank)
        named = "; ".join(f"{p} on ranks {ranks}" for p, ranks in paths.items())
        raise ValueError(f"{e}. The paths loaded: {named}") from None
    return manifest


def _read(path: str, manifest: dict[str, Any], world: World, parts: list[Part], rng: bool):
    """Read what this rank's layout holds: model pieces (into their storage), optimizer
    entries, ``extra`` and (``rng``) this rank's RNG states. Returns the read state, the
    optimizers' finishing steps and the ``extra`` keys read."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state: dict[str, Any] = {}
    finishes = []
    for model, optimizer in parts:
        part = cs.model_pieces(model, load=True)
        optimizer_entries, finish = _optimizer_entries(model, optimizer, load=True, saved=saved)
        part.update(optimizer_entries)
        state.update(cs.globalize(part, model))
        finishes += [finish] if finish is not None else []
    extra_keys = _extra_keys(saved, world.rank, manifest["world_size"] == world.size)
    state.update(dict.fromkeys(extra_keys))
    if rng:
        state[f"rng/{world.rank}"] = None
    save_id = manifest.get("save_id")
    gloo = functools.partial(background.writer_world, world)  # (made only if the copy serves)
    if not snapshot.restore(save_id, state, world, gloo):  # (from memory: [Note: save snapshots])
        pieces.load(state, path, save_id=save_id, group=timed_group(world), single_process=world.size == 1)
    return state, finishes, extra_keys
