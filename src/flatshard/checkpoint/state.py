"""What a rank writes to, and reads from, a checkpoint: model and optimizer as ``Piece``s.

See [Note: checkpoints] in ``checkpoint/directory.py``. ``*_to_save`` functions return ``{key: Piece |
tensor | object}`` views of this rank's data; ``*_to_load`` functions return the same
shape of dict with destinations, plus a ``finish`` callable that hands what was read to
the optimizer once DCP has filled the destinations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from flatshard.checkpoint.pieces import Piece
from flatshard.engine.tensor_parallel import global_runs, is_distributed, local
from flatshard.optim.blockwise import quantized_moment, quantized_parts
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.wrap.module import ShardedModule
from flatshard.wrap.specs import names_by_param

MODEL, MAIN, STATE, GROUPS, META = "model/", "main/", "state/", "optimizer/param_groups", "optimizer/meta"


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose names key the checkpoint (DDP's ``module``, else the model)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def param_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its name (the first name of a tied param)."""
    return {id(p): n for n, p in _unwrap(model).named_parameters()}


def model_shapes(model: nn.Module) -> dict[str, tuple[list[int], str]]:
    """Every param and persistent buffer: name -> (shape, dtype), as the manifest keeps them
    (an expert param whole: its ep ranks' shares stacked along dim 0)."""
    tensors = [*_unwrap(model).named_parameters(), *_persistent_buffers(model)]
    shapes = {name: (list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors}
    for name, (_, size) in expert_shares(model).items():
        shape, dtype = shapes[name]
        shapes[name] = ([shape[0] * size, *shape[1:]], dtype)
    return shapes


def expert_shares(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Expert param name -> (this rank's place in the expert-parallel group, its size): a
    checkpoint keeps each expert param whole, the shares of the ep ranks stacked along dim 0
    in rank order, as torchtitan's and the toolkit's stacked experts are ([Note: expert
    parallelism] in ``wrap/plan.py``)."""
    state = model.flatshard_state if isinstance(model, ShardedModule) else None
    spread = state.grad_sync.experts if state is not None else None
    if state is None or spread is None:
        return {}
    if spread.in_main:
        raise NotImplementedError(
            "checkpoints of a model whose experts have no expert-parallel group: name it, "
            "shard(expert=flatshard.Experts(group, match, ep=...)), and each expert param is saved "
            "whole (the ep ranks' shares stacked along dim 0)"
        )
    shares = {}
    for name, param in zip(state.sets["expert"].names, state.sets["expert"].params, strict=True):
        if param.dim() == 0 or is_distributed(param):
            raise NotImplementedError(f"checkpoints of a 0-d or tensor-parallel expert param ({name!r})")
        shares[name] = (spread.over.rank, spread.over.size)
    return shares


def check_shapes(
    model: nn.Module, shapes: dict[str, Any], where: str, *, strict: bool = True, others: bool = False
) -> tuple[list[str], list[str]]:
    """Compare the model's params and persistent buffers with ``shapes`` (name -> shape) of
    ``where`` (a checkpoint, a weights file): a shape that differs is an error, and with
    ``strict`` so is a missing or (unless ``others``: other ranks' models may hold it) an
    unexpected name (further names of tied params are neither). Returns ``(missing,
    unexpected)``."""
    mine, aliases = model_shapes(model), model_aliases(model)
    missing = [n for n in mine if n not in shapes]
    unexpected = [n for n in shapes if n not in mine and n not in aliases]
    if strict and missing:
        raise KeyError(f"{where} has no {missing[0]!r} ({len(missing)} of the model's tensors missing)")
    if strict and unexpected and not others:
        raise KeyError(f"{where} has {unexpected[0]!r}, which the model does not ({len(unexpected)} such)")
    for name, (shape, _) in mine.items():
        if name in shapes and tuple(shapes[name]) != tuple(shape):
            raise ValueError(
                f"{name!r} has shape {tuple(shapes[name])} in {where}, {tuple(shape)} in the model"
            )
    return missing, unexpected


def model_aliases(model: nn.Module) -> dict[str, str]:
    """Every further name of a tied param -> its first name (the one the checkpoint keys)."""
    return {alias: names[0] for names in names_by_param(_unwrap(model)).values() for alias in names[1:]}


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    module = _unwrap(model)
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


def _numels(layout) -> dict[str, int]:
    """Param name -> element count, for the params of a buffer layout."""
    return {slot.name: slot.numel for slot in layout.params}


# -- the model ---------------------------------------------------------------------------------
def _sharded_sets(model: nn.Module):
    if not isinstance(model, ShardedModule):
        return None
    expert_shares(model)  # (refuses experts without their ep group)
    return model.flatshard_state


def param_dtype_shards(model: nn.Module, loading: bool = False) -> AbstractContextManager:
    """A block in which a stage-3 model's 16-bit shards exist ([Note: main-backed shards]) and
    fp8-gathered params hold their values of record (``loading``: they are written in it):
    ``model_pieces`` reads and writes them."""
    if not isinstance(model, ShardedModule):
        return nullcontext()
    return model.flatshard_state.param_dtype_shards(loading)


def model_pieces(model: nn.Module, *, load: bool) -> dict[str, Any]:
    """``model/<name>`` for every param and persistent buffer this rank holds: the pieces
    of its shards (stages 1-3), whole params where it holds them whole (to save: the same
    pieces on every rank are written once; to load at stages 0-2: the whole param). Call
    it inside ``param_dtype_shards(model)``."""
    out: dict[str, Any] = {}
    state = _sharded_sets(model)
    covered: set[int] = set()
    if state is not None:
        state.wait_for_params()
        for bset in state.param_sets():
            covered.update(id(p) for p in bset.params)
            for buffer in bset.buffers:
                numel = _numels(buffer.layout)
                for bucket in buffer.layout.buckets:
                    if load and not state.policy.shards_params:  # params held whole: read them whole
                        for slot in bucket.params:
                            view = buffer.param_data[slot.start : slot.end]
                            out[MODEL + slot.name] = Piece(slot.numel, 0, view)
                        continue
                    shard = buffer.param_shard(bucket)
                    for piece in bucket.local_ranges(buffer.rank):
                        view = shard[piece.in_shard.start : piece.in_shard.end]
                        out[MODEL + piece.name] = Piece(numel[piece.name], piece.in_param.start, view)
    for name, p in _unwrap(model).named_parameters():
        if id(p) not in covered:  # (a DTensor's local shard: ``globalize`` places it)
            values = local(p) if load or is_distributed(p) else p
            out[MODEL + name] = Piece(values.numel(), 0, values.reshape(-1) if load else _flat(values))
    for name, buf in _persistent_buffers(model):
        out[MODEL + name] = Piece(buf.numel(), 0, buf.data.view(-1) if load else _flat(buf))
    if load:
        for key, piece in out.items():
            if not piece.tensor.is_contiguous():
                name = key.removeprefix(MODEL)
                raise ValueError(f"{name!r} is not contiguous: it cannot be loaded in place")
    return out


# -- DistributedOptimizer ------------------------------------------------------------------------
def _run_pieces(opt: DistributedOptimizer) -> Iterator[tuple[int, torch.Tensor, list]]:
    """(inner param index, run tensor, [(name, param numel, offset in the param, (lo, hi)
    in the run)]) for every run of the inner optimizer."""
    index = {id(t): i for i, t in enumerate(p for g in opt.inner.param_groups for p in g["params"])}
    for shards in opt.shards:
        numel = _numels(shards.buffer.layout)
        for run, tensor in zip(shards.runs, shards.tensors, strict=True):
            bucket = shards.buffer.layout.buckets[run.bucket]
            start, end = run.in_shard
            pieces = [
                (p.name, numel[p.name], p.in_param.start, (p.in_shard.start - start, p.in_shard.end - start))
                for p in bucket.local_ranges(shards.buffer.rank)
                if opt.group_of.get(p.name) == run.group
                and start <= p.in_shard.start
                and p.in_shard.end <= end
            ]
            yield index[id(tensor)], tensor, pieces


def main_pieces(opt: DistributedOptimizer) -> Iterator[tuple[str, Piece, Any]]:
    """(key, piece of the fp32 main params, its buffer's shards) for every optimized param
    piece of a 16-bit buffer."""
    for shards in opt.shards:
        if shards.record_main is None:
            continue
        numel = _numels(shards.buffer.layout)
        for piece, main in shards.main_pieces():
            if piece.name in opt.group_of:
                yield MAIN + piece.name, Piece(numel[piece.name], piece.in_param.start, main), shards


def _group_records(param_groups: list[dict], names_of_group: list[list[str]]) -> list[dict]:
    return [
        {"hyper": {k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(param_groups, names_of_group, strict=True)
    ]


def distributed_optimizer_to_save(opt: DistributedOptimizer) -> dict[str, Any]:
    out: dict[str, Any] = {key: piece for key, piece, _ in main_pieces(opt)}
    for _, tensor, pieces in _run_pieces(opt):
        for key, value in opt.inner.state.get(tensor, {}).items():
            parts = quantized_parts(value)  # ([Note: blockwise state] in optim/blockwise.py)
            for name, numel, offset, span in pieces:
                if parts is None:
                    out[f"{STATE}{key}/{name}"] = _state_entry(
                        key, name, value, tensor.shape, numel, offset, span
                    )
                    continue
                for part, data in parts.items():
                    out[f"{STATE}{key}.{part}/{name}"] = _part_piece(data, value.numel(), numel, offset, span)
    out[GROUPS] = _group_records(opt.param_groups, _names_by_group(opt))
    out[META] = {
        "loss_scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict(),
        "skipped_steps": opt.skipped_steps,
    }
    return out


def _state_entry(key: str, name: str, value: Any, shape, numel: int, offset: int, span) -> Any:
    """A state entry to save: a 0-d tensor as it is, an elementwise one as the piece
    ``span`` of its flat view (elements ``offset...`` of param ``name``)."""
    if not isinstance(value, torch.Tensor):
        kind = type(value).__name__
        raise TypeError(f"optimizer state {key!r} of {name!r} is a {kind}; only tensors are saved")
    if value.dim() == 0:
        return value
    if value.shape != shape:
        raise ValueError(
            f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, not its param's "
            f"{tuple(shape)}: only elementwise state can be saved by param"
        )
    return Piece(numel, offset, _flat(value)[span[0] : span[1]])


def _part_piece(data: torch.Tensor, of: int, numel: int, offset: int, span) -> Piece:
    """The piece of a quantized moment's part ``data`` (codes, or one scale a block) that
    holds elements ``span`` of its run of ``of`` elements: the same share of the part, of
    a param whose part has ``numel * data.numel() / of`` entries (exact: a piece is whole
    blocks)."""
    per = data.numel()
    return Piece(
        numel * per // of, offset * per // of, _flat(data)[span[0] * per // of : span[1] * per // of]
    )


def distributed_optimizer_to_load(opt: DistributedOptimizer, saved: dict[str, Any]) -> tuple[dict, Callable]:
    """Destinations for the main params and for the inner optimizer's state of every run
    (keys present in the checkpoint only), and the step that hands them over."""
    out: dict[str, Any] = {}
    has_main = set()
    for key, piece, shards in main_pieces(opt):
        if key in saved:
            out[key] = piece
            has_main.add(id(shards))
    saved_state = _state_index(saved)
    inner_state: dict[int, dict[str, torch.Tensor]] = {}
    for index, tensor, pieces in _run_pieces(opt):
        entries: dict[str, torch.Tensor] = {}
        for name, numel, offset, (lo, hi) in pieces:
            for key, md in saved_state.get(name, ()):
                moment, _, part = key.partition(".")
                if part:  # a quantized moment's codes or scales, into the moment as the optimizer keeps it
                    dest = quantized_moment(opt.inner, tensor, moment, entries.get(moment))
                    entries[moment] = dest
                    data = quantized_parts(dest)[part]  # type: ignore[index]
                    out[f"{STATE}{key}/{name}"] = _part_piece(data, dest.numel(), numel, offset, (lo, hi))
                    continue
                if not md.size:  # a scalar: from the run's first param that has it
                    if key not in entries:
                        entries[key] = torch.zeros((), dtype=md.properties.dtype)
                        out[f"{STATE}{key}/{name}"] = entries[key]
                    continue
                dest = entries.setdefault(key, torch.zeros_like(tensor))
                out[f"{STATE}{key}/{name}"] = Piece(numel, offset, dest.view(-1)[lo:hi])
        if entries:
            inner_state[index] = entries
    out[GROUPS] = None
    if META in saved:  # absent when another kind of optimizer wrote the checkpoint
        out[META] = None

    def finish(loaded: dict[str, Any]) -> None:
        _apply_groups(opt.param_groups, loaded[GROUPS], _names_by_group(opt), "the model's")
        groups = opt.inner.state_dict()["param_groups"]
        opt.inner.load_state_dict({"state": inner_state, "param_groups": groups})
        for shards in opt.shards:
            if shards.main_data is not None and id(shards) not in has_main:
                shards.load_main_from_params()  # saved without main params: from the params
        meta = loaded.get(META)
        if meta is not None:
            if (opt.loss_scaler is None) != (meta["loss_scaler"] is None):
                raise ValueError("the checkpoint and this optimizer disagree on whether the loss is scaled")
            if opt.loss_scaler is not None:
                opt.loss_scaler.load_state_dict(meta["loss_scaler"])
            opt.skipped_steps = int(meta["skipped_steps"])
        opt.main_params_changed()

    return out, finish


def _names_by_group(opt: DistributedOptimizer) -> list[list[str]]:
    names: list[list[str]] = [[] for _ in opt.param_groups]
    for name, group in opt.group_of.items():
        names[group].append(name)
    return names


def _state_index(saved: dict[str, Any]) -> dict[str, list[tuple[str, TensorStorageMetadata]]]:
    """Param name -> [(state key, its metadata)] of the checkpoint's ``state/<key>/<name>``
    entries (one pass over the checkpoint's keys; state keys hold no "/")."""
    out: dict[str, list[tuple[str, TensorStorageMetadata]]] = {}
    for fqn, md in saved.items():
        if fqn.startswith(STATE) and isinstance(md, TensorStorageMetadata):
            key, _, name = fqn[len(STATE) :].partition("/")
            out.setdefault(name, []).append((key, md))
    return out


def _apply_groups(groups: list[dict], saved: list[dict], names: list[list[str]], whose: str) -> None:
    """Take the saved hyperparameters of each param group, after checking that the groups
    hold the same params."""
    if len(saved) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved)} param groups, {whose} optimizer {len(groups)}")
    for index, (group, record, mine) in enumerate(zip(groups, saved, names, strict=True)):
        moved = sorted(set(mine) - set(record["params"]))  # (the saved group may hold other chunks')
        if moved:
            raise ValueError(f"param group {index} holds other params in the checkpoint: {moved[:3]} differ")
        group.update(record["hyper"])


# -- any other torch optimizer (keyed by param) ----------------------------------------------------
def _owned(opt: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    owner_of = getattr(opt, "owner_of", None)
    world = getattr(opt, "world", None)
    return owner_of is None or (world is not None and owner_of(param) == world.rank)


def param_optimizer_to_save(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """A torch optimizer over the model's own params (plain, hybrid or owner-sharded):
    each state entry whole, written by the rank that holds it (once if every rank does)."""
    names = param_names(model)
    out: dict[str, Any] = {}
    groups = []
    masters: dict[Any, Any] = getattr(opt, "masters", dict)()
    for group in opt.param_groups:
        members = []
        for p in group["params"]:
            name = _name_of(names, p)
            members.append(name)
            if not _owned(opt, p):
                continue
            for key, value in opt.state.get(p, {}).items():
                entry = _state_entry(key, name, value, p.shape, p.numel(), 0, (0, p.numel()))
                out[f"{STATE}{key}/{name}"] = entry
            if p in masters:
                out[MAIN + name] = Piece(p.numel(), 0, _flat(masters[p]))
        groups.append(members)
    out[GROUPS] = _group_records(opt.param_groups, groups)
    return out


def _name_of(names: dict[int, str], p: torch.Tensor) -> str:
    name = names.get(id(p))
    if name is None:
        shape = tuple(p.shape)
        raise ValueError(f"the optimizer holds a tensor of shape {shape} that is not a param of the model")
    return name


def param_optimizer_to_load(
    opt: torch.optim.Optimizer, model: nn.Module, saved: dict[str, Any]
) -> tuple[dict, Callable]:
    names = param_names(model)
    saved_state = _state_index(saved)
    out: dict[str, Any] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    masters: dict[int, torch.Tensor] = {}
    index = 0
    member_names: list[list[str]] = []
    for group in opt.param_groups:
        member_names.append([])
        for p in group["params"]:
            name = _name_of(names, p)
            member_names[-1].append(name)
            if _owned(opt, p):
                entries = {}
                for key, md in saved_state.get(name, ()):
                    dest = torch.zeros(tuple(p.shape) if md.size else (), dtype=md.properties.dtype)
                    entries[key] = dest
                    out[f"{STATE}{key}/{name}"] = Piece(p.numel(), 0, dest.view(-1)) if md.size else dest
                if entries:
                    state[index] = entries
                if MAIN + name in saved:
                    masters[index] = torch.zeros(p.numel(), dtype=torch.float32)
                    out[MAIN + name] = Piece(p.numel(), 0, masters[index])
            index += 1
    out[GROUPS] = None

    def finish(loaded: dict[str, Any]) -> None:
        _apply_groups(opt.param_groups, loaded[GROUPS], member_names, "this")
        params = [p for g in opt.param_groups for p in g["params"]]
        full = {"state": state, "param_groups": opt.state_dict()["param_groups"]}
        if masters:
            full["master_params"] = {i: m.view_as(params[i]) for i, m in masters.items()}
        opt.load_state_dict(full)

    return out, finish


# -- tensor-parallel params ([Note: tensor-parallel params]) ---------------------------------------
def globalize(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` with every piece of a tensor-parallel param (elements of its flattened
    local shard) as runs of the flattened full param, and of an expert param as a run of
    the stacked whole (``expert_shares``): what a checkpoint keeps, so that one written at
    any tp x dp (x ep) layout loads at any other, or into the plain model."""
    split = {n: p for n, p in _unwrap(model).named_parameters(remove_duplicate=False) if is_distributed(p)}
    shares = expert_shares(model)
    if not split and not shares:
        return state
    for key, value in state.items():
        if not isinstance(value, Piece):
            continue
        name, lo, hi = _param_name(key), value.offset, value.offset + value.tensor.numel()
        if name in split:
            runs = tuple((start, a - lo, b - lo) for start, a, b in global_runs(split[name], lo, hi))
            state[key] = Piece(split[name].numel(), 0, value.tensor, runs)
        elif name in shares:  # (this rank's share: one run of the stacked whole)
            rank, size = shares[name]
            runs = ((rank * value.numel + lo, 0, hi - lo),) if hi > lo else ()
            state[key] = Piece(value.numel * size, 0, value.tensor, runs)
    return state


def _param_name(key: str) -> str:
    """The param a ``model/``, ``main/`` or ``state/<key>/`` entry belongs to."""
    for prefix in (MODEL, MAIN):
        if key.startswith(prefix):
            return key[len(prefix) :]
    if key.startswith(STATE):
        return key[len(STATE) :].partition("/")[2]
    return ""
