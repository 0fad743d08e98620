"""Params of a tensor subclass that keeps its values in inner tensors ([Note: tensor-subclass
params] in ``wrap/subclass_params.py``): torchao's float8 weights train as a one-process
torchao run does at every stage, a frozen NF4 base stays whole, anything else is refused.

Before, a ``Float8Linear`` weight (torchao's ``WeightWithDynamicFloat8CastTensor``) was
never stepped at stages 0-2 (the optimizer stepped a flat buffer its ``.data`` did not
reach) and failed at stage 3 with an error about a rebound ``.data``."""

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

import flatshard
from _parity import SGD, TiedGPT, check_parity, train_optimizer_side_by_side
from _subclasses import LoraNF4, qlora
from flatshard import Buckets
from flatshard.toolkit.testing import run_distributed

STAGES = [0, 1, 2, 3]
FP8 = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)


def float8_gpt() -> nn.Module:
    """The parity GPT with its blocks' linears converted to float8 training, their weights
    wrapped for fp8 all-gathers as torchao does for FSDP2 (the tied head stays plain: torchao
    would untie it)."""
    model = TiedGPT()
    convert_to_float8_training(model, config=FP8, module_filter_fn=lambda m, name: name.startswith("blocks."))
    return model


def _float8_against_ddp(stages: list[int], compiled: str | None = None) -> dict:
    kwargs = {"buckets": Buckets(size=3000)}
    return {
        s: train_optimizer_side_by_side(
            {**kwargs, "stage": s}, model_cls=float8_gpt, compiled=compiled, backend="aot_eager", **SGD
        )
        for s in stages
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_float8_model_follows_ddp_on_the_same_float8_model(world_size):
    """torch DDP trains the same converted model (its params keep torchao's wrappers). The
    fp8 casts see the same values on both sides (each rank's own micro-batch, the whole
    weight's amax), so only the grads' summation order differs: at 1-2 ranks SGD + momentum
    to 1e-5 ([Note: parity tolerances]). At 3-4 ranks a last-ulp difference can move a
    weight across an e4m3 rounding boundary, and its fp8 operand is then one e4m3 step
    (2^-3 of the element) off, which the next steps carry on: as AdamW there, params to
    1e-2 (2.1e-3 seen at 3 ranks after 4 steps); losses to 1e-5 throughout. Without the fix
    the float8 weights never moved (0.05 off after 5 steps) or stage 3 raised."""
    (results, *_) = run_distributed(_float8_against_ddp, world_size, STAGES)
    for stage, result in results.items():
        assert len(result["param_diffs"]) == 4, stage
        check_parity(result, params=1e-5 if world_size <= 2 else 1e-2)


def _made_plain() -> list:
    model = flatshard.shard(float8_gpt(), stage=1)
    weight = model.blocks[0].attn.qkv.weight
    before = weight.detach().clone()
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()
    opt.step()
    kind = type(model.blocks[0].attn.qkv).__name__
    return [type(weight).__name__, kind, float((weight.detach() - before).abs().max())]


def test_a_float8_model_is_made_plain_and_moves():
    """The wrapped weights become plain params that the optimizer moves; the float8 linear
    is kept, so it still computes in fp8."""
    ((cls, kind, moved),) = run_distributed(_made_plain, 1)
    assert (cls, kind) == ("Parameter", "Float8Linear")
    assert moved > 1e-4


def test_a_compiled_float8_model_follows_ddp():
    """Each block compiled against DDP's compiled too, stage 3 on 2 ranks; SGD to 1e-5 as
    above. ``aot_eager``: the float8 subclass is traced and desugared by AOTAutograd, which it
    runs in full ([Note: compile backends in the suite] in conftest.py)."""
    (results, *_) = run_distributed(_float8_against_ddp, 2, [3], "block")
    for result in results.values():
        check_parity(result, params=1e-5)


def _qlora_against_one_process(stage: int) -> dict:
    """Every rank builds its base from its own seed: ``sync_module_states`` must give all of
    them rank 0's. The reference is one process on the whole batch."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = flatshard.shard(qlora(rank), stage=stage)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    reference = qlora(0)
    opt_ref = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8 * world, 64, generator=gen), torch.randn(8 * world, 1, generator=gen)
        mine = slice(8 * rank, 8 * rank + 8)
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        ((reference(x) - y) ** 2).mean().backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    full = model.full_state_dict()
    if rank:
        return {}
    out: dict = {"classes": {k: type(v).__name__ for k, v in full.items()}, "nf4": {}, "trained": {}}
    for k, v in reference.state_dict().items():
        if isinstance(v, NF4Tensor):  # (compared by the tensors that hold it)
            pairs = [(getattr(full[k], n), getattr(v, n)) for n in v.__tensor_flatten__()[0]]
            out["nf4"][k] = all(torch.equal(a, b) for a, b in pairs)
        else:
            out["trained"][k] = float((full[k] - v).abs().max() / v.abs().max())
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_a_frozen_nf4_base_stays_whole_and_the_adapters_follow_one_process(stage):
    """A QLoRA-shaped model on 3 ranks: the frozen NF4 weights stay whole (replicated) at
    stage 3 too, start from rank 0's, and ``full_state_dict`` gives them as NF4 copies. The
    adapters follow one process on the whole batch: summation order only, SGD to 1e-5
    ([Note: parity tolerances])."""
    (result, *_) = run_distributed(_qlora_against_one_process, 3, stage)
    assert result["classes"]["0.weight"] == result["classes"]["2.weight"] == "NF4Tensor"
    assert result["nf4"] == {"0.weight": True, "2.weight": True}
    assert len(result["trained"]) == 6
    for name, diff in result["trained"].items():
        assert diff < 1e-5, (name, diff)


def _refused() -> list:
    model = nn.Sequential(
        convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=FP8), LoraNF4(64)
    )
    model[1].weight.requires_grad_(True)
    wrapped = type(model[0][0].weight).__name__
    try:
        flatshard.shard(model, stage=2)
    except TypeError as e:
        return [str(e), wrapped, type(model[0][0].weight).__name__]
    return ["no error", wrapped, ""]


def test_a_trainable_param_of_another_wrapper_class_is_refused_naming_it():
    """A trainable NF4 weight: a TypeError naming the param and its class, raised before any
    param is replaced (the float8 weight beside it keeps its wrapper)."""
    ((message, before, after),) = run_distributed(_refused, 1)
    assert "'1.weight'" in message and "NF4Tensor" in message and "requires_grad=False" in message
    assert before == after == "WeightWithDynamicFloat8CastTensor"
