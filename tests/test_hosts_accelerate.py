"""flatshard under a real ``accelerate.Accelerator`` (``flatshard.hosts.accelerate.prepare``),
against accelerate's own DDP on the plain model in the same loop: ``accumulate`` over 2
micro-batches, ``accelerator.backward``, ``clip_grad_norm_`` on the sync steps, a scheduler,
at stages 0-3 on 2 ranks and on 3.

Tolerance: as in ``test_hosts_hf.py`` (the same model, data and optimizer): each micro-batch's
loss and each clip's norm within 1e-5 relative of DDP's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from flatshard.toolkit.testing import run_distributed
from test_hosts_hf import _model, _Tokens

accelerate = pytest.importorskip("accelerate")


def _loop(accelerator, model, optimizer, loader, schedule) -> list[tuple[float, float]]:
    """The loop accelerate's docs teach; (loss, clip's norm or 0.0) per micro-batch."""
    out = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 0.5) if accelerator.sync_gradients else 0.0
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        out.append((float(loss), float(norm)))
    return out


def _side(model, flat_stage: int | None):
    import flatshard
    from flatshard.hosts.accelerate import prepare

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2, shuffle=False)
    if flat_stage is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        prepared = accelerator.prepare(model, optimizer, loader)
    else:
        model = flatshard.shard(model, stage=flat_stage)
        optimizer = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
        prepared = prepare(accelerator, model, optimizer, loader)
    model, optimizer, loader = prepared
    schedule = accelerator.prepare(torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.25, total_iters=4))
    return _loop(accelerator, model, optimizer, loader, schedule)


def _against_ddp(stages: list[int]) -> dict:
    model = _model()
    logged = {"ddp": _side(copy.deepcopy(model), None)}
    for stage in stages:
        logged[stage] = _side(copy.deepcopy(model), stage)
    return logged


@pytest.mark.parametrize(("world_size", "stages"), [(2, [0, 1, 2, 3]), (3, [2, 3])])
def test_the_accelerate_loop_follows_its_ddp(world_size, stages):
    for logged in run_distributed(_against_ddp, world_size, stages, init=False):
        want = logged.pop("ddp")
        synced = [norm for _, norm in want if norm]
        assert len(synced) >= 2 and all(n > 0.5 for n in synced), want  # (each sync step clips)
        for stage, got in logged.items():
            assert len(got) == len(want), (stage, got, want)
            for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
                assert loss == pytest.approx(loss_ref, rel=1e-5), (stage, got, want)
                assert norm == pytest.approx(norm_ref, rel=1e-5), (stage, got, want)
