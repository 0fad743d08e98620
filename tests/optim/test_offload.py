"""``shard(..., offload=Offload())``: the optimizer's main params and state on the host, its
update fused there, and at stage 3 the param shards with them ([Note: memory tiers] in
``planner/offload.py``).

On this CPU machine host and device are one memory, so every copy runs and the homes are
accounted by ownership: the trajectories are the real check, the bytes the second."""

import copy
import os

import pytest
import torch

import flatshard
from _parity import SGD, check_parity, decay_groups, train_optimizer_side_by_side
from flatshard import Buckets, Offload
from flatshard.optim.host_step import host_defaults
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig, tiny_model
from flatshard.toolkit.testing import run_distributed

STAGES = [0, 1, 2, 3]
FUSED = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}  # (both sides: the host's kernel)


def _against_ddp(stages: list[int], share: float = 1.0, **kwargs) -> dict:
    shard = {"buckets": Buckets(size=3000), "offload": Offload(optimizer=share)}
    return {s: train_optimizer_side_by_side({**shard, "stage": s}, **kwargs) for s in stages}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_an_offloaded_adamw_follows_ddp_at_every_stage(world_size):
    """Two param groups, a StepLR schedule, two micro-batches a step; torch's fused AdamW on
    both sides (the kernel the host step picks). [Note: parity tolerances]: AdamW to 1e-5 at
    1-2 ranks, 1e-2 at 3-4 (gloo's summation order)."""
    (results, *_) = run_distributed(
        _against_ddp, world_size, STAGES, opt_kwargs=FUSED, groups=decay_groups, schedule=True
    )
    for stage, result in results.items():
        assert len(result["param_diffs"]) == 4, stage
        check_parity(result, params=1e-5 if world_size <= 2 else 1e-2)


def test_a_share_of_the_optimizer_offloaded_follows_ddp():
    """``Offload(optimizer=0.3)``: the first 30% of each rank's elements stepped on the host
    by a ``HybridDeviceOptimizer`` inside, the rest on the device; 2 ranks, 1e-5."""
    (results, *_) = run_distributed(
        _against_ddp, 2, STAGES, 0.3, opt_kwargs=FUSED, groups=decay_groups, schedule=True
    )
    for result in results.values():
        check_parity(result, params=1e-5)


def test_an_offloaded_sgd_with_clipping_follows_ddp_on_3_ranks():
    """Clipping that binds scales the grads on the device before they are copied to the host:
    SGD with momentum, params to 1e-5 ([Note: parity tolerances])."""
    (results, *_) = run_distributed(_against_ddp, 3, STAGES, **SGD, clip=0.5)
    for result in results.values():
        assert max(result["norm_diffs"]) < 1e-5
        check_parity(result, params=1e-5)


CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)


def _train(stage: int, offload: bool, bf16: bool, steps: int = 3, path: str | None = None) -> dict:
    """The GPT trained ``steps`` steps (clipped AdamW, fused either way), then, at ``path``,
    a write through a param and a checkpoint."""
    torch.manual_seed(0)
    kwargs: dict = {"stage": stage, "buckets": Buckets(size=3000)}
    if bf16:
        kwargs["mixed_precision"] = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    if offload:
        kwargs["offload"] = Offload()
    model = flatshard.shard(GPT(CFG), **kwargs)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
    corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()
    losses = []
    for step in range(steps):
        loss = model(*corpus.batch(step, rank, 4))
        loss.backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0 and stage < 3:  # a write through a param between steps reaches what steps
            with torch.no_grad():
                model.lm_head.weight.mul_(0.5)
    model.wait_for_params()  # (frees the stage-3 units a step prefetches for the next forward)
    report = flatshard.memory_report(model, opt)
    if path is not None:
        flatshard.save_checkpoint(path, model, opt)
    return {"losses": losses, "params": model.full_state_dict(), "memory": report}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offloading_changes_where_bytes_live_and_not_one_bit_of_training(bf16):
    """At every stage on 2 ranks, with clipping and a write through a param between steps,
    an offloaded run equals the same run on the device bit for bit (the same fused kernel);
    the optimizer's bytes are on the host: main params (an fp32 copy for fp32 params), state
    and the grads' host frame, and at stage 3 the param shards with them: between steps the
    device keeps the params and the grad buffer of stages 0-1, the params of stage 2, and
    nothing at stage 3."""
    for device, host in run_distributed(_both, 2, bf16):
        for stage in STAGES:
            a, b = device[stage], host[stage]
            assert a["losses"] == b["losses"], stage
            assert all(torch.equal(a["params"][k], v) for k, v in b["params"].items()), stage
            on, off = a["memory"], b["memory"]
            assert on.host == 0 and off.host > 0, (stage, on, off)
            assert off.optimizer_state == on.optimizer_state > 0  # (the same state, its home moved)
            assert off.host == off.main_params + off.optimizer_state + off.grads - on.grads
            assert off.device == off.params + on.grads, (stage, off)  # (stages 0-1 keep a grad buffer)
            assert off.device == 0 or stage < 3, off


