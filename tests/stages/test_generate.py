"""``generate()`` at stage 3 ([Note: forward entry points] in units/unshard.py): a peft
model's generation loop calls the wrapped ``transformers`` model, below the root, and ranks
whose prompts end at different lengths must still run the same forwards. Greedy tokens are
compared for equality with the same weights unsharded: a stage-3 forward computes on exact
copies of the params, unit by unit, so the logits are bitwise those of the plain model."""

import pytest
import torch

import flatshard
from _finetune import prompt, tiny_llama, tiny_lora
from _hosted import float8_linears
from flatshard.toolkit.testing import run_distributed

pytest.importorskip("peft")  # (in the dev extras: CI has it)

NEW = 8


def _early_stop(model) -> int:
    """A token rank 0 generates early and rank 1 never does: as the end-of-sequence token,
    it stops rank 0 while rank 1 goes on."""
    new = [model.generate(input_ids=prompt(r), max_new_tokens=NEW, do_sample=False)[0, -NEW:] for r in (0, 1)]
    return next(int(t) for t in new[0] if t not in new[1])


def _generate(peft: bool, fp8: bool = False) -> dict:
    rank = torch.distributed.get_rank()
    model = (tiny_lora if peft else tiny_llama)(seed=0).eval()
    if fp8:
        float8_linears(model)
    ids = prompt(rank)
    eos = _early_stop(model)
    expected = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    sharded = flatshard.shard(model, stage=3, buckets=flatshard.Buckets(size=500))
    got = sharded.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    return {"expected": expected.tolist(), "got": got.tolist()}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("peft", [True, False], ids=["peft", "plain"])
def test_greedy_tokens_at_stage_3_equal_the_unsharded_models(peft, world_size):
    results = run_distributed(_generate, world_size, peft)
    for rank, r in enumerate(results):
        assert r["got"] == r["expected"], (rank, r)
    lengths = {len(r["expected"][0]) - len(prompt(rank)[0]) for rank, r in enumerate(results)}
    if world_size > 1:
        assert len(lengths) > 1, lengths  # (some rank stopped early: the others kept it in step)


def test_greedy_tokens_of_a_float8_model_gathered_in_fp8_equal_the_unsharded_models():
    """The decoder's linears in torchao's float8, gathered as fp8 bytes at stage 3 ([Note: fp8
    gathers]): each matmul reads the fp8 bytes the unsharded model casts, its scale within two
    fp32 ulps of that model's, so the logits move by a few ulps and the greedy tokens are the
    same, ranks stopping at different lengths."""
    results = run_distributed(_generate, 2, False, True)
    for rank, r in enumerate(results):
        assert r["got"] == r["expected"], (rank, r)
