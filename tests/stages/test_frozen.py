"""Frozen params at stage 3 ([Note: frozen params] in units/build.py): a LoRA fine-tune
shards its frozen base, follows DDP, and every rank holds (frozen elements x bytes) / N of it,
as memory_report measures and plan predicts."""

import pytest
import torch
from torch import nn

import flatshard
from _parity import SGD, LoRAGPT, check_parity, train_optimizer_side_by_side
from flatshard.planner.plan import plan_from_specs
from flatshard.toolkit.testing import run_distributed
from flatshard.units.placeholder import Placeholder
from flatshard.wrap.specs import model_specs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_lora_fine_tune_at_stage_3_follows_ddp(world_size):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": 3, "buckets": flatshard.Buckets(size=3000)},
        **SGD,
        model_cls=LoRAGPT,
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("stage", [0, 2])
def test_frozen_params_stay_whole_below_stage_3_and_train_alike(stage):
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        2,
        {"stage": stage, "buckets": flatshard.Buckets(size=3000)},
        **SGD,
        model_cls=LoRAGPT,
    )
    check_parity(result, params=1e-5)


def _memory(ignore_blocks: bool) -> dict:
    torch.manual_seed(0)
    model = LoRAGPT()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    ignored = [model.blocks[0]] if ignore_blocks else None
    whole = {id(p) for p in model.blocks[0].parameters() if not p.requires_grad} if ignore_blocks else set()
    whole_names = {n for n, p in model.named_parameters() if id(p) in whole}
    specs = model_specs(model), model_specs(model, stage=3)
    frozen_specs = [  # (plan the ones that are sharded; the whole ones are added below)
        [s for s in model_specs(model, stage=stage, frozen=True) if s.name not in whole_names]
        for stage in (0, 3)
    ]
    model = flatshard.shard(
        model, stage=3, buckets=flatshard.Buckets(size=3000), stage3=flatshard.Stage3(ignored_modules=ignored)
    )
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    model.wait_for_params()  # (no unit full)
    report = flatshard.memory_report(model, opt)
    plans = plan_from_specs(
        specs[0],
        world_size=torch.distributed.get_world_size(),
        bucket_size=3000,
        optimizer="sgd",
        rank=torch.distributed.get_rank(),
        stage3_specs=specs[1],
        frozen_specs=frozen_specs[0],
        stage3_frozen_specs=frozen_specs[1],
    )
    frozen_set = model.flatshard_state.frozen
    return {
        "frozen_bytes": sum(p.numel() * p.element_size() for p in frozen),
        "whole_frozen_bytes": sum(p.numel() * p.element_size() for p in frozen if id(p) in whole),
        "frozen_shard_bytes": sum(b.param_shard_data.numel() * 4 for b in frozen_set.buffers),
        "placeholders": sum(1 for p in frozen if isinstance(p, Placeholder)),  # (holding no values)
        "params": report.params,
        "planned": plans[3].params,
        "planned_stage0": plans[0].params,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_holds_its_share_of_the_frozen_params(world_size):
    for r in run_distributed(_memory, world_size, False):
        share = r["frozen_bytes"] / world_size
        assert share <= r["frozen_shard_bytes"] <= share * 1.02 + 4 * 64 * 8  # (padding: a few per bucket)
        # what memory_report counts is what plan predicts, up to the placeholders' bytes
        assert 0 <= r["params"] - r["planned"] <= 64, r
        assert r["planned_stage0"] - r["planned"] > r["frozen_bytes"] / 2
        assert r["placeholders"] > 0


def test_ignored_modules_keep_their_frozen_params_whole():
    r = run_distributed(_memory, 2, True)[0]
    assert r["whole_frozen_bytes"] > 0
    sharded = r["frozen_bytes"] - r["whole_frozen_bytes"]
    assert sharded / 2 <= r["frozen_shard_bytes"] <= sharded / 2 * 1.02 + 4 * 64 * 8
    assert 0 <= r["params"] - (r["planned"] + r["whole_frozen_bytes"]) <= 64, r


def test_ignored_modules_is_checked():
    model = LoRAGPT()
    with pytest.raises(ValueError, match="not a submodule"):
        flatshard.shard(model, stage=3, stage3=flatshard.Stage3(ignored_modules=[nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match=r"ignored_modules=.* applies to stage 3 only"):
        flatshard.shard(LoRAGPT(), stage=2, stage3=flatshard.Stage3(ignored_modules=[model.blocks[0]]))


def _save_sharded(path: str) -> None:
    torch.manual_seed(0)
    model = flatshard.shard(LoRAGPT(), stage=3, buckets=flatshard.Buckets(size=3000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    flatshard.save_checkpoint(path, model, opt)


def test_a_checkpoint_with_sharded_frozen_params_loads_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_sharded, 2, path)
    torch.manual_seed(0)
    expected = LoRAGPT().state_dict()
    model = flatshard.shard(LoRAGPT(), stage=0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    flatshard.load_checkpoint(path, model)
    got = model.state_dict()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) > 10
    for name in frozen:
        assert torch.equal(got[name], expected[name]), name


def _seq_cls_lora(stage: int, path: str) -> dict:
    """peft's sequence-classification LoRA: its head is a trainable copy (``modules_to_save``)
    beside the frozen original, both in the root unit, after the frozen final norm; then its
    adapter saved with ``flatshard.save_pretrained`` (rank 0: the largest difference from the
    reference's own adapter state dict)."""
    import copy

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForSequenceClassification

    from _parity import drift_from, max_rel_diff
    from flatshard.toolkit.models.hf import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=96, seq_len=32, num_labels=3, pad_token_id=0)
    lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(AutoModelForSequenceClassification.from_config(config), lora)
    reference = DDP(copy.deepcopy(model))
    ours = flatshard.shard(model, stage=stage)
    opt = flatshard.DistributedOptimizer(ours, torch.optim.SGD, lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank())
    norms, drift = [], []
    for _ in range(3):
        x, y = torch.randint(1, 96, (2, 8), generator=g), torch.randint(0, 3, (2,), generator=g)
        ours(input_ids=x, labels=y).loss.backward()
        reference(input_ids=x, labels=y).loss.backward()
        got = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        norms.append((float(got), float(want)))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        drift.append(drift_from(ours, reference.module))
    flatshard.save_pretrained(ours, path)
    if dist.get_rank() != 0:
        return {"norms": norms, "drift": drift}
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(f"{path}/adapter_model.safetensors")
    want = get_peft_model_state_dict(reference.module)
    assert set(saved) == set(want) and any("score" in k for k in want), (sorted(saved), sorted(want))
    return {"norms": norms, "drift": drift, "saved": max(max_rel_diff(saved[k], want[k]) for k in want)}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_peft_modules_to_save_follow_ddp(stage, tmp_path):
    """At stage 3 every grad norm was NaN and every step skipped: the root unit was freed
    once its head's grad arrived, before the backward of its frozen final norm (SGD:
    1e-5 relative, [Note: parity tolerances] in _parity.py). Saving the adapter at stage 3
    raised ShardedParamError: peft reads the head copy's own state_dict() for its keys."""
    pytest.importorskip("peft")  # (in the dev extras: CI has it)
    results = run_distributed(_seq_cls_lora, 2, stage, str(tmp_path / "adapter"), timeout=120)
    for result in results:
        for got, want in result["norms"]:
            assert got == pytest.approx(want, rel=1e-5), result["norms"]
        assert max(result["drift"]) < 1e-5, result["drift"]
    assert results[0]["saved"] < 1e-5, results[0]["saved"]


def _reference_model(world_size: int) -> dict:
    """A model with no trainable param at stage 3 (a DPO reference, a distillation teacher):
    its frozen params are sharded, its logits and greedy tokens are the unsharded model's."""
    import torch.distributed as dist

    from _finetune import prompt, tiny_llama

    plain = tiny_llama(seed=2).eval()
    reference = flatshard.shard(tiny_llama(seed=2).requires_grad_(False), stage=3).eval()
    x = prompt(dist.get_rank())
    with torch.no_grad():
        equal = torch.equal(plain(input_ids=x).logits, reference(input_ids=x).logits)
    tokens = [m.generate(input_ids=x, max_new_tokens=4, do_sample=False) for m in (plain, reference)]
    try:
        flatshard.DistributedOptimizer(reference, torch.optim.AdamW, lr=1e-3)
        refused = ""
    except ValueError as e:
        refused = str(e)
    frozen = sum(p.numel() * p.element_size() for p in plain.parameters())
    return {
        "equal": equal and torch.equal(*tokens),
        "held": flatshard.memory_report(reference).params,
        "frozen_bytes": frozen,
        "refused": refused,
        "keys": len(reference.full_state_dict()),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_model_with_no_trainable_param_is_sharded_at_stage_3(world_size):
    """It was refused ("nothing to shard"). Each rank holds about its 1/N of the frozen
    bytes (plus each bucket's padding: at most 128 elements a bucket, 4 bytes each)."""
    pytest.importorskip("transformers")  # (in the dev extras: CI has it)
    results = run_distributed(_reference_model, world_size, world_size, timeout=120)
    for rank, r in enumerate(results):
        assert r["equal"], r
        assert r["frozen_bytes"] / world_size <= r["held"] <= r["frozen_bytes"] / world_size + 64 * 512, r
        assert "no parameter that requires grad" in r["refused"], r
        assert (r["keys"] > 0) == (rank == 0)