def _both(bf16: bool) -> tuple[dict, dict]:
    return tuple({s: _train(s, offload, bf16) for s in STAGES} for offload in (False, True))


def _lora_or_low_state(stage: int, offload: bool, what: str) -> tuple[list[float], dict]:
    """A Llama with a LoRA adapter (its base frozen), or the GPT in bf16 with bf16 main params
    and state (``OptimizerPrecision``), trained 3 steps."""
    torch.manual_seed(0)
    kwargs: dict = {"stage": stage, **({"offload": Offload()} if offload else {})}
    if what == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = flatshard.shard(get_peft_model(tiny_model("llama", seq_len=16), lora), **kwargs)
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
    else:
        model = flatshard.shard(GPT(CFG), mixed_precision=flatshard.MixedPrecision(torch.bfloat16), **kwargs)
        low = flatshard.OptimizerPrecision(main_dtype=torch.bfloat16, state_dtype=torch.bfloat16)
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, precision=low)
    x = torch.randint(1, 60, (2, 16), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    losses = []
    for _ in range(3):
        loss = model(input_ids=x, labels=x).loss if what == "lora" else model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict()


@pytest.mark.parametrize("what", ["lora", "bf16 state"])
def test_offloading_a_lora_model_or_low_precision_state_changes_no_bit(what):
    """On 2 ranks: a LoRA model at stage 3 (its frozen base's shards on the host too) and bf16 main
    params and state ([Note: precision-aware optimizer]) at stages 1 and 3 train offloaded
    exactly as on the device."""
    for rank_result in run_distributed(_lora_or_low_both, 2, what):
        for stage, ((device, d_params), (host, h_params)) in rank_result.items():
            assert device == host, (stage, device, host)
            assert all(torch.equal(d_params[k], v) for k, v in h_params.items()), stage


def _lora_or_low_both(what: str) -> dict:
    stages = (3,) if what == "lora" else (1, 3)  # (LoRA: stage 3, the QLoRA-FSDP use)
    return {s: tuple(_lora_or_low_state(s, off, what) for off in (False, True)) for s in stages}


def _save_and_resume(path: str, world_size_saved: int) -> dict:
    """Saved offloaded at stage 3 on 2 ranks after 2 steps: loaded here (on a device at stage
    1, or offloaded at stage 2), it starts from the saved params and trains on."""
    out = {}
    if torch.distributed.get_world_size() == world_size_saved:
        out["saved"] = _train(3, offload=True, bf16=True, steps=2, path=path)["params"]
        return out
    for stage, offload in [(1, False), (2, True)]:
        torch.manual_seed(1)
        kwargs = {"stage": stage, "offload": Offload()} if offload else {"stage": stage}
        model = flatshard.shard(
            GPT(CFG), mixed_precision=flatshard.MixedPrecision(param_dtype=torch.bfloat16), **kwargs
        )
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
        flatshard.load_checkpoint(path, model, opt)
        start = model.full_state_dict()
        corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
        model(*corpus.batch(2, torch.distributed.get_rank(), 4)).backward()
        opt.step()
        out[stage] = {"start": start, "moved": model.full_state_dict()}
    return out


def test_an_offloaded_checkpoint_loads_on_the_device_and_offloaded_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    (saved, *_) = run_distributed(_save_and_resume, 2, path, 2)
    assert os.path.isdir(path)
    (loaded, *_) = run_distributed(_save_and_resume, 3, path, 2)
    for stage in (1, 2):
        start, moved = loaded[stage]["start"], loaded[stage]["moved"]
        assert all(torch.equal(start[k], v) for k, v in saved["saved"].items()), stage
        assert any(not torch.equal(start[k], v) for k, v in moved.items()), stage


def test_memory_report_counts_what_a_hybrid_optimizer_keeps_on_the_host():
    """Half the elements offloaded: their fp32 copies, grad buffers and AdamW state are the
    host bytes; the device keeps the params, their grads and the other half's state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = flatshard.HybridDeviceOptimizer(
        model.parameters(), offload_fraction=0.5, cpu_optimizer_class=torch.optim.AdamW, lr=1e-3
    )
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    report = flatshard.memory_report(model, opt)
    first = 4 * (64 * 64 + 64)  # bytes of the first layer's params, the offloaded half
    assert report.host == first * (1 + 1 + 2) + 2 * 4  # master, grad, two moments, two step counts
    assert report.device == report.total - report.host == first * (1 + 1 + 1 + 1 + 2) + 2 * 4


def _state_dicts_across(stage: int) -> dict:
    """Two steps, then the model's and the optimizer's per-rank state dicts loaded into a new
    pair (offloaded or not, as the saving pair or the other way): the third step equals the
    saving pair's own, to the bit."""
    corpus, rank, out = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank(), {}

    def pair(offload: bool):
        torch.manual_seed(0)
        model = flatshard.shard(GPT(CFG), stage=stage, **({"offload": Offload()} if offload else {}))
        return model, flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)

    def step(model, opt, n: int) -> None:
        model(*corpus.batch(n, rank, 4)).backward()
        opt.step()
        opt.zero_grad()

    for saved, loaded in [(True, True), (False, True), (True, False)]:
        model, opt = pair(saved)
        step(model, opt, 0)
        step(model, opt, 1)
        states = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        step(model, opt, 2)
        other, other_opt = pair(loaded)
        other.load_state_dict(states[0])
        other_opt.load_state_dict(states[1])
        step(other, other_opt, 2)
        want, got = model.state_dict(), other.state_dict()
        out[(saved, loaded)] = all(torch.equal(want[k], got[k]) for k in want)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_state_dict_loads_offloaded_or_not(stage):
    for result in run_distributed(_state_dicts_across, 2, stage):
        assert all(result.values()), result


