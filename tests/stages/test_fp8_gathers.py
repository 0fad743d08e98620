"""Stage 3 gathers torchao's float8 weights as fp8 bytes, one scale a weight ([Note: fp8
gathers] in ``engine/fp8_gathers.py``): the matmuls read the fp8 operands FSDP2's fp8
all-gather gives them, the weights cross the wire in one byte an element, and what reads
values (summon, state dicts) still gets them exactly."""

from functools import partial

import pytest
import torch
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole

import flatshard
from _parity import (
    SGD,
    CheckpointedGPT,
    TiedGPT,
    check_parity,
    train_against_fsdp2,
    train_optimizer_side_by_side,
)
from _subclasses import float8_gpt
from flatshard.toolkit.testing import run_distributed

WEIGHT = GemmInputRole.WEIGHT


def _against_fsdp2() -> dict:
    return train_against_fsdp2(
        {"stage": 3},
        model_cls=float8_gpt,
        after_step=precompute_float8_dynamic_scale_for_fsdp,
        optimizer_class=torch.optim.SGD,
        hyper={"lr": 0.1, "momentum": 0.9},
        clip=None,
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_gathers_follow_fsdp2_with_fp8_all_gather(world_size):
    """FSDP2 (every block, then the root) with torchao's fp8 all-gather and its scales
    precomputed after each step, against flatshard's stage 3 in fp32. Both casts read the
    fp32 shards with the same scale, so the fp8 bytes are the same; flatshard's decoded
    weight is recast by ``Float8Linear`` to a scale within 2 fp32 ulps of FSDP2's, which moves
    each output by at most 2^-22 of itself, below what the grads' summation order already does:
    SGD + momentum to 1e-5 ([Note: parity tolerances]; 0 seen at 2 ranks, 1.9e-7 at 4 after 4
    steps). FSDP2's fp8 all-gather does not run on gloo at 3 ranks (uneven shards); the DDP
    comparison in ``test_tensor_subclasses.py`` covers 3."""
    (result, *_) = run_distributed(_against_fsdp2, world_size)
    check_parity(result, params=1e-5)


def _weight_operand(module: Float8Linear, weight: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, float]:
    """The fp8 bytes and the scale ``module``'s forward casts ``weight`` to."""
    dtype = module.config.cast_config_weight.target_dtype
    cast = hp_tensor_to_float8_dynamic(
        weight, dtype, module.linear_mm_config, gemm_input_role=WEIGHT, round_scales_to_power_of_2=pow2
    )
    return cast._data.view(torch.uint8).clone(), float(cast._scale)


def _operands_and_bytes(pow2: bool) -> dict:
    """Three steps at stage 3 in bf16, then every ``Float8Linear``'s weight operand as its
    forward casts it, beside torchao's cast of the fp32 weight (what FSDP2 gathers); and the
    bytes one forward gathers, beside what the layout says they must be."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    model = flatshard.shard(float8_gpt(pow2), stage=3, mixed_precision=mp)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(3):
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
    exact = model.full_state_dict()  # (rank 0: the fp32 values; gathered exactly)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    seen = {}

    def capture(module, args, name):
        seen[name] = _weight_operand(module, module.weight, pow2)

    hooks = [m.register_forward_pre_hook(partial(capture, name=n)) for n, m in linears.items()]
    model.comm_stats.reset()
    with torch.no_grad():  # (every unit gathered once, and freed)
        model(idx, idx)
    for hook in hooks:
        hook.remove()
    buffers = [b for bset in model.flatshard_state.param_sets() for b in bset.layout.buffers]  # (frozen too)
    out = {
        "gathered": model.comm_stats.as_dict()["all_gather"]["payload_bytes"],
        "expected": sum(
            bucket.numel * (1 if buffer.gather_dtype is not None else buffer.dtype.itemsize)
            for buffer in buffers
            for bucket in buffer.buckets
        ),
        "fp8_numel": sum(b.numel for b in buffers if b.gather_dtype is not None),
        "linears": len(linears),
        "operands": {},
    }
    for name, (data, scale) in seen.items() if rank == 0 else ():
        ref_data, ref_scale = _weight_operand(linears[name], exact[name + ".weight"].float(), pow2)
        out["operands"][name] = (torch.equal(data, ref_data), abs(scale - ref_scale) / ref_scale)
    return out


@pytest.mark.parametrize("pow2", [False, True])
def test_the_matmuls_read_the_fp8_bytes_of_the_fp32_weights_and_one_byte_crosses_the_wire(pow2):
    """3 ranks (uneven shards of every weight), bf16 params with fp32 main params. Each
    ``Float8Linear`` casts its gathered weight to exactly the fp8 bytes torchao casts the fp32
    weight to (what FSDP2's fp8 all-gather sends), with a scale within one bf16 rounding
    (2^-8) of torchao's: the decoded weight's amax is rounded to bf16 once. With power-of-2
    scales the decoded weight is exact and so is the scale. A forward gathers each fp8
    weight's bucket in one byte an element and every other bucket in bf16, to the byte."""
    (result, *others) = run_distributed(_operands_and_bytes, 3, pow2)
    for r in (result, *others):
        assert r["gathered"] == r["expected"], (r["gathered"], r["expected"])
        assert r["fp8_numel"] > 0
    assert len(result["operands"]) == result["linears"] > 0
    for name, (same_bytes, scale_diff) in result["operands"].items():
        assert same_bytes, name
        assert scale_diff <= (0.0 if pow2 else 2.0**-8), (name, scale_diff)


def _recomputed_against_ddp() -> dict:
    return train_optimizer_side_by_side(
        {"stage": 3, "stage3": flatshard.Stage3(unit_bytes=None, backward_prefetch="post")},
        model_cls=partial(float8_gpt, model_cls=CheckpointedGPT),
        **SGD,
    )


def test_fp8_gathers_under_activation_checkpointing_and_accumulation_follow_ddp():
    """A unit a block (the first is freed after its forward: neither the last nor prefetched
    before it), so the first block's forward, recomputed in backward, regathers it (fp8 bytes,
    decoded with the scales of the forward: the same values), over two micro-batches a step (the
    second forward refreshes the scales from unchanged values), against torch DDP on the
    same converted model: as in fp32, SGD + momentum to 1e-5 at 2 ranks ([Note: parity
    tolerances])."""
    (result, *_) = run_distributed(_recomputed_against_ddp, 2)
    check_parity(result, params=1e-5)


def _float8_run(stage: int, path: str, save: bool) -> dict:
    """Two steps then a save, or a load: the full state dict (the fp32 main params) after."""
    torch.manual_seed(0)
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    model = flatshard.shard(float8_gpt(), stage=stage, mixed_precision=mp)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    if save:
        for step in range(2):
            idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
            model(idx, idx).backward()
            opt.step()
            opt.zero_grad()
        flatshard.save_checkpoint(path, model, opt)
    else:
        flatshard.load_checkpoint(path, model, opt)
    return model.full_state_dict()


def test_a_checkpoint_of_fp8_gathered_weights_loads_exactly_at_another_world_size_and_stage(tmp_path):
    """Saved at stage 3 on 2 ranks (the fp8 weights in buffers of their own), loaded on 3 ranks
    at stage 2 (no fp8 buffers) and at stage 3: every param's fp32 value to the bit. Checkpoints
    read the shards of record, never an fp8 gather."""
    path = str(tmp_path / "ckpt")
    (saved, _) = run_distributed(_float8_run, 2, 3, path, True)
    for stage in (2, 3):
        (loaded, *_) = run_distributed(_float8_run, 3, stage, path, False)
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (stage, name)


def _tied_back() -> dict:
    """The head converted to float8 (its weight marked), then tied back to the embedding, as a
    later ``tie_weights()`` would: the embedding reads that weight itself."""
    model = TiedGPT()
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)  # (every linear, the head too: torchao unties it)
    model.wte.weight = model.lm_head.weight
    sharded = flatshard.shard(model, stage=3)
    fp8 = [s.name for b in sharded.layouts["main"].buffers if b.gather_dtype is not None for s in b.params]
    return {"fp8": fp8}


def test_a_marked_weight_another_module_reads_is_not_gathered_in_fp8():
    """Gathered in fp8, the embedding would look its rows up in their fp8 rounding without a
    word; so a marked weight is gathered in fp8 only where every module holding it is a float8
    linear, and the blocks' weights still are."""
    (result,) = run_distributed(_tied_back, 1)
    assert result["fp8"] and all(name.startswith("blocks.") for name in result["fp8"]), result


def _composed_against_ddp(how: str) -> dict:
    more = {"offload": flatshard.Offload()} if how == "offload" else {}
    mesh = {"mesh_shape": (2, 2)} if how == "replicated" else {}
    return train_optimizer_side_by_side({"stage": 3, **more}, model_cls=float8_gpt, **mesh, **SGD)


@pytest.mark.parametrize(("how", "world_size"), [("offload", 2), ("replicated", 4)])
def test_fp8_gathers_compose_with_offload_and_replicated_sharding(how, world_size):
    """Offloaded shards (cast on the host, one byte an element over the link) at 2 ranks,
    and a 2 x 2 replicate x shard mesh (the amaxes all-reduced over the shard group: the
    replicas hold the same values) at 4, against DDP on the same float8 model. SGD + momentum:
    params to 1e-5 at 2 ranks, 1e-2 at 4, where a last-ulp difference of the grads' sums can
    move a weight across an e4m3 rounding boundary (as in ``test_tensor_subclasses.py``);
    losses to 1e-5."""
    (result, *_) = run_distributed(_composed_against_ddp, world_size, how)
    check_parity(result, params=1e-5 if world_size == 2 else 1e-2)


def _compiled(how: str | None) -> list[float]:
    """Three AdamW steps at stage 3 in bf16 with fp8 gathers; ``how``: each block compiled
    before sharding, or the sharded model compiled (dynamo's aot_eager backend)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    gpt = float8_gpt()
    if how == "block":
        for block in gpt.blocks:
            block.compile(backend="aot_eager")
    bf16 = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    model = flatshard.shard(gpt, stage=3, mixed_precision=bf16)
    run = torch.compile(model, backend="aot_eager") if how == "model" else model
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(3):
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = run(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.comm_stats.as_dict()["fp8_scales"]["calls"] >= 3  # (gathered in fp8 each forward)
    return losses


def _compiled_and_not() -> dict:
    return {how: _compiled(how) for how in (None, "block", "model")}


def test_fp8_gathers_under_compiled_blocks_and_a_compiled_model_change_no_bit():
    """The unit gathers, scale refreshes and decodes run in hooks outside dynamo's graphs, and
    ``Float8Linear``'s cast inside them: compiled per block or whole, the losses are the
    uncompiled run's to the bit, at 2 ranks."""
    for r in run_distributed(_compiled_and_not, 2, timeout=300):
        assert r["block"] == r[None] and r["model"] == r[None], r
