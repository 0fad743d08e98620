"""Optimizers that keep their state in blocks (torchao's ``AdamW8bit``, ``AdamW4bit``,
``AdamWFp8``, ...) over a rank's shards: which classes they are, the layout they need, and
their state made as one process makes it.

The reasoning is [Note: blockwise state] below."""

# [Note: blockwise state]
#
# torchao's low-bit Adams quantize each moment in blocks of ``block_size`` consecutive
# elements of a param, flattened (one scale a block, 8, 4 or fp8 bits an element), and decide
# per tensor: a tensor of at least 4096 elements whose count is a multiple of the block gets
# quantized state, any other plain state of its dtype. The update itself is elementwise on the
# dequantized state. So a rank steps its part of a param exactly as one process steps the
# whole param when
#
# 1. its part is a tensor of its own (a *piece run*, rule 5 of [Note: optimizer runs]): never
#    glued to a neighbour, whose elements would fall into its blocks;
# 2. its part starts at a multiple of the block from the param's start and ends at one or at
#    the param's end, so its blocks are the param's blocks (``Buckets(align=...)``,
#    [Note: aligned shards] in ``planner/layout.py``); a layout that cuts a quantized param
#    elsewhere is refused, naming the param, the cut and the ``align`` that fixes it;
# 3. its state is quantized or plain as the *whole param's* would be: a part of 2048 elements
#    of a 8192-element param is quantized, although torchao would keep a tensor of 2048
#    plain. The inner optimizer's ``_new_buffer`` (torchao's hook that makes a moment) is
#    replaced on the instance by one that decides from the whole param's element count.
#
# Small params (plain state) step as they would in one process wherever they are cut: their
# update is elementwise. The step count is per tensor, as in one process: every piece of a
# param steps when its param does.
#
# A checkpoint keeps each quantized moment as its codes and block scales, by param
# (``state/exp_avg.codes/<name>``, ``state/exp_avg.scale/<name>``), never dequantized: a
# block whose largest element is negative dequantizes to 0.993 of its scale (the signed map's
# end), so quantizing it again moves every code of the block. Pieces are whole blocks, so
# codes and scales cut and join at any layout aligned to the block; plain moments (AdamW's
# checkpoint) load into a low-bit Adam and are quantized then, and quantized ones are refused
# by an optimizer that keeps none.

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from flatshard.planner.layout import Layout
from flatshard.planner.state_blocks import block_align, quantized


def _torchao_base() -> type | None:
    try:
        from torchao.optim.adam import _AdamBase
    except ImportError:  # (torchao is optional)
        return None
    return _AdamBase


def state_block(cls: type, defaults: dict[str, Any]) -> int | None:
    """The block (elements) in which ``cls`` keeps its state, None for a class that does not."""
    base = _torchao_base()
    if base is None or not isinstance(cls, type) or not issubclass(cls, base):
        return None
    block = defaults.get("block_size", inspect.signature(cls).parameters["block_size"].default)
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{cls.__name__}: block_size must be a positive int, got {block!r}")
    return block


def check_cuts(layout: Layout, names: Iterable[str], block: int, cls: type) -> None:
    """Refuse a layout that cuts a param of ``names`` with quantized state inside a block."""
    wanted = set(names)
    for buffer in layout.buffers:
        for bucket in buffer.buckets:
            for rank in range(layout.world_size):
                for piece in bucket.local_ranges(rank):
                    if piece.name not in wanted:
                        continue
                    numel = layout.slot(piece.name)[1].numel
                    lo, hi = piece.in_param
                    if quantized(numel, block) and (lo % block or (hi % block and hi != numel)):
                        cut = lo if lo % block else hi
                        raise ValueError(
                            f"{cls.__name__} keeps its state in blocks of {block} elements, and this "
                            f"{layout.world_size}-rank layout cuts param {piece.name!r} at element {cut}, "
                            f"inside a block: shard the model with flatshard.shard(..., "
                            f"buckets=flatshard.Buckets(align={block_align(block)}))"
                        )


