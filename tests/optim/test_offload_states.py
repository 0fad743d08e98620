"""``flatshard.offload_states`` / ``reload_states``: every training byte of a sharded model
and its optimizer to the host between phases and back, bit for bit ([Note: states between
phases] in ``flatshard/phases.py``).

On this CPU machine host and device are one memory: the device's storages are really freed
(``memory_report`` counts none on the device) and really refilled, so the trajectories
check that every byte came back and the report checks that none stayed."""

import pytest
import torch

import flatshard
from _parity import TiedGPT
from _subclasses import qlora
from flatshard import Buckets, MixedPrecision, Offload, ShardedParamError
from flatshard.engine.wrapper_tensors import inner_values
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

STAGES = [0, 1, 2, 3]


def _train(stage: int, offload_at: int | None, steps: int = 4, **shard_kwargs) -> tuple[dict, list]:
    """The tied GPT (a frozen param beside the trainable ones) trained ``steps`` steps with
    AdamW and clipping; after step ``offload_at`` its states go to the host and back, the
    second time through ``flatshard.offloaded``. Returns the full state dict and the memory
    reports before, during and after."""
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage, buckets=Buckets(size=3000), **shard_kwargs)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    corpus, rank = SyntheticCorpus(64, 16), torch.distributed.get_rank()
    reports = []
    for step in range(steps):
        model(*corpus.batch(step, rank, 4)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        if step == offload_at:  # (grads still held: they come back too)
            model.wait_for_params()
            reports.append(flatshard.memory_report(model, opt))
            flatshard.offload_states(model)
            reports.append(flatshard.memory_report(model, opt))
            flatshard.reload_states(model)
            reports.append(flatshard.memory_report(model, opt))
        opt.zero_grad()
        if step == offload_at:
            with flatshard.offloaded(model):
                reports.append(flatshard.memory_report(model, opt))
    return model.full_state_dict(), reports


def _offloaded_against_not(stages: list[int], **shard_kwargs) -> dict:
    out = {}
    for stage in stages:
        plain, _ = _train(stage, None, **shard_kwargs)
        moved, reports = _train(stage, 1, **shard_kwargs)
        same = sorted(plain) == sorted(moved) and all(torch.equal(plain[k], moved[k]) for k in plain)
        out[stage] = (same, [r.as_dict() for r in reports])
    return out


def _check(results: dict) -> None:
    for stage, (same, (before, during, after, zeroed)) in results.items():
        assert same, stage
        assert during["device"] == 0 and during["total"] == during["host"] == before["total"], stage
        assert after == before, stage
        assert zeroed["device"] == 0 and zeroed["grads"] <= before["grads"], stage


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_states_offloaded_between_steps_come_back_bit_exact(world_size):
    """fp32 params, AdamW, clipping: after two offloads and reloads (one with grads held)
    the run equals one without, bit for bit, at every stage; while offloaded the device
    holds none of the bytes and the host all of them."""
    (results, *_) = run_distributed(_offloaded_against_not, world_size, STAGES)
    _check(results)


def test_bf16_params_and_the_host_optimizer_come_back_bit_exact():
    """bf16 params with fp32 main params (stage 3: the main params are the shards), and
    ``Offload()`` (the optimizer already on the host: it stays there), stepped on the host and
    streamed to the device ([Note: streamed step]), on 2 ranks."""
    (bf16, *_) = run_distributed(
        _offloaded_against_not, 2, STAGES, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)
    )
    _check(bf16)
    for offload in (Offload(), Offload(step="device", stream_chunk=700)):
        (host, *_) = run_distributed(_offloaded_against_not, 2, [1, 3], offload=offload)
        _check(host)


def _refusals(stage: int) -> list[str]:
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    corpus = SyntheticCorpus(64, 16)
    model(*corpus.batch(0, 0, 4)).backward()
    opt.step()
    flatshard.offload_states(model)
    uses = [
        lambda: model(*corpus.batch(1, 0, 4)),
        opt.step,
        opt.zero_grad,
        lambda: model.wte.weight + 1,
        model.full_state_dict,
        lambda: flatshard.offload_states(model),
        lambda: model.blocks[0].ln1.weight.sum(),  # (frozen: below stage 3 outside the buffers)
    ]
    errors = []
    for use in uses:
        try:
            use()
            errors.append("no error")
        except (RuntimeError, ShardedParamError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    flatshard.reload_states(model)
    model(*corpus.batch(1, 0, 4)).backward()  # (and it trains again)
    opt.step()
    return errors


@pytest.mark.parametrize("stage", [1, 3])
def test_while_offloaded_every_use_is_refused_naming_reload(stage):
    """A forward, the optimizer's step and zero_grad, a read of a param, a state dict: each
    an error naming ``reload_states``, never a crash on a freed storage; offloading twice
    is an error too; a frozen param outside the buffers (below stage 3) stays readable, on
    the host."""
    ((forward, step, zero, read, state_dict, twice, frozen),) = run_distributed(_refusals, 1, stage)
    for message in (forward, step, zero, read, state_dict):
        assert "reload_states" in message, message
    assert forward.startswith("RuntimeError: a forward ran")
    assert read.startswith("ShardedParamError: param 'wte.weight'") and "'add'" in read
    assert "offloaded already" in twice
    if stage < 3:
        assert frozen == "no error"
    else:  # (sharded with its unit at stage 3: a placeholder as the others)
        assert "reload_states" in frozen


def test_a_model_not_sharded_is_refused():
    with pytest.raises(TypeError, match=r"flatshard\.shard"):
        flatshard.offload_states(torch.nn.Linear(2, 2))


def _compiled(stage: int, offload_at: int | None) -> dict:
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=stage)
    run = torch.compile(model, backend="aot_eager")  # ([Note: compile backends in the suite])
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    corpus, rank = SyntheticCorpus(64, 16), torch.distributed.get_rank()
    for step in range(3):
        run(*corpus.batch(step, rank, 4)).backward()
        opt.step()
        opt.zero_grad()
        if step == offload_at:
            with flatshard.offloaded(run):  # (the compiled wrapper is taken as the model)
                pass
    return model.full_state_dict()


def _compiled_against_not(stage: int) -> bool:
    plain, moved = _compiled(stage, None), _compiled(stage, 0)
    return all(torch.equal(plain[k], moved[k]) for k in plain)


def test_a_compiled_model_comes_back_bit_exact():
    """``torch.compile`` over the stage-3 model: its graphs run on the reloaded storages
    (same tensors, new memory) as before, on 2 ranks."""
    assert run_distributed(_compiled_against_not, 2, 3) == [True, True]


def _qlora_offloaded(stage: int) -> list:
    """The NF4 base is a frozen wrapper (replicated): its inner tensors go to the host."""
    model = flatshard.shard(qlora(0), stage=stage)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    base = [t.clone() for t in inner_values(model[0].weight)]
    with flatshard.offloaded(model):
        during = flatshard.memory_report(model, opt).as_dict()
    after = inner_values(model[0].weight)
    out = model(x).sum()
    return [during["device"], all(torch.equal(a, b) for a, b in zip(base, after, strict=True)), float(out)]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_frozen_nf4_base_goes_to_the_host_and_back(stage):
    """QLoRA-shaped: the adapters in the buffers, the NF4 base replicated; nothing stays on
    the device, the base's bytes come back equal and the model runs."""
    for device_bytes, same, loss in run_distributed(_qlora_offloaded, 2, stage):
        assert device_bytes == 0 and same and loss == loss
