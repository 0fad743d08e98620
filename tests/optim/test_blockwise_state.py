"""torchao's low-bit Adams (state quantized in blocks) over each rank's shards ([Note: blockwise
state] in optim/blockwise.py), beside torch DDP with the same torchao optimizer: each rank's
part of a param is a tensor of its own, cut only at block bounds (``Buckets(align=256)``), its
state quantized exactly where one process quantizes it."""

import pytest
import torch
import torchao.optim
from torch import nn
from torchao.optim.subclass_8bit import OptimState8bit

import flatshard
from _checkpoints import saved_entries
from _parity import CFG, TiedGPT, train_optimizer_side_by_side
from flatshard.toolkit.testing import run_distributed

ALIGNED = {"buckets": flatshard.Buckets(size=3000, align=256)}


class SquareMLP(nn.Module):
    """Tokens through a tied 64 x 64 embedding and two 64 x 64 layers: every param has one
    shape, quantized (4096 elements), and at 2 ranks every piece another (2048), so that
    inductor builds torchao's step for two shapes a process rather than one for each of the
    GPT's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(CFG.vocab_size, 64)
        self.layers = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.layers(self.wte(idx)) @ self.wte.weight.T
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _side_by_side(name: str, stages: list[int], backend: str = "eager", model_cls=TiedGPT) -> dict[int, dict]:
    """Stages in turn in these ranks. torchao compiles its step (``torch.compile`` with the
    default backend) once per shape a process: the tests make that default dynamo's "eager"
    backend (the same graph, run op by op, on both sides) except where the compiled step is
    the subject, as inductor's C++ builds took 3.5 minutes for this file."""
    cls = getattr(torchao.optim, name)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    torch.compiler.set_default_backend(backend)
    try:
        return {
            s: train_optimizer_side_by_side(
                {**ALIGNED, "stage": s}, optimizer_class=cls, opt_kwargs=kwargs, steps=3, model_cls=model_cls
            )
            for s in stages
        }
    finally:
        torch.compiler.set_default_backend(None)  # (the ranks are kept for other tests)


@pytest.mark.parametrize("world_size", [1, 2])
def test_adamw8bit_over_shards_is_ddps_to_the_bit(world_size):
    """At 1-2 ranks flatshard's grads are DDP's bit for bit (a sum of two is exact in either
    order), so any difference would be the sharded step's: there is none, at any stage."""
    (result, *_) = run_distributed(_side_by_side, world_size, "AdamW8bit", [0, 1, 2, 3], timeout=300)
    for stage, r in result.items():
        assert max(r["param_diffs"]) == 0.0 and max(r["loss_diffs"]) == 0.0, (stage, r)


@pytest.mark.parametrize("name", ["AdamW4bit", "AdamWFp8"])
def test_the_4_bit_and_fp8_states_over_shards_are_ddps_to_the_bit(name):
    """AdamW4bit's blocks are 128 elements, AdamWFp8's 256: both lie whole in shards cut at 256."""
    (result, *_) = run_distributed(_side_by_side, 2, name, [3], timeout=300)
    assert max(result[3]["param_diffs"]) == 0.0 and max(result[3]["loss_diffs"]) == 0.0, result


def test_the_step_torchao_compiles_with_inductor_is_ddps_to_the_bit():
    """torchao's own default: its step compiled by inductor, per piece shape here and per
    param shape in DDP's process (the kernels are elementwise but for each block's max)."""
    (result, *_) = run_distributed(_side_by_side, 2, "AdamW8bit", [1], "inductor", SquareMLP, timeout=300)
    assert max(result[1]["param_diffs"]) == 0.0 and max(result[1]["loss_diffs"]) == 0.0, result


def test_adamw8bit_at_3_ranks_follows_ddp():
    """At 3 ranks the reduced grads round differently from DDP's (a sum of three in another
    order), which AdamW's normalised update magnifies where grads are near zero: the bound of
    AdamW at 3-4 ranks everywhere, 1e-2 ([Note: parity tolerances] in _parity.py). A grad an
    ulp away can also put a quantized moment on the next code of its block's map (adjacent
    codes are at most 0.0141 of the block's scale apart in torchao's signed 8-bit map), a step
    of that size in one element's moment. Seen: 4e-5 at stage 0, 1e-7 at stages 1 and 3."""
    (result, *_) = run_distributed(_side_by_side, 3, "AdamW8bit", [1, 3], timeout=300)
    for stage, r in result.items():
        assert max(r["param_diffs"]) < 1e-2, (stage, r["param_diffs"])
        assert max(r["loss_diffs"]) < 1e-5, (stage, r["loss_diffs"])


def _states(align):
    """The state of each piece run: its param's name, element count, and whether quantized."""
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=2, buckets=flatshard.Buckets(size=3000, align=align))
    try:
        opt = flatshard.DistributedOptimizer(model, torchao.optim.AdamW8bit, lr=1e-2)
    except ValueError as e:
        return str(e)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model(x, x).backward()
    torch.compiler.set_default_backend("eager")  # (see _side_by_side)
    try:
        opt.step()
    finally:
        torch.compiler.set_default_backend(None)
    return [
        (tuple(t.shape), isinstance(opt.inner.state[t]["exp_avg"], OptimState8bit))
        for g in opt.inner.param_groups
        for t in g["params"]
    ]


