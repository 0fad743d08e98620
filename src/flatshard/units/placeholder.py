"""Stage 3's placeholders: what a sharded param is while its unit is not gathered.

The reasoning is [Note: placeholders] below."""

# [Note: placeholders]
#
# Between uses a stage-3 param's ``.data`` is a placeholder tensor (one NaN expanded to the
# param's shape, [Note: full buckets] in ``units/full_buckets.py``), and the param object
# itself is switched to the class ``Placeholder``, a ``nn.Parameter`` whose
# ``__torch_function__`` refuses every operation that would read or copy its values with a
# ``ShardedParamError`` naming the param, its unit and the operation. So a param read
# outside the forward of the unit that holds it (a weight used in the loss after
# ``model(x)``, user code holding a tied weight, an EMA copy, ``torch.save(model)``) raises
# before any result exists, where it used to compute on NaN (the storage-freeing of
# FSDP1/FSDP2 is not an option on CPU: a tensor whose storage holds no bytes crashes kernels
# that read it, and a tensor subclass cannot be ``.data``).
#
# Invariants:
#
# * A param is a ``Placeholder`` exactly while its ``.data`` is its placeholder: ``show`` and
#   ``hide`` (called by ``FullBuckets.point``, the only place that swaps ``.data`` at
#   stage 3) change both together. A gathered param is a plain ``nn.Parameter`` again, so
#   inside a unit's forward (eager or compiled) there is no extra dispatch: the cost is one
#   class assignment per param per gather and free, beside the ``.data`` assignment already
#   made there. Reading a placeholder's metadata costs a Python dispatch (2.4 µs against
#   0.1 µs), so flatshard's own per-step reads of every param (the change check before a
#   forward, ``zero_grad``) run with subclass dispatch off: no placeholder dispatch in a step.
# * ``detach()`` gives a detached placeholder, labelled alike: a submodule's ``state_dict()``
#   (peft reads its ``modules_to_save`` copy's for the keys) has entries that refuse reads
#   as the param does, instead of failing where nothing is read.
# * What stays allowed is what reads no values: shape, dtype, device, ``numel()``,
#   ``requires_grad`` (get, set, ``requires_grad_``), ``.grad`` (get, set), hooks, hashing,
#   ``.data`` assignment, and new tensors of its shape (``torch.zeros_like(p)``,
#   ``p.new_empty(...)``). So ``named_parameters()``, ``model.device`` and ``model.dtype``
#   (as ``transformers`` computes them), counting params and ``zero_grad`` work as before.
# * A param of another ``nn.Parameter`` subclass is switched to a placeholder class of its
#   own (``Placeholder`` mixed into its class, made once per class) and back to its class when
#   shown, so it refuses the same reads (it computed on the NaN placeholder before). A DTensor
#   param keeps its object and class: its local shard is the placeholder.
# * ``copy_`` into a placeholder inside ``loading_into(load)`` is ``load(param, value)``: so
#   ``model.load_state_dict`` at stage 3 runs torch's own load (the modules' load-state-dict
#   hooks, renames and shape checks included) and each param's value lands in this rank's
#   shard of it. Outside, a ``copy_`` is refused like any write.

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from flatshard.engine.tensor_parallel import local, rebind
from flatshard.errors import ShardedParamError

Tensor = torch.Tensor
_Descriptors: Any = torch.Tensor  # (its properties' __get__/__set__, which the stubs type as values)

_READS_NO_VALUES = frozenset(
    [
        _Descriptors.shape.__get__,
        _Descriptors.dtype.__get__,
        _Descriptors.device.__get__,
        _Descriptors.layout.__get__,
        _Descriptors.ndim.__get__,
        _Descriptors.is_meta.__get__,
        _Descriptors.is_cuda.__get__,
        _Descriptors.is_sparse.__get__,
        _Descriptors.is_leaf.__get__,
        _Descriptors.grad_fn.__get__,
        _Descriptors.requires_grad.__get__,
        _Descriptors.requires_grad.__set__,
        _Descriptors.grad.__get__,
        _Descriptors.grad.__set__,
        _Descriptors.data.__set__,
        Tensor.size,
        Tensor.dim,
        Tensor.numel,
        Tensor.nelement,
        Tensor.element_size,
        Tensor.is_floating_point,
        Tensor.is_complex,
        Tensor.get_device,
        Tensor.requires_grad_,
        Tensor.register_hook,
        Tensor.register_post_accumulate_grad_hook,
        Tensor.__hash__,
        # new tensors of its shape, dtype and device (an EMA copy starts as zeros_like(p))
        torch.zeros_like,
        torch.ones_like,
        torch.empty_like,
        torch.full_like,
        torch.rand_like,
        torch.randn_like,
        Tensor.new_zeros,
        Tensor.new_ones,
        Tensor.new_empty,
        Tensor.new_full,
    ]
)


# Set on a param while ``flatshard.offload_states`` holds its bytes on the host: a refused
# read says so ([Note: states between phases] in ``flatshard/phases.py``).
OFFLOADED = "flatshard_offloaded"

