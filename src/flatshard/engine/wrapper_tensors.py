"""Wrapper tensors: tensor subclasses that keep their values in inner tensors, which
``.data`` does not reach: whether a tensor is one, the plain tensors that hold its values,
and a copy of it ([Note: tensor-subclass params] in ``wrap/subclass_params.py``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["copy_to", "inner_values", "is_wrapper"]


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values live in inner tensors that ``.data`` does not reach: a
    tensor subclass with its own ``__torch_dispatch__`` (a DTensor is judged by its local
    shard)."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    dispatch = getattr(type(tensor), "__torch_dispatch__", None)
    plain = torch.Tensor.__torch_dispatch__
    return dispatch is not None and getattr(dispatch, "__func__", dispatch) is not getattr(
        plain, "__func__", plain
    )


def inner_values(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s values, for a broadcast to write into: a
    DTensor's local shard, a wrapper's inner tensors (``__tensor_flatten__``, recursively),
    else the tensor itself."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    if not _traceable(tensor):
        return [tensor.data if isinstance(tensor, nn.Parameter) else tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [t for name in names for t in inner_values(getattr(tensor, name))]


def copy_to(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``; a wrapper is rebuilt around copies of its inner
    tensors (its own ``clone`` may requantize: torchao's NF4 does)."""
    if isinstance(tensor, DTensor) or not _traceable(tensor):
        return tensor.detach().to(device, copy=True)
    names, meta = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: copy_to(getattr(tensor, name), device) for name in names}
    return type(tensor).__tensor_unflatten__(inner, meta, tensor.size(), tensor.stride())  # type: ignore[attr-defined]


def _traceable(tensor: torch.Tensor) -> bool:
    """A wrapper whose inner tensors it names (``__tensor_flatten__``)."""
    return is_wrapper(tensor) and hasattr(type(tensor), "__tensor_flatten__")
