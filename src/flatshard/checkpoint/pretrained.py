"""Hugging Face directories in and out of a sharded model: ``load_pretrained`` and
``save_pretrained``, for ``transformers`` models and peft models around them.

The reasoning is [Note: pretrained directories] below."""

# [Note: pretrained directories]
#
# * **Names.** A peft model names its base weights ``base_model.model.<name>`` (and a LoRA
#   layer's own ``<layer>.base_layer.weight``), where the base model's ``save_pretrained``
#   directory says ``<name>`` (``<layer>.weight``). ``load_pretrained`` maps each name of the
#   model to the directory's and reads through ``load_weights``: every rank reads only the
#   ranges of each tensor it holds, at any stage, and the optimizer's fp32 main params take
#   the file's values. The adapters' params are not in a base directory and keep their
#   initialization (peft's: B zero, [Note: default init] in ``wrap/init.py``); any other
#   missing or unexpected name is an error with ``strict``.
# * **What is written.** ``save_pretrained`` writes the values of record (fp32 main params,
#   [Note: values of record] in ``wrap/record.py``), cast to ``dtype`` if given, gathered
#   unit by unit to rank 0, which alone writes: for a peft model the adapter alone
#   (``adapter_model.safetensors`` + ``adapter_config.json``, loadable by
#   ``PeftModel.from_pretrained(base, dir)``), or with ``merged=True`` the base model with
#   every LoRA update added to its weight (``W + scaling * B @ A``, in fp32, then cast), under
#   the base model's names, loadable by ``AutoModelForCausalLM.from_pretrained(dir)``; for a
#   ``transformers`` model its weights and config. Both go through the library's own
#   ``save_pretrained`` with an explicit ``state_dict``, as accelerate does for FSDP.
# * **Never lost, never silent.** The directory must be new or empty (a save never
#   overwrites files it did not write). Rank 0's outcome reaches every rank: a failure
#   there raises on all of them. Merging covers LoRA on linear layers; other adapters (DoRA,
#   embeddings, convolutions, other peft methods) are an error that says to save the adapter
#   and merge it in one process with ``merge_and_unload()``, the route accelerate documents
#   for FSDP.

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from flatshard.checkpoint.files import Source, open_source
from flatshard.checkpoint.weights import PEFT_PREFIX, PRETRAINED_INSTEAD, load_source
from flatshard.comm.world import all_gather_bytes
from flatshard.engine.dynamo import uncompiled
from flatshard.engine.tensor_parallel import refuse_tensor_parallel
from flatshard.errors import CheckpointError
from flatshard.wrap.module import ShardedModule, job_world, sharded_root
from flatshard.wrap.record import cast, check_dtype


# -- load -----------------------------------------------------------------------------------------
def load_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Fill ``model`` (a ``transformers`` model or a peft model around one; sharded at any
    stage, or plain) from a ``save_pretrained`` directory of its base model, each rank
    reading only what it holds ([Note: pretrained directories]). Every rank calls it.
    Returns ``(missing, unexpected)`` names; adapters' params are never counted missing."""
    model = uncompiled(model)
    refuse_tensor_parallel(model, "flatshard.load_pretrained", PRETRAINED_INSTEAD)
    src = open_source(directory)
    renamed = _renamed(src, _base_names(model, src))
    missing, unexpected = load_source(model, renamed, optimizer, strict=False)
    adapters = _adapter_names(model)
    missing = [n for n in missing if n not in adapters]
    if strict and missing:
        raise KeyError(f"{directory} has no {missing[0]!r} ({len(missing)} of the model's tensors missing)")
    if strict and unexpected:
        count = len(unexpected)
        raise KeyError(f"{directory} has {unexpected[0]!r}, which the model does not ({count} such)")
    return missing, unexpected


def _base_names(model: nn.Module, src: Source) -> dict[str, str]:
    """{the model's name: the directory's name} for every name that differs and is found."""
    out = {}
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    for name in names:
        base = _base_name(name)
        if base != name and base in src.shapes:
            out[name] = base
    return out


def _base_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _renamed(src: Source, to_source: dict[str, str]) -> Source:
    """``src`` seen under the model's names."""
    taken = set(to_source.values())
    shapes = {k: v for k, v in src.shapes.items() if k not in taken}
    shapes.update({mine: src.shapes[theirs] for mine, theirs in to_source.items()})
    return src._replace(shapes=shapes, read=lambda name, lo, hi: src.read(to_source.get(name, name), lo, hi))


def _adapter_names(model: nn.Module) -> set[str]:
    """Names of the params of the model's peft adapters (none for another model)."""
    adapters = list(getattr(model, "peft_config", {}) or {})
    return {n for n, _ in model.named_parameters() if any(f".{a}." in f"{n}." for a in adapters)}