def piece_params(
    state: Any, group_of: dict[str, int], classes: list[type], defaults: dict[str, Any]
) -> set[str]:
    """The optimized params stepped as piece runs (those of groups whose class keeps blockwise
    state), after checking that the layout cuts none of them inside a block."""
    blocks = [state_block(cls, defaults) for cls in classes]
    if not any(b is not None for b in blocks):
        return set()
    if len(set(classes)) > 1:
        listed = sorted({c.__name__ for c in classes})
        raise ValueError(f"a class that keeps blockwise state steps every param group, got {listed}")
    names = {n for n, g in group_of.items() if blocks[g] is not None}
    block, cls = blocks[0], classes[0]
    assert block is not None
    for bset in state.sets.values():
        check_cuts(bset.layout, names, block, cls)
    return names


def adopt(inner: torch.optim.Optimizer, all_shards: Iterable[Any], pieces: set[str]) -> None:
    """Make ``inner`` (a torchao blockwise optimizer over piece runs) create each run's state
    as one process would for the run's whole param (rule 3 of [Note: blockwise state])."""
    if not pieces:
        return
    numels: dict[int, int] = {}
    for shards in all_shards:
        layout, rank = shards.buffer.layout, shards.buffer.rank
        for run, tensor in zip(shards.runs, shards.tensors, strict=True):
            bucket = layout.buckets[run.bucket]
            held = bucket.local_ranges(rank)
            name = next((p.name for p in held if p.in_shard == run.in_shard and p.name in pieces), None)
            if name is not None:
                numels[id(tensor)] = next(slot.numel for slot in bucket.params if slot.name == name)
    block = inner.block_size  # type: ignore[attr-defined]
    make = inner._subclass_zeros  # type: ignore[attr-defined]

    def new_buffer(p: torch.Tensor, signed: bool) -> torch.Tensor:
        if quantized(numels[id(p)], block):
            return make(p, signed, block)
        return torch.zeros_like(p)

    inner._new_buffer = new_buffer  # type: ignore[attr-defined]
    inner.register_load_state_dict_post_hook(_requantize)


MOMENTS = (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False))
"""torchao's moments, and whether each is quantized signed."""


def _requantize(inner: torch.optim.Optimizer) -> None:
    """After a load that brought plain moments (a checkpoint of AdamW's fp32 state loaded
    into a low-bit Adam): each moment back in the form the optimizer keeps it (rule 3 of the
    note above), quantized by ``copy_`` into a new zero state. Moments loaded quantized (a
    low-bit checkpoint's codes and scales) are left as they are."""
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p) or {}
            for key, signed in MOMENTS:
                value = state.get(key)
                if type(value) is not torch.Tensor:
                    continue  # (absent, or already quantized)
                kept = inner._new_buffer(p, signed)  # type: ignore[attr-defined]
                if type(kept) is not torch.Tensor:
                    kept.copy_(value)
                    state[key] = kept


def quantized_parts(value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A quantized moment's codes and block scales (what a checkpoint keeps of it, exactly:
    dequantized values do not quantize back to the same codes), None for a plain tensor."""
    if type(value) is torch.Tensor or not hasattr(value, "codes"):
        return None
    return {"codes": value.codes, "scale": value.scale}  # type: ignore[attr-defined]


def quantized_moment(
    inner: torch.optim.Optimizer, run: torch.Tensor, key: str, existing: torch.Tensor | None
) -> torch.Tensor:
    """Where a checkpoint's quantized moment ``key`` of ``run`` loads: ``existing`` (made
    for an earlier piece of the run), else a zero moment as ``inner`` keeps it; a
    ``ValueError`` where that moment is not quantized (another class, or a run of several
    params: AdamW's flat runs)."""
    signed = dict(MOMENTS).get(key)
    made = existing
    if made is None and signed is not None and hasattr(inner, "block_size"):
        made = inner._new_buffer(run, signed)  # type: ignore[attr-defined]
    if made is None or quantized_parts(made) is None:
        raise ValueError(
            f"the checkpoint holds optimizer state {key!r} quantized (a torchao low-bit Adam's), and "
            f"{type(inner).__name__} keeps no quantized {key!r} for a run of {run.numel()} elements: load "
            "it with the optimizer class and layout that quantize it"
        )
    return made
