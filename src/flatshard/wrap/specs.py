"""What the layout planner is told of a model's params: one ``ParamSpec`` each.

A spec carries what changes where a param lands: its size and dtypes, whether it is shared
(tied params get a bucket of their own below stage 3), its stage-3 unit, and whether it
must stay whole in one rank's shard (``whole_params``: [Note: whole-param buckets] in
``layout.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from flatshard.engine.fp8_gathers import Fp8Cast
from flatshard.engine.tensor_parallel import is_distributed, local_shape
from flatshard.planner.layout import ParamSpec
from flatshard.planner.mixed_precision import MixedPrecision
from flatshard.planner.stage import DEFAULT_UNIT_BYTES, StagePolicy
from flatshard.units.unit_tree import UnitSpec, assign_params, find_units, merge_units
from flatshard.wrap.subclass_params import fp8_marked

WholeParams = Callable[[str, nn.Parameter], bool] | Iterable[nn.Parameter] | None
"""Params a sharded layout keeps whole: a predicate ``(name, param) -> bool``, or params."""


def tied_params(module: nn.Module) -> set[int]:
    """Params registered under more than one name (e.g. embeddings tied to the output layer)."""
    return {key for key, names in names_by_param(module).items() if len(names) > 1}


def whole_param_names(module: nn.Module, whole_params: WholeParams) -> frozenset[str]:
    """The names (as ``named_parameters()`` gives them) of the params ``whole_params`` picks."""
    if whole_params is None:
        return frozenset()
    named = list(module.named_parameters())
    if callable(whole_params):
        return frozenset(n for n, p in named if whole_params(n, p))
    if isinstance(whole_params, (str, bytes)) or not isinstance(whole_params, (Iterable, torch.Tensor)):
        raise TypeError(
            f"whole_params must be params of the model or a predicate (name, param) -> bool, "
            f"got {type(whole_params).__name__}"
        )
    name_of = {id(p): n for n, p in named}
    names = []
    given = [whole_params] if isinstance(whole_params, torch.Tensor) else list(whole_params)
    for i, p in enumerate(given):
        if id(p) not in name_of:
            what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)[:60]
            raise ValueError(f"whole_params[{i}] is {what}, not a param of {type(module).__name__}")
        names.append(name_of[id(p)])
    return frozenset(names)


def param_specs(
    named: list[tuple[str, nn.Parameter]],
    tied: set[int],
    unit_of: dict[int, int] | None = None,
    whole: frozenset[str] = frozenset(),
    mixed_precision: MixedPrecision | None = None,
    fp8: Mapping[str, Fp8Cast] | None = None,
) -> list[ParamSpec]:
    """What the layout planner needs of ``named`` params (``tied``: ids of shared params;
    ``unit_of``: stage-3 unit index by param id; ``whole``: names of params kept whole;
    ``mixed_precision``: the dtype grads accumulate in; ``fp8``: the weights gathered in fp8,
    by name)."""
    fp8 = fp8 or {}
    unit_of = unit_of or {}
    mp = mixed_precision or MixedPrecision()
    return [
        ParamSpec(
            n,
            local_shape(p).numel(),  # (a DTensor's local shard: [Note: tensor-parallel params])
            p.dtype,
            mp.grads_of(p.dtype),
            id(p) in tied and not unit_of,  # at stage 3 a unit's buckets are what is gathered
            None if id(p) not in unit_of else str(unit_of[id(p)]),
            n in whole,
            fp8[n].dtype if n in fp8 else None,
        )
        for n, p in named
    ]


def stage3_units(
    module: nn.Module, named: list, units: UnitSpec, unit_bytes: int | None = DEFAULT_UNIT_BYTES
):
    """The units (small ones merged up to ``unit_bytes``) and each param's unit; sorts
    ``named`` by unit, so each unit's params are contiguous in the layout (fewer, larger
    gathers; [Note: units])."""
    unit_list = find_units(module, units)
    unit_of = assign_params(module, unit_list)
    nbytes = unit_nbytes(module, unit_of, len(unit_list))
    unit_list, unit_of = merge_units(unit_list, unit_of, nbytes, unit_bytes)
    named.sort(key=lambda item: unit_of[id(item[1])])
    return unit_list, unit_of


def unit_nbytes(module: nn.Module, unit_of: dict[int, int], count: int) -> list[int]:
    """Bytes of the params (trainable and frozen, in their dtype) of each of ``count`` units."""
    nbytes = [0] * count
    for p in module.parameters():
        nbytes[unit_of[id(p)]] += p.numel() * p.element_size()
    return nbytes


def model_specs(
    module: nn.Module,
    *,
    stage: int = 0,
    units: UnitSpec = None,
    frozen: bool = False,
    whole_params: WholeParams = None,
    unit_bytes: int | None = DEFAULT_UNIT_BYTES,
    fp8_gathers: bool | None = None,
) -> list[ParamSpec]:
    """``param_specs`` of a module's trainable params (``frozen``: of its frozen floating
    params) as ``shard(module, stage=stage, whole_params=..., stage3=Stage3(unit_bytes=...),
    fp8_gathers=...)`` lays them out (works on the meta device; torchao's fp8-gather weights
    are gathered in fp8 at stage 3, and at stages 0-2 with ``fp8_gathers=True``)."""
    named = [
        (n, p)
        for n, p in module.named_parameters()
        if (p.requires_grad if not frozen else not p.requires_grad and p.is_floating_point())
    ]
    gathers_units = StagePolicy(stage).gathers_units
    unit_of = stage3_units(module, named, units, unit_bytes)[1] if gathers_units else {}
    fp8 = {n: c for n, c in fp8_marked(module).items() if not is_distributed(module.get_parameter(n))}
    whole = whole_param_names(module, whole_params)
    in_fp8 = fp8_gathers is True or (gathers_units and fp8_gathers is None)
    return param_specs(named, tied_params(module), unit_of, whole, fp8=fp8 if in_fp8 else None)


def names_by_param(module: nn.Module) -> dict[int, list[str]]:
    """``{id(param): every name it is registered under}``, the first name first: a param
    with several names is tied (e.g. embeddings shared with the output layer)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names