# -- save -----------------------------------------------------------------------------------------
def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    merged: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
) -> None:
    """Write ``model`` as a Hugging Face directory ([Note: pretrained directories]): a peft
    model's adapter (``merged=False``) or its merged base model (``merged=True``), or a
    ``transformers`` model, sharded itself or held by a sharded module (a LightningModule's
    ``self.model``). Every rank calls it; rank 0 writes. ``max_shard_size`` (bytes, or
    ``transformers``' ``"5GB"``) splits the weights into files of at most that size with an
    index, as ``transformers``' own ``save_pretrained`` does (an adapter is one file)."""
    model = uncompiled(model)
    check_dtype(dtype)
    if not isinstance(merged, bool):
        raise TypeError(f"merged must be a bool, got {merged!r}")
    peft = hasattr(model, "peft_config")
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(f"save_pretrained needs a transformers or peft model, got {type(model).__name__}")
    if merged and not peft:
        raise ValueError("merged=True merges a peft model's adapters; this model has none")
    if max_shard_size is not None:  # (on every rank, before any gather)
        _check_shard_size(max_shard_size, adapter=peft and not merged)
    held = (model, "") if isinstance(model, ShardedModule) else sharded_root(model)
    if held is not None:
        root, prefix = held[0], held[1] + "." if held[1] else ""
        world = job_world(root)
        full = root.full_state_dict()  # (every rank: the gathers; rank 0 gets the values)
        state = {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
        rank = world.rank
    else:
        world, state, rank = None, {k: v.detach().cpu() for k, v in model.state_dict().items()}, 0
    problem = b""
    if rank == 0:
        try:
            _write(
                model, os.fspath(directory), state, merged=merged, peft=peft, dtype=dtype, size=max_shard_size
            )
        except Exception as e:  # (every rank learns of it below)
            problem = f"{type(e).__name__}: {e}".encode()
            if world is None or world.size == 1:
                raise
    if world is not None and world.size > 1:
        first = all_gather_bytes(problem, world)[0]
        if first:
            raise CheckpointError(f"save_pretrained to {directory} failed on rank 0: {first.decode()}")


def _write(model: Any, directory: str, state: dict, *, merged: bool, peft: bool, dtype, size) -> None:
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise FileExistsError(f"{directory} exists and is not empty: save_pretrained writes a new directory")
    split = {} if size is None else {"max_shard_size": size}
    if peft and merged:
        base = model.get_base_model()
        base.save_pretrained(directory, state_dict=cast(merged_state_dict(model, state), dtype), **split)
    else:
        model.save_pretrained(directory, state_dict=cast(state, dtype), **split)


_SIZE = re.compile(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)", re.IGNORECASE)


def _check_shard_size(size: object, *, adapter: bool) -> None:
    """``max_shard_size`` as ``transformers`` reads it: a positive int of bytes or a size
    such as ``"5GB"`` (decimal) or ``"4GiB"`` (binary)."""
    if adapter:
        raise ValueError("max_shard_size splits a model's weights; a peft adapter is written as one file")
    ok = isinstance(size, int) and not isinstance(size, bool) and size > 0
    if not (ok or (isinstance(size, str) and _SIZE.fullmatch(size.strip()))):
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '5GB', got {size!r}"
        )


def merged_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with the active LoRA adapters of ``model`` (a peft model)
    added to their layers' weights, from ``state`` (the peft model's full state dict)."""
    out = {k: v for k, v in state.items()}
    for prefix, layer in model.named_modules():
        if not isinstance(getattr(layer, "lora_A", None), nn.ModuleDict):
            continue
        for adapter in _active(layer):
            _check_mergeable(prefix, layer, adapter)
            a = out[f"{prefix}.lora_A.{adapter}.weight"].float()
            b = out[f"{prefix}.lora_B.{adapter}.weight"].float()
            delta = (b @ a) * layer.scaling[adapter]
            key = f"{prefix}.base_layer.weight"
            weight = out[key]
            delta = delta.t() if getattr(layer, "fan_in_fan_out", False) else delta
            out[key] = (weight.float() + delta).to(weight.dtype)
    return {_base_name(k): v for k, v in out.items() if ".lora_" not in k}


def _active(layer: Any) -> list[str]:  # (a peft LoRA layer)
    active = getattr(layer, "active_adapters", None) or getattr(layer, "active_adapter", [])
    return [active] if isinstance(active, str) else [a for a in active if a in layer.lora_A]


def _check_mergeable(prefix: str, layer: Any, adapter: str) -> None:
    base = getattr(layer, "base_layer", None)
    dora = bool(getattr(layer, "use_dora", {}).get(adapter, False))
    if dora or not isinstance(base, nn.Linear) or not isinstance(layer.lora_A[adapter], nn.Linear):
        raise NotImplementedError(
            f"{prefix}: merging is built for LoRA on linear layers (this is "
            f"{'DoRA' if dora else type(base).__name__}); save the adapter (merged=False) and merge it "
            "in one process with PeftModel.from_pretrained(base, dir).merge_and_unload()"
        )
