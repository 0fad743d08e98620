"""Hugging Face ``transformers`` models built from configs (random init) at every stage:
Llama, GPT-2 (tied embeddings) and Mixtral (mixture of experts) follow DDP; the default
units are their decoder layers; exported weights load with ``from_pretrained``; weights
written by ``save_pretrained`` (one file or sharded with an index) seed a sharded model."""

import json
from functools import partial

import pytest
import torch
from torch import nn

import flatshard
from _parity import CFG, SGD, check_parity, train_optimizer_side_by_side
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import lm_loss, tiny_model
from flatshard.toolkit.testing import run_distributed
from flatshard.units.unit_tree import find_units

transformers = pytest.importorskip("transformers")  # (in the dev extras: CI has it)

DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}
KINDS = {
    "llama": {"num_key_value_heads": 1},
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},  # (dropout would differ by RNG)
    "mixtral": {"num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2},
}


def _tiny(kind: str) -> nn.Module:
    return tiny_model(kind, vocab_size=CFG.vocab_size, seq_len=CFG.seq_len, **DIMS, **KINDS[kind])


class HFLM(nn.Module):
    """A ``transformers`` causal LM with the parity harness's ``forward(x, y) -> loss``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lm = _tiny(kind)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.lm, x, y)


def _parity(kind: str, world_size: int, stage: int) -> None:
    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        world_size,
        {"stage": stage, "buckets": flatshard.Buckets(size=4000)},
        **SGD,
        model_cls=partial(HFLM, kind),
    )
    check_parity(result, params=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_models_follow_ddp_at_every_stage(kind, stage):
    _parity(kind, 2, stage)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_llama_at_stage_3_follows_ddp_at_other_world_sizes(world_size):
    _parity("llama", world_size, 3)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_other_hf_models_at_stage_3_and_other_world_sizes(kind, world_size):
    _parity(kind, world_size, 3)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_default_units_are_the_decoder_layers(kind):
    model = _tiny(kind)
    layers = {type(m).__name__ for m in model.modules() if type(m).__name__ in model._no_split_modules}
    units = find_units(model)
    assert units[0].modules == (model,) and len(units) == 1 + DIMS["num_hidden_layers"]
    assert {type(m).__name__ for u in units[1:] for m in u.modules} == layers


def test_no_split_modules_win_over_module_lists():
    model = nn.ModuleDict({"lm": _tiny("llama"), "heads": nn.ModuleList([nn.Linear(2, 2)])})
    names = [u.name for u in find_units(model)]
    assert names == ["", "lm.model.layers.0", "lm.model.layers.1"]  # (not heads.0)


def test_save_pretrained_records_the_users_class(tmp_path):
    model = flatshard.shard(_tiny("llama"), stage=0)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert isinstance(model, flatshard.ShardedModule)


def _train_export(kind: str, directory: str) -> list:
    torch.manual_seed(0)
    model = flatshard.shard(_tiny(kind), stage=3, buckets=flatshard.Buckets(size=4000))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    for step in range(2):
        x, y = corpus.batch(step, torch.distributed.get_rank(), 4)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    flatshard.save_checkpoint(f"{directory}/ckpt", model, opt)
    if torch.distributed.get_rank() == 0:
        model.config.save_pretrained(f"{directory}/hf")  # (config.json, the directory too)
        flatshard.export_checkpoint(f"{directory}/ckpt", f"{directory}/hf/model.safetensors")
    with torch.no_grad():
        return model(input_ids=corpus.batch(9, 0, 2)[0]).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_exported_weights_load_with_from_pretrained(kind, tmp_path):
    logits = run_distributed(_train_export, 2, kind, str(tmp_path))[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        again = loaded(input_ids=SyntheticCorpus(CFG.vocab_size, CFG.seq_len).batch(9, 0, 2)[0]).logits
    assert torch.allclose(again, logits, atol=1e-6, rtol=0), (again - logits).abs().max()


def _seed_from(source: str) -> dict:
    torch.manual_seed(1)  # (other values than the saved ones)
    model = flatshard.shard(_tiny("llama"), stage=3, buckets=flatshard.Buckets(size=4000))
    flatshard.load_weights(model, source)
    return model.full_state_dict()


@pytest.mark.parametrize("sharded", [False, True])
def test_save_pretrained_weights_seed_a_sharded_model(sharded, tmp_path):
    torch.manual_seed(0)
    saved = _tiny("llama")
    saved.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    source = str(tmp_path / "model.safetensors.index.json") if sharded else str(tmp_path)
    got = run_distributed(_seed_from, 2, source)[0]
    for name, value in saved.state_dict().items():
        assert torch.equal(got[name], value), name
