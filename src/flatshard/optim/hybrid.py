"""``HybridDeviceOptimizer``: part of the update on the host, the rest on the device.

A composite optimizer ([Note: composite optimizers] in ``optim/composite.py``). The first
``offload_fraction`` of the params (by element count, in param-group order) keep their
optimizer state and take their update on the host; the rest stay on the device. 16-bit
params get fp32 masters on the side that updates them. As the inner optimizer of
``DistributedOptimizer`` it offloads this rank's shard (the fp32 main params stay on the
device; their state moves).

The reasoning is [Note: host overlap] below."""

# [Note: host overlap]
#
# A param is offloaded when its midpoint, counted in elements in group order, falls within the
# first ``offload_fraction`` of all elements, and it holds at least ``offload_threshold``
# elements: a smaller one (a norm's weight, a bias) stays on the device, where its update
# costs less than two copies and, with ``overlap``, a host optimizer of its own (as DeepSpeed
# keeps params under its persistence threshold whole). The fraction still counts every
# element, so the share offloaded is at most ``offload_fraction``. With ``overlap=True`` each
# host param has its
# own sub-optimizer: all device-to-host grad copies are issued first on a side stream with one
# event each, then the device sub-optimizer steps (on the compute stream), then each host sub-
# optimizer waits only for its own event, steps, and issues its host-to-device copy on a
# second side stream; the compute stream waits for that stream before ``step`` returns, so the
# next forward sees the new values without blocking the host. Host buffers the copies read are
# pinned; before the host rewrites one, it waits for the copy that last read it. Without an
# accelerator the same code runs with same-device copies and no streams.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from flatshard.engine.tensor_parallel import refuse_distributed_params
from flatshard.optim.composite import CompositeOptimizer, SubOptimizer, run_closure
from flatshard.planner.mixed_precision import HALF_DTYPES
from flatshard.planner.offload import offloaded_items


@dataclass
class _HostCopy:
    """An offloaded param: the host tensors its update reads and writes, and the events
    that order the copies between host and device."""

    param: torch.Tensor  # the user's param, on its device
    master: torch.Tensor  # host copy the host optimizer updates (fp32 for 16-bit params)
    grad: torch.Tensor  # host buffer the param's grad is copied into (param dtype)
    upload: torch.Tensor  # host tensor the device param is copied from (master if dtypes agree)
    grad32: torch.Tensor | None  # fp32 grad of a 16-bit param's master, else None
    downloaded: Any = None  # CUDA event: grad copy to the host done
    uploaded: Any = None  # CUDA event: the last copy out of ``upload`` done

    @property
    def half(self) -> bool:
        return self.upload is not self.master


