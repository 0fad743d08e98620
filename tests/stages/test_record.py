"""The values of record ([Note: values of record] in wrap/record.py): with bf16 mixed
precision ``full_state_dict()`` and ``export_checkpoint`` give the optimizer's fp32 main params,
not their bf16 rounding, at every stage; ``dtype=`` casts on request."""

import pytest
import torch

import flatshard
from _parity import CFG
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT
from flatshard.toolkit.testing import run_distributed

BF16 = flatshard.MixedPrecision(param_dtype=torch.bfloat16)


def _train(stage: int, steps: int = 3):
    torch.manual_seed(0)
    model = flatshard.shard(GPT(CFG), stage=stage, mixed_precision=BF16, buckets=flatshard.Buckets(size=1500))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    for step in range(steps):
        x, y = corpus.batch(step, torch.distributed.get_rank(), 4)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _record(stage: int, directory: str) -> dict:
    model, opt = _train(stage)
    record = model.full_state_dict()
    half = model.full_state_dict(dtype=torch.bfloat16)
    with model.summon_full_params(writeback=False):
        computed = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    flatshard.save_checkpoint(directory, model, opt)
    bad = None
    try:
        model.full_state_dict(dtype=torch.int64)
    except TypeError as e:
        bad = str(e)
    return {"record": record, "half": half, "computed": computed, "bad": bad}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 3])
def test_full_state_dict_gives_the_fp32_main_params(stage, world_size, tmp_path):
    results = run_distributed(_record, world_size, stage, str(tmp_path / "ckpt"))
    r = results[0]
    assert all(other["record"] == {} for other in results[1:])
    record, computed = r["record"], r["computed"]
    assert set(computed) <= set(record)
    for name, value in computed.items():
        assert value.dtype == torch.bfloat16
        assert record[name].dtype == torch.float32, name
        # the model computes with the record rounded: the same values, exactly
        assert torch.equal(record[name].to(torch.bfloat16), value), name
        assert torch.equal(r["half"][name], value), name
    # ... and the record is not that rounding: AdamW's fp32 updates leave bits bf16 drops
    assert any(not torch.equal(record[n], computed[n].float()) for n in computed)
    assert "torch.int64" in r["bad"]
    # an export of the checkpoint (weights="main", the default) gives the same values
    out = tmp_path / "model.safetensors"
    flatshard.export_checkpoint(tmp_path / "ckpt", out)
    from safetensors.torch import load_file

    exported = load_file(str(out))
    for name in computed:
        assert torch.equal(exported[name], record[name]), name
