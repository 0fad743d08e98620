"""Params of a tensor subclass whose values ``.data`` does not reach: made plain where their
class is known to be a marker over plain values, replicated where frozen, refused by name
otherwise ([Note: tensor-subclass params])."""

# [Note: tensor-subclass params]
#
# flatshard holds a param's values in a flat buffer by rebinding ``param.data`` to a view of
# it, and steps the buffer. A *wrapper* tensor subclass (one that dispatches through
# ``__torch_dispatch__`` and keeps its values in inner tensors, e.g. torchao's
# ``WeightWithDynamicFloat8CastTensor``) has no storage of its own: ``.data = view`` changes
# the wrapper's metadata but not the inner tensor every op reads, so the optimizer would step
# the buffer while the model kept computing with values that never move. That trained wrong
# without a word (a float8 model at stages 0-2), or failed with an error about a rebound
# ``.data`` (stage 3). The rules, applied by ``shard()`` before anything is planned:
#
# * **A known marker class is made plain.** torchao's float8 weight wrapper only marks a
#   ``Float8Linear`` weight for FSDP2's fp8 all-gather; every op on it unwraps to its plain
#   values, and ``Float8Linear`` casts a plain weight to fp8 in its forward with the same
#   tensorwise scale (the amax of the whole weight) that FSDP2's fp8 gather computes. So the
#   param is replaced, in every module that holds it (tied ones stay tied), by a plain
#   ``nn.Parameter`` over those values with the same ``requires_grad``; a DTensor param whose
#   local shard is the wrapper gets a DTensor over the plain local shard. The arithmetic is a
#   one-process torchao run's. The marker asked for fp8 all-gathers: flatshard's stage 3
#   gathers such weights in fp8 ([Note: fp8 gathers] in ``engine/fp8_gathers.py``).
# * **A frozen param of any other wrapper class is replicated** on every rank, at stage 3
#   too (below it every frozen param is): flatshard never rebinds it, and it computes as in
#   one process (a quantized frozen base, such as torchao's NF4 weights of a QLoRA model).
#   ``sync_module_states`` broadcasts its inner tensors (``__tensor_flatten__``, as
#   torch.compile and DCP read them).
# * **A trainable param of any other wrapper class is refused** with a ``TypeError`` naming
#   the param and its class, before anything is built: flatshard cannot step values it
#   cannot reach. So is a frozen one without ``__tensor_flatten__``: its values cannot be
#   broadcast.
#
# ``nn.Parameter`` subclasses that keep their values in their own storage (bitsandbytes' or
# peft's) are not wrappers: ``.data`` reaches them, and they are sharded as any param.

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard.engine.fp8_gathers import Fp8Cast
from flatshard.engine.wrapper_tensors import inner_values, is_wrapper

__all__ = ["WRAPPER_MARKERS", "fp8_marked", "frozen_wrappers", "make_plain"]

# (module, class name) of wrapper classes known to mark plain values (read by name: flatshard
# does not import torchao).
WRAPPER_MARKERS: frozenset[tuple[str, str]] = frozenset(
    {("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")}
)


def _is_marker(tensor: torch.Tensor) -> bool:
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    cls = type(tensor)
    return (cls.__module__, cls.__name__) in WRAPPER_MARKERS


def _plain(param: nn.Parameter) -> nn.Parameter:
    """A plain param over ``param``'s values (a DTensor over its plain local shard); the
    float8 wrapper's first inner tensor holds them."""
    values: torch.Tensor
    if isinstance(param, DTensor):
        local = inner_values(param.to_local())[0]
        values = DTensor.from_local(
            local.detach(), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    else:
        values = inner_values(param)[0].detach()
    return nn.Parameter(values, requires_grad=param.requires_grad)


def make_plain(module: nn.Module) -> dict[str, Fp8Cast]:
    """Replace every param of a known marker class with a plain one in every module that
    holds it, after refusing a trainable param of another wrapper class (nothing is replaced
    then). Returns how each param made plain is cast for its fp8 gathers, by name
    ([Note: fp8 gathers] in ``engine/fp8_gathers.py``)."""
    found = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for local_name, param in owner._parameters.items():
            if param is not None and is_wrapper(param):
                name = f"{owner_name}.{local_name}" if owner_name else local_name
                traceable = hasattr(type(param), "__tensor_flatten__")
                if not _is_marker(param) and (param.requires_grad or not traceable):
                    raise _refused(name, param)
                found.append((owner, local_name, name, param))
    replaced: dict[int, nn.Parameter] = {}
    casts: dict[str, Fp8Cast] = {}
    holders: dict[int, list[nn.Module]] = {}
    for owner, _, _, param in found:
        holders.setdefault(id(param), []).append(owner)
    for owner, local_name, name, param in found:
        if not _is_marker(param):
            continue
        if id(param) not in replaced:
            replaced[id(param)] = _plain(param)
            if all(_casts_to_fp8(holder) for holder in holders[id(param)]):
                casts[name] = _fp8_cast(owner)
        owner._parameters[local_name] = replaced[id(param)]
    return casts


def _casts_to_fp8(module: nn.Module) -> bool:
    """Whether ``module`` reads its weight only through torchao's fp8 cast (a float8 linear):
    a weight also held by another module (tied back to an embedding after conversion) is read
    whole there, so it is not gathered in fp8."""
    return hasattr(getattr(module, "config", None), "cast_config_weight")


def _fp8_cast(owner: nn.Module) -> Fp8Cast:
    """How the module's config (torchao's ``Float8LinearConfig``) casts its weight."""
    config = getattr(owner, "config", None)
    weight = getattr(config, "cast_config_weight", None)
    dtype = getattr(weight, "target_dtype", None) or torch.float8_e4m3fn  # (torchao's default)
    return Fp8Cast(dtype, bool(getattr(config, "round_scales_to_power_of_2", False)))


def fp8_marked(module: nn.Module) -> dict[str, Fp8Cast]:
    """How each param of torchao's fp8-gather marker class would be cast, by name, without
    replacing anything (what ``make_plain`` returns, for a plan)."""
    first: dict[int, tuple[str, nn.Module]] = {}
    holders: dict[int, list[nn.Module]] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for local_name, param in owner._parameters.items():
            if param is not None and is_wrapper(param) and _is_marker(param):
                name = f"{owner_name}.{local_name}" if owner_name else local_name
                first.setdefault(id(param), (name, owner))
                holders.setdefault(id(param), []).append(owner)
    return {
        name: _fp8_cast(owner)
        for key, (name, owner) in first.items()
        if all(_casts_to_fp8(holder) for holder in holders[key])
    }


def frozen_wrappers(module: nn.Module) -> set[int]:
    """Ids of the frozen params of a wrapper class: they are replicated at every stage."""
    return {id(p) for p in module.parameters() if not p.requires_grad and is_wrapper(p)}


def _refused(name: str, param: nn.Parameter) -> TypeError:
    inner = param._local_tensor if isinstance(param, DTensor) else param
    cls = type(inner)
    return TypeError(
        f"param {name!r} is a {cls.__module__}.{cls.__qualname__}, a tensor subclass that keeps "
        "its values in inner tensors: flatshard holds a param's values in a flat buffer through "
        "its .data, which does not reach them, so the optimizer would step values the model never "
        "reads. Train it as a plain param (flatshard casts and gathers params itself), or freeze "
        "it (requires_grad=False): a frozen one of a class with __tensor_flatten__ is replicated "
        "on every rank "
        "([Note: tensor-subclass params])"
    )