Load = Callable[[nn.Parameter, torch.Tensor], None]
_LOADING: ContextVar[Load | None] = ContextVar("flatshard_loading", default=None)


@contextmanager
def loading_into(load: Load) -> Iterator[None]:
    """Within: ``placeholder.copy_(value)`` is ``load(placeholder, value)``."""
    token = _LOADING.set(load)
    try:
        yield
    finally:
        _LOADING.reset(token)


class Placeholder(nn.Parameter):
    """A stage-3 param whose values are not gathered: see [Note: placeholders]."""

    shown_class: type = nn.Parameter  # the class the param has while gathered

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _READS_NO_VALUES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        load = _LOADING.get()
        if func is Tensor.copy_ and load is not None and isinstance(args[0], Placeholder):
            load(args[0], args[1])
            return args[0]
        param = next((a for a in _tensors(args, kwargs) if isinstance(a, Placeholder)), None)
        where = getattr(param, "sharded_where", "a sharded param")
        if func is Tensor.detach and param is not None:  # (a stand-in that refuses reads alike)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {})).as_subclass(type(param))
            label(out, where)  # type: ignore[arg-type]
            return out
        op = getattr(func, "__name__", str(func))
        if op in ("__get__", "__set__"):  # (a property: name it, as in ``param.data``)
            op = getattr(func.__self__, "__name__", op)
        if getattr(param, OFFLOADED, False):
            raise ShardedParamError(
                f"{where} was read by {op!r} while the model's states are offloaded "
                "(flatshard.offload_states): call flatshard.reload_states(model) first "
                "([Note: states between phases] in flatshard/phases.py)"
            )
        raise ShardedParamError(
            f"{where} was read by {op!r} while it is sharded (stage 3): only its unit's forward "
            "and backward see its values. Read it inside a module of that unit, or inside "
            "`with model.summon_full_params():`; to step it, use flatshard.DistributedOptimizer "
            "(a torch optimizer over model.parameters() cannot)"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        where = getattr(self, "sharded_where", "a sharded param")  # (labelled once its unit is known)
        return f"Placeholder({where}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _tensors(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from _tensors(a, None)
        elif isinstance(a, Tensor):
            yield a


def label(param: nn.Parameter, where: str) -> None:
    """What a refused read names: "param 'blocks.0.attn.weight' of unit 3 (blocks.0)"."""
    setattr(param, "sharded_where", where)  # noqa: B010 (an attribute of our own on a torch param)


_PLACEHOLDER_CLASSES: dict[type, type[Placeholder]] = {nn.Parameter: Placeholder}


def placeholder_class(cls: type) -> type[Placeholder] | None:
    """The placeholder class of params of class ``cls`` (None for a DTensor's, whose class is
    DTensor's own)."""
    if issubclass(cls, Placeholder):  # (hidden already)
        return cls
    found = _PLACEHOLDER_CLASSES.get(cls)
    if found is None and issubclass(cls, nn.Parameter):
        names = {"__module__": cls.__module__, "__qualname__": f"Placeholder[{cls.__qualname__}]"}
        found = type(f"Placeholder[{cls.__name__}]", (Placeholder, cls), {**names, "shown_class": cls})
        _PLACEHOLDER_CLASSES[cls] = found
    return found


def hide(param: nn.Parameter, placeholder: torch.Tensor) -> None:
    """Make ``param`` a ``Placeholder`` over ``placeholder`` (a DTensor param: its local
    shard the placeholder, its class kept)."""
    if type(param) is nn.Parameter:  # (the common case: one .data assignment, no dispatch)
        param.data = placeholder
        param.__class__ = Placeholder
        return
    switched = placeholder_class(type(param))
    rebind(param, placeholder)  # (subclass dispatch off for a subclass of its own)
    if switched is not None:
        param.__class__ = switched


def show(param: nn.Parameter, view: torch.Tensor, placeholder: torch.Tensor) -> None:
    """Make ``param`` a plain ``nn.Parameter`` over ``view``, its gathered values. A
    ``.data`` rebound while sharded (neither placeholder nor view) would be overwritten
    here without a word: refused instead."""
    with torch._C.DisableTorchFunctionSubclass():
        where = local(param).data_ptr()
    if where not in (placeholder.data_ptr(), view.data_ptr()):
        name = getattr(param, "sharded_where", "a stage-3 param")
        raise ShardedParamError(
            f"{name} had its .data rebound while sharded (outside its unit's forward and "
            "outside summon_full_params): gathering it would overwrite that write. Write params "
            "inside `with model.summon_full_params():` (written back on exit), or load values "
            "with model.load_state_dict"
        )
    if type(param) is Placeholder:
        setattr(param, "__class__", nn.Parameter)  # noqa: B010 (mypy narrows the class otherwise)
        param.data = view
    elif isinstance(param, Placeholder):  # (another Parameter subclass: its own class again)
        setattr(param, "__class__", type(param).shown_class)  # noqa: B010
        rebind(param, view)
    else:  # (a DTensor)
        rebind(param, view)