def test_a_part_of_a_quantized_param_is_quantized_and_a_cut_inside_a_block_is_refused():
    """At 2 ranks each rank holds 2048 of the 4096 elements of an MLP matrix: torchao alone
    would keep a tensor of 2048 plain, one process quantizes the matrix, and so does its
    part here; a small param keeps plain state. Without the alignment the layout cuts a
    matrix inside a block, and the optimizer is refused, naming the param and the fix."""
    aligned, cut = run_distributed(_states, 2, 256), run_distributed(_states, 2, None)
    for runs in aligned:
        assert any(shape[0] < 4096 and q for shape, q in runs), runs  # a quantized part
        assert any(not q for shape, q in runs), runs  # a small param's plain state
        assert all(not q or shape[0] % 256 == 0 for shape, q in runs)
    assert "inside a block" in cut[0] and "Buckets(align=256)" in cut[0], cut[0]


def _checkpoint_case(stage: int, src: str | None, dst: str, steps: int) -> dict:
    """AdamW8bit on the tied GPT at ``stage``: loaded from ``src`` (else trained 2 steps and
    saved to ``dst`` first), then ``steps`` more steps; the params and the moments' kinds."""
    torch.compiler.set_default_backend("eager")  # (see _side_by_side)
    try:
        torch.manual_seed(0)
        model = flatshard.shard(TiedGPT(), stage=stage, **ALIGNED)
        opt = flatshard.DistributedOptimizer(model, torchao.optim.AdamW8bit, lr=1e-2)
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        batches = [torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g) for _ in range(2 + steps)]
        if src is None:
            for x in batches[:2]:
                model(x, x).backward(), opt.step(), opt.zero_grad()
        else:
            flatshard.load_checkpoint(src, model, opt)
        flatshard.save_checkpoint(dst, model, opt)
        for x in batches[2:]:
            model(x, x).backward(), opt.step(), opt.zero_grad()
        with model.summon_full_params():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        kinds = {type(s["exp_avg"]).__name__ for s in opt.inner.state.values()}
        return {"params": params, "kinds": kinds}
    finally:
        torch.compiler.set_default_backend(None)


def test_a_checkpoint_keeps_the_codes_and_scales_and_resumes_exactly_at_any_layout(tmp_path):
    """The quantized moments are saved as their codes and one scale a block, by param (a
    dequantized moment does not quantize back to its codes: a block whose largest element is
    negative comes back at 0.993 of its scale), so that 2 ranks at stage 2 -> 2 ranks at stage
    3 resumes to the bit (two steps after the load), and 2 -> 1 -> 3 ranks gives back the same
    codes and scales, quantized again on every layout."""
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    through = run_distributed(_checkpoint_case, 2, 2, None, a, 2, timeout=300)
    resumed = run_distributed(_checkpoint_case, 2, 3, a, b, 2, timeout=300)
    for r in (through[0], resumed[0]):
        assert r["kinds"] == {"OptimState8bit", "Tensor"}, r["kinds"]
    for name, value in through[0]["params"].items():
        assert torch.equal(value, resumed[0]["params"][name]), name
    run_distributed(_checkpoint_case, 1, 3, a, c, 0, timeout=300)
    run_distributed(_checkpoint_case, 3, 1, c, d, 0, timeout=300)
    saved, again = saved_entries(a, ("state",)), saved_entries(d, ("state",))
    assert any(k.endswith(".weight") and ".codes/" in k for k in saved), sorted(saved)
    assert saved.keys() == again.keys()
    for key, value in saved.items():  # (bit for bit, whatever the dtype: uint8 codes, fp32 scales)
        assert torch.equal(value.reshape(-1).view(torch.uint8), again[key].reshape(-1).view(torch.uint8)), key


def _load_into(src: str, name: str) -> str:
    """The error of loading ``src`` into torch's class ``name`` over the same model, if any."""
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=2, **ALIGNED)
    opt = flatshard.DistributedOptimizer(model, getattr(torch.optim, name), lr=1e-2)
    try:
        flatshard.load_checkpoint(src, model, opt)
    except ValueError as e:
        return str(e)
    return ""


def test_quantized_moments_do_not_load_into_an_optimizer_that_keeps_none(tmp_path):
    """A low-bit checkpoint loaded by AdamW (fp32 moments) is refused, naming the state and
    what loads it, rather than read as something else."""
    run_distributed(_checkpoint_case, 2, 2, None, str(tmp_path / "a"), 0, timeout=300)
    (said, _) = run_distributed(_load_into, 2, str(tmp_path / "a"), "AdamW", timeout=300)
    assert "quantized" in said and "'exp_avg'" in said and "AdamW" in said, said


def _half_offloaded() -> str:
    torch.manual_seed(0)
    model = flatshard.shard(TiedGPT(), stage=2, offload=flatshard.Offload(optimizer=0.5), **ALIGNED)
    try:
        flatshard.DistributedOptimizer(model, torchao.optim.AdamW8bit, lr=1e-2, elementwise=True)
    except ValueError as e:
        return str(e)
    return ""


def test_a_share_of_a_low_bit_optimizer_on_the_host_is_refused_even_declared_elementwise():
    """Part of the optimizer on the host is a HybridDeviceOptimizer, which steps flat runs:
    they would glue params into one quantized tensor, so a low-bit class is refused there,
    whatever ``elementwise`` says, naming what works (all of it on the host, or none)."""
    (said,) = run_distributed(_half_offloaded, 1)
    assert "blocks" in said and "Offload()" in said, said
