"""flatshard under a real ``accelerate.Accelerator``, prepared by accelerate's own
``accelerator.prepare`` once ``flatshard.hosts.accelerate`` is imported, against accelerate's
own DDP on the plain model in the same loop: ``accumulate`` over 2
micro-batches, ``accelerator.backward``, ``clip_grad_norm_`` on the sync steps, a scheduler,
at stages 0-3 on 2 ranks and on 3.

Tolerance: as in ``test_hosts_hf.py`` (the same model, data and optimizer): each micro-batch's
loss and each clip's norm within 1e-5 relative of DDP's.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from _hosted import Tokens, tiny_llama
from flatshard.toolkit.testing import run_distributed

accelerate = pytest.importorskip("accelerate")
load_file = pytest.importorskip("safetensors.torch").load_file


def _loop(accelerator, model, optimizer, loader, schedule, after=None) -> list[tuple[float, float]]:
    """The loop accelerate's docs teach; (loss, clip's norm or 0.0) per micro-batch;
    ``after(i)`` after micro-batch ``i``."""
    out = []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 0.5) if accelerator.sync_gradients else 0.0
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        out.append((float(loss), float(norm)))
        if after is not None:
            after(i)
    return out


def _side(model, flat_stage: int | None, through: str = "accelerate", freeze: bool = False, offload=None):
    """``through``: accelerate's own ``prepare``, or flatshard's ``prepare`` (its checks).
    ``freeze``: the first decoder layer is frozen after step 2, each side finding unused
    params (DDP's ``find_unused_parameters=True``, as it needs for a param that stops getting
    grads; flatshard's, which stage 3 needs). ``offload``: ``shard``'s ``offload=``."""
    import flatshard
    import flatshard.hosts.accelerate as fa

    handlers = [accelerate.DistributedDataParallelKwargs(find_unused_parameters=True)] if freeze else []
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=handlers)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    if flat_stage is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        model = flatshard.shard(model, stage=flat_stage, find_unused_parameters=freeze, offload=offload)
        optimizer = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
        assert (optimizer.offload is not None) == (offload is not None), optimizer.offload
    prepare = accelerator.prepare if through == "accelerate" else lambda *o: fa.prepare(accelerator, *o)
    model, optimizer, loader = prepare(model, optimizer, loader)
    if flat_stage is not None:
        assert not isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    schedule = accelerator.prepare(torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.25, total_iters=4))

    def freeze_layer_0_after_step_2(i: int) -> None:  # (a progressive schedule's second phase)
        if i == 3:
            for name, p in model.named_parameters():
                if ".layers.0." in name:
                    p.requires_grad_(False)

    return _loop(
        accelerator, model, optimizer, loader, schedule, freeze_layer_0_after_step_2 if freeze else None
    )


def _against_ddp(stages: list[int]) -> dict:
    model = tiny_llama()
    logged = {"ddp": _side(copy.deepcopy(model), None)}
    for stage in stages:
        logged[stage] = _side(copy.deepcopy(model), stage)
    logged["flatshard's prepare"] = _side(copy.deepcopy(model), stages[-1], through="flatshard")
    return logged


def _frozen_against_ddp(stages: list[int]) -> dict:
    model = tiny_llama()
    logged = {"ddp": _side(copy.deepcopy(model), None, freeze=True)}
    for stage in stages:
        logged[stage] = _side(copy.deepcopy(model), stage, freeze=True)
    return logged


def _offloaded_against_ddp(stages: list[int]) -> dict:
    """The optimizer's state on the host, stepped there and streamed to the device for its
    step (on this CPU one memory, so the arithmetic is DDP's: the host step takes torch's
    fused CPU kernel at fp32, as DDP's AdamW does not; within the same 1e-5)."""
    import flatshard

    model = tiny_llama()
    logged = {"ddp": _side(copy.deepcopy(model), None)}
    for stage in stages:
        for step in ("host", "device"):
            offload = flatshard.Offload(step=step)
            logged[f"{stage}, stepped on the {step}"] = _side(copy.deepcopy(model), stage, offload=offload)
    return logged


@pytest.mark.parametrize(
    ("world_size", "stages", "run"),
    [
        (2, [0, 1, 2, 3], _against_ddp),
        (3, [2, 3], _against_ddp),
        (2, [1, 3], _frozen_against_ddp),
        (2, [1, 3], _offloaded_against_ddp),
    ],
    ids=["2", "3", "a layer frozen mid-run", "the optimizer offloaded"],
)
def test_the_accelerate_loop_follows_its_ddp(world_size, stages, run):
    """With a layer frozen after step 2, DDP skips it from step 3 on; so does flatshard
    (before, it kept moving under AdamW's momentum and decay). Freezing on one side only
    moves the norms of steps 3-4 by 11-13%."""
    for logged in run_distributed(run, world_size, stages, init=False):
        want = logged.pop("ddp")
        synced = [norm for _, norm in want if norm]
        assert len(synced) >= 2 and all(n > 0.5 for n in synced), want  # (each sync step clips)
        for stage, got in logged.items():
            assert len(got) == len(want), (stage, got, want)
            for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
                assert loss == pytest.approx(loss_ref, rel=1e-5), (stage, got, want)
                assert norm == pytest.approx(norm_ref, rel=1e-5), (stage, got, want)


def _steps(out: str, stage: int, save: bool) -> dict:
    """The loop above on a sharded model; ``save``: ``accelerator.save_state`` after step 2
    (micro-batch 4) and ``save_model`` at the end; else ``load_state`` of that state first
    and the loader skips the 4 micro-batches it holds."""
    import flatshard
    import flatshard.hosts.accelerate

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = flatshard.shard(tiny_llama(), stage=stage)
    optimizer = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedule = accelerator.prepare(torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.25, total_iters=4))
    if not save:
        accelerator.load_state(f"{out}/state")
        loader = accelerator.skip_first_batches(loader, 4)
    start, saved = model.full_state_dict(), {}

    def save_after_step_2(i: int) -> None:
        if save and i == 3:
            accelerator.save_state(f"{out}/state")
            saved.update(model.full_state_dict())

    logged = _loop(accelerator, model, optimizer, loader, schedule, after=save_after_step_2)
    if save:
        accelerator.save_model(model, f"{out}/model")
    return {"logged": logged, "start": start, "saved": saved, "end": model.full_state_dict()}


def test_save_state_and_load_state_resume_exactly_and_at_another_world_size_and_stage(tmp_path):
    """``accelerator.save_state`` after step 2 of 4 on 2 ranks at stage 2: ``load_state`` on 2
    ranks gives steps 3-4 to the bit; on 3 ranks at stage 3 the run starts from the saved
    params, to the bit. ``save_model`` writes the full weights (gathered from the shards)."""
    whole = run_distributed(_steps, 2, str(tmp_path), 2, True, init=False)
    assert "flatshard" in os.listdir(tmp_path / "state"), os.listdir(tmp_path / "state")
    assert not any(name.startswith("optimizer") for name in os.listdir(tmp_path / "state"))
    resumed = run_distributed(_steps, 2, str(tmp_path), 2, False, init=False)
    for a, b in zip(whole, resumed, strict=True):
        assert b["logged"] == a["logged"][4:], (a["logged"], b["logged"])
    elsewhere = run_distributed(_steps, 3, str(tmp_path), 3, False, init=False)
    assert all(torch.equal(elsewhere[0]["start"][k], v) for k, v in whole[0]["saved"].items())
    loaded = load_file(tmp_path / "model" / "model.safetensors")
    assert loaded and all(torch.equal(v, whole[0]["end"][k]) for k, v in loaded.items()), (
        "save_model wrote others"
    )