class SideStreams:
    """The two side streams of a CUDA device for copies over the host link: device->host and
    host->device (the hybrid step's grads and params, the streamed step's chunks)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def compute(self):
        return torch.cuda.current_stream(self.device)


class HybridDeviceOptimizer(CompositeOptimizer):
    """A torch optimizer that updates the first ``offload_fraction`` of ``params`` on the
    host (with ``cpu_optimizer_class``) and the rest on their device.

    Args:
        params: params or param groups, as for any torch optimizer.
        offload_fraction: share of the elements updated on the host, in [0, 1]. A param is
            offloaded when the middle of its elements, counted in group order, falls within
            that share.
        offload_threshold: params with fewer elements stay on the device even within that
            share (default 0: none does).
        cpu_optimizer_class: the torch optimizer class of the host updates.
        device_optimizer_class: that of the device updates (default: the same class).
        overlap: one host optimizer per param, each stepping as soon as its own grad has
            reached the host and sending its param back at once (True), or one host step
            after every grad has arrived (False).
        pin_memory: page-locked host buffers, so the copies are asynchronous (CUDA only).
        **defaults: hyperparameters (``lr``, ``weight_decay``, ...) for both classes.

    ``state[param]`` is the owning sub-optimizer's state (on the host for offloaded
    params); ``param_groups`` changes reach every sub-optimizer at the next ``step``.
    The host keeps its own copy of each offloaded param: after changing params by hand
    (loading weights), call ``reload_model_params()`` (``load_state_dict`` does it).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        offload_fraction: float,
        cpu_optimizer_class: type[torch.optim.Optimizer],
        offload_threshold: int = 0,
        device_optimizer_class: type[torch.optim.Optimizer] | None = None,
        overlap: bool = True,
        pin_memory: bool = True,
        **defaults: Any,
    ) -> None:
        if not 0.0 <= float(offload_fraction) <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction!r}")
        if (
            isinstance(offload_threshold, bool)
            or not isinstance(offload_threshold, int)
            or offload_threshold < 0
        ):
            raise ValueError(f"offload_threshold must be an int >= 0 (elements), got {offload_threshold!r}")
        device_optimizer_class = device_optimizer_class or cpu_optimizer_class
        super().__init__(params, [cpu_optimizer_class, device_optimizer_class], defaults)
        refuse_distributed_params(
            [p for g in self.param_groups for p in g["params"]], "HybridDeviceOptimizer"
        )
        self.offload_fraction = float(offload_fraction)
        self.offload_threshold = offload_threshold
        self.overlap = overlap
        ordered = self.ordered_params()
        offloaded = offloaded_items([p.numel() for _, p in ordered], self.offload_fraction, offload_threshold)
        self._host: list[_HostCopy] = []
        self._host_subs: list[tuple[SubOptimizer, list[_HostCopy]]] = []
        self._device_masters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (16-bit param, fp32 master)
        self._device_sub: SubOptimizer | None = None
        host_pairs, device_pairs = [], []
        for (g, param), off in zip(ordered, offloaded, strict=True):
            if off:
                copy = _host_copy(param, pin_memory)
                self._host.append(copy)
                host_pairs.append((g, param, copy.master, copy))
            else:
                stand_in = param
                if param.dtype in HALF_DTYPES:
                    stand_in = param.detach().float()
                    self._device_masters.append((param, stand_in))
                device_pairs.append((g, param, stand_in))
        if device_pairs:
            self._device_sub = self.add_sub(device_optimizer_class, device_pairs, kind=1)
        chunks = [[pair] for pair in host_pairs] if overlap else [host_pairs] if host_pairs else []
        for chunk in chunks:
            sub = self.add_sub(cpu_optimizer_class, [pair[:3] for pair in chunk], kind=0)
            self._host_subs.append((sub, [pair[3] for pair in chunk]))
        devices = {c.param.device for c in self._host if c.param.device.type == "cuda"}
        if len(devices) > 1:
            raise ValueError(f"offloaded params are on several devices {sorted(map(str, devices))}; use one")
        self._streams = SideStreams(devices.pop()) if devices else None

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = run_closure(closure)
        self.push_hyperparameters()
        self._download_grads()
        self._step_device()
        for sub, copies in self._host_subs:
            self._step_host(sub, copies)
        if self._streams is not None:
            self._streams.compute().wait_stream(self._streams.h2d)
        self.link_state()
        return loss

    def _download_grads(self) -> None:
        """Issue every offloaded param's device->host grad copy (on the side stream)."""
        streams = self._streams
        if streams is not None:
            streams.d2h.wait_stream(streams.compute())
            streams.h2d.wait_stream(streams.compute())  # params are read by queued kernels
        for c in self._host:
            grad = c.param.grad
            c.master.grad = None if grad is None else c.grad if c.grad32 is None else c.grad32
            if grad is None:
                continue
            if streams is None or grad.device.type != "cuda":
                c.grad.copy_(grad)
                continue
            with torch.cuda.stream(streams.d2h):
                c.grad.copy_(grad, non_blocking=True)
                c.downloaded = torch.cuda.Event()
                c.downloaded.record(streams.d2h)

    def _step_device(self) -> None:
        if self._device_sub is None:
            return
        for param, master in self._device_masters:
            master.grad = None if param.grad is None else param.grad.float()
        self._device_sub.step()
        for param, master in self._device_masters:
            param.copy_(master)
            master.grad = None

    def _step_host(self, sub: SubOptimizer, copies: list[_HostCopy]) -> None:
        """Wait for ``copies``' grads only, step them on the host, send their params back."""
        for c in copies:
            if c.param.grad is None:
                continue
            if c.downloaded is not None:
                c.downloaded.synchronize()
                c.downloaded = None
            if c.half and c.master.grad is not None:  # (a 16-bit param's master has its fp32 grad)
                c.master.grad.copy_(c.grad)
            if c.uploaded is not None and not c.half:
                c.uploaded.synchronize()  # the master is about to change under the last upload
        sub.step()
        for c in copies:
            if c.param.grad is not None:
                self._upload(c)

    def _upload(self, c: _HostCopy) -> None:
        streams = self._streams
        if c.half:
            if c.uploaded is not None:
                c.uploaded.synchronize()
            c.upload.copy_(c.master)
        if streams is None or c.param.device.type != "cuda":
            c.param.copy_(c.upload)
            return
        with torch.cuda.stream(streams.h2d):
            c.param.copy_(c.upload, non_blocking=True)
            c.uploaded = torch.cuda.Event()
            c.uploaded.record(streams.h2d)

    # -- consistency with the params ----------------------------------------------------------------
    def masters(self) -> dict[torch.Tensor, torch.Tensor]:
        out = {c.param: c.master for c in self._host if c.half}
        out.update(dict(self._device_masters))
        return out

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the params into the host copies and fp32 masters (after loading weights)."""
        if self._streams is not None:
            torch.cuda.synchronize(self._streams.device)
        for c in self._host:
            c.master.copy_(c.param)
        for param, master in self._device_masters:
            master.copy_(param)

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors whose home is the host, by role, for ``memory_report``: the offloaded
        params' host copies (masters), their grad buffers, and their optimizers' state."""
        state = [
            v
            for sub, _ in self._host_subs
            for st in sub.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ]
        grads = [g for c in self._host for g in (c.grad, c.grad32) if g is not None]
        uploads = [c.upload for c in self._host if c.half]
        return {
            "grads": grads,
            "main_params": [c.master for c in self._host] + uploads,
            "optimizer_state": state,
        }

    @property
    def offloaded_params(self) -> list[torch.Tensor]:
        """The params updated on the host, in order."""
        return [c.param for c in self._host]

    def __repr__(self) -> str:
        host = sum(c.param.numel() for c in self._host)
        total = sum(p.numel() for _, p in self.ordered_params())
        return (
            f"HybridDeviceOptimizer({len(self._host)} params, {host} of {total} elements on the host, "
            f"overlap={self.overlap}, {len(self.subs)} sub-optimizers)"
        )


def _host_copy(param: torch.Tensor, pin_memory: bool) -> _HostCopy:
    pin = pin_memory and param.device.type == "cuda"
    host = torch.device("cpu")

    def empty(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(param.shape, dtype=dtype, device=host, pin_memory=pin)

    half = param.dtype in HALF_DTYPES
    master = empty(torch.float32 if half else param.dtype)
    master.copy_(param.detach())
    grad = empty(param.dtype)
    upload = empty(param.dtype) if half else master
    grad32 = torch.empty_like(master) if half else None
    return _HostCopy(param, master, grad, upload, grad32)
