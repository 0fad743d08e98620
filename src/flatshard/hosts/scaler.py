"""A host's torch ``GradScaler`` swapped for a ``ShardedGradScaler`` ([Note: grad scaler] in
``optim/grad_scaler.py``): accelerate's, the HF Trainer's, a Lightning precision plugin's."""

from __future__ import annotations

from typing import Any

import torch

from flatshard.optim.grad_scaler import ShardedGradScaler


def use_sharded_scaler(holder: Any, device: str | None = None) -> None:
    """fp16: ``holder.scaler`` (an accelerator's; a Lightning precision plugin's), a torch
    ``GradScaler``, becomes a ``ShardedGradScaler`` with its settings on ``device`` (default
    the accelerator's) ([Note: grad scaler]); before the optimizer is prepared, which keeps it."""
    old = getattr(holder, "scaler", None)
    if not isinstance(old, torch.amp.GradScaler) or isinstance(old, ShardedGradScaler):
        return
    holder.scaler = ShardedGradScaler(
        device or holder.device.type,
        init_scale=old.get_scale() if old.is_enabled() else 2.0**16,
        growth_factor=old.get_growth_factor(),
        backoff_factor=old.get_backoff_factor(),
        growth_interval=old.get_growth_interval(),
        enabled=old.is_enabled(),
    )