def test_the_host_step_takes_torchs_fused_kernel_or_foreach_and_keeps_a_users_choice():
    adamw = torch.optim.AdamW
    assert host_defaults(adamw, [adamw], {"lr": 1.0}) == {"lr": 1.0, "fused": True}
    assert host_defaults(adamw, [adamw], {"fused": False}) == {"fused": False}
    assert host_defaults(adamw, [adamw], {"foreach": False}) == {"foreach": False}
    assert host_defaults(torch.optim.RMSprop, [torch.optim.RMSprop], {}) == {"foreach": True}
    assert host_defaults(adamw, [adamw, torch.optim.RMSprop], {}) == {"foreach": True}
    with pytest.raises(ValueError, match="HybridDeviceOptimizer inside a DistributedOptimizer"):
        host_defaults(flatshard.HybridDeviceOptimizer, [flatshard.HybridDeviceOptimizer], {})


@pytest.mark.parametrize("bad", [True, "host"])
def test_offload_takes_an_offload_object(bad):
    with pytest.raises(TypeError, match=f"offload must be a flatshard.Offload or None, got {bad!r}"):
        flatshard.shard(torch.nn.Linear(2, 2), offload=bad)


@pytest.mark.parametrize("bad", [1.5, -0.1, "all", None])
def test_offload_names_a_share_that_is_not_one(bad):
    with pytest.raises(
        ValueError, match=rf"Offload.optimizer must be True, False or a share in \[0, 1\], got {bad!r}"
    ):
        Offload(optimizer=bad)
    with pytest.raises(TypeError, match=f"Offload.pin_memory must be True or False, got {bad!r}"):
        Offload(pin_memory=bad)
