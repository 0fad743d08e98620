"""``MixedPrecision(param_dtype=...)``: params stored and computed in 16 bits, fp32 main
params seeded with the original fp32 values, floating inputs cast."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _parity import CFG, TiedGPT
from flatshard import DistributedOptimizer, MixedPrecision
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
BF16 = MixedPrecision(param_dtype=torch.bfloat16)


def _policy_case(stage: int, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model))
    fp32_values = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ours = flatshard.shard(model, stage=stage, mixed_precision=BF16, buckets=flatshard.Buckets(size=3000))
    dtypes = {p.dtype for p in ours.parameters()}
    kwargs = {"lr": 3e-3, "weight_decay": 0.1}
    opt = DistributedOptimizer(ours, torch.optim.AdamW, **kwargs)
    # main params hold the fp32 originals exactly, not their bf16 rounding
    seeded = _main_matches(ours, opt, fp32_values)
    opt_ref = torch.optim.AdamW(reference.parameters(), **kwargs)
    loss_diffs = []
    for step in range(steps):
        x, y = CORPUS.batch(step, rank, 8)
        loss, loss_ref = ours(x, y), reference(x, y)
        for value, optimizer in ((loss, opt), (loss_ref, opt_ref)):
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
        loss_diffs.append(abs(loss.item() - loss_ref.item()) / loss_ref.item())
    return {"dtypes": dtypes, "seeded": seeded, "loss_diffs": loss_diffs}


def _main_matches(model, opt, fp32_values) -> bool:
    """Every element of this rank's main params equals the fp32 value it was cast from."""
    state = model.flatshard_state
    for shards in opt.shards:
        for piece, main in shards.main_pieces():
            if not torch.equal(main, fp32_values[piece.name].reshape(-1)[slice(*piece.in_param)]):
                return False
    return state.originals is None  # dropped once used


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_param_dtype_policy_seeds_main_params_with_fp32_values_and_tracks_fp32(stage):
    for r in run_distributed(_policy_case, 2, stage, 12):
        assert r["dtypes"] == {torch.bfloat16}, "trainable and frozen params are cast"
        assert r["seeded"]
        assert max(r["loss_diffs"]) < 2e-3, r["loss_diffs"]


class FloatInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, *, scale):
        return (self.lin(x) * scale).float().sum()


def test_floating_inputs_are_cast_and_frozen_params_too():
    torch.manual_seed(0)
    model = FloatInput()
    model.lin.bias.requires_grad_(False)
    ours = flatshard.shard(model, mixed_precision=BF16)
    assert ours.lin.weight.dtype == ours.lin.bias.dtype == torch.bfloat16
    out = ours(torch.randn(2, 4), scale=torch.tensor(2.0))  # fp32 input and kwarg
    out.backward()
    assert ours.lin.weight.main_grad.dtype == torch.float32
    with pytest.raises(RuntimeError):  # without the cast the fp32 input meets bf16 weights
        flatshard.shard(
            FloatInput(), mixed_precision=MixedPrecision(torch.bfloat16, cast_forward_inputs=False)
        )(torch.randn(2, 4), scale=1.0)
    with pytest.raises(ValueError, match=r"floating torch\.dtype"):
        MixedPrecision(param_dtype=torch.int8)


def _sync_case(stage: int) -> dict:
    torch.manual_seed(dist.get_rank())  # different originals on every rank
    model = TiedGPT()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours = flatshard.shard(model, stage=stage, sync_module_states=True, mixed_precision=BF16)
    opt = DistributedOptimizer(ours, torch.optim.SGD, lr=0.1)
    pieces = [
        (piece.name, tuple(piece.in_param), main) for s in opt.shards for piece, main in s.main_pieces()
    ]
    return {"values": values, "pieces": pieces}


@pytest.mark.parametrize("stage", [1, 3])
def test_sync_module_states_takes_the_fp32_originals_from_rank_0_too(stage):
    results = run_distributed(_sync_case, 2, stage)
    truth = results[0]["values"]
    assert not torch.equal(truth["wte.weight"], results[1]["values"]["wte.weight"])
    for r in results:
        assert r["pieces"]
        for name, (lo, hi), main in r["pieces"]:
            assert torch.equal(main, truth[name].reshape(-1)[lo:hi]), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_dtype_follows_fp32_ddp_within_bf16_rounding(stage):
    """Grads reduced in bf16 (over 4 ranks: divided by 2 before the sum and by 2 after it),
    accumulated and stepped in fp32: SGD stays within bf16 rounding of fp32 DDP."""
    from _parity import train_optimizer_side_by_side

    (result, *_) = run_distributed(
        train_optimizer_side_by_side,
        4,
        {
            "stage": stage,
            "mixed_precision": MixedPrecision(reduce_dtype=torch.bfloat16),
            "buckets": flatshard.Buckets(size=3000),
        },
        optimizer_class=torch.optim.SGD,
        opt_kwargs={"lr": 0.1, "momentum": 0.9},
        clip=0.5,
    )
    assert max(result["loss_diffs"]) < 1e-3, result["loss_diffs"]
    assert 1e-6 < max(result["param_diffs"]) < 1e-2, result["param_diffs"]
    assert max(result["norm_diffs"]) < 1e-2, result["norm_diffs"]


def _reduce_bytes_case(stage: int, reduce_dtype) -> int:
    torch.manual_seed(0)
    ours = flatshard.shard(
        TiedGPT(),
        stage=stage,
        mixed_precision=MixedPrecision(reduce_dtype=reduce_dtype),
        buckets=flatshard.Buckets(size=3000),
    )
    DistributedOptimizer(ours, torch.optim.SGD, lr=0.1)
    x, y = CORPUS.batch(0, dist.get_rank(), 4)
    ours(x, y).backward()
    stats = ours.comm_stats.as_dict()
    return sum(v["payload_bytes"] for op, v in stats.items() if op in ("all_reduce", "reduce_scatter"))


@pytest.mark.parametrize("stage", [0, 3])
def test_reduce_dtype_halves_the_bytes_reduced(stage):
    full = run_distributed(_reduce_bytes_case, 2, stage, None)[0]
    half = run_distributed(_reduce_bytes_case, 2, stage, torch.bfloat16)[0]
    assert half * 2 == full


def test_split_scale_divides_by_a_power_of_two_near_sqrt_n_after_the_sum():
    from flatshard.planner.mixed_precision import split_scale

    assert [split_scale(1 / n, torch.bfloat16) for n in (1, 2, 4, 8, 16, 64)] == [1, 1, 2, 2, 4, 8]
    assert (
        split_scale(1 / 64, torch.float32)
        == split_scale(1 / 64, None)
        == split_scale(1.0, torch.float16)
        == 1
    )
    with pytest.raises(ValueError, match="reduce_dtype"):
        MixedPrecision(reduce_dtype=torch.int32)
