"""Stages 1-2 with ``MixedPrecision(fp8_gathers=True)``: torchao's float8 weights gathered
after each step as fp8 bytes and decoded on every rank ([Note: fp8 gathers after the step] in
``engine/fp8_gathers.py``).

The gather encodes each rank's bf16 shard with the scale of the whole bf16 weight, so every
``Float8Linear`` recasts the decoded weight to the same fp8 bytes and scale it casts the bf16
weight to when the weights are gathered in bf16: the runs are equal to the bit, which is the
check (the bf16 runs follow DDP in ``test_tensor_subclasses.py`` and the hosts' tests)."""

import re
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flatshard
from _subclasses import float8_gpt
from flatshard.errors import ShardedParamError
from flatshard.toolkit.testing import run_distributed

BF16 = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
FP8 = flatshard.MixedPrecision(param_dtype=torch.bfloat16, fp8_gathers=True)


def _model(stage: int, fp8: bool | None, **more) -> tuple:
    torch.manual_seed(0)
    mp = FP8 if fp8 else BF16
    model = flatshard.shard(float8_gpt(), stage=stage, mixed_precision=mp, **more)
    return model, flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _steps(model, opt, steps: range) -> list[float]:
    rank = torch.distributed.get_rank()
    losses = []
    for step in steps:
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(idx, idx)
        loss.backward()  # (no clipping: the fp8 weights' own buffers sum the norm in another order)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(stage: int, fp8: bool | None, compiled: bool = False, **more) -> dict:
    """4 AdamW steps; the losses, the exact params (fp32 main), the bytes gathered,
    the amax all-reduces, and whether the fp8 params hold their fp8 values decoded (each its
    own recast, and not its main params rounded)."""
    model, opt = _model(stage, fp8, **more)
    if compiled:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    model.comm_stats.reset()
    losses = _steps(model, opt, range(4))
    model.wait_for_params()
    stats = model.comm_stats.as_dict()
    state = model.flatshard_state
    decoded = sorted(state.fp8_values())
    exact = model.full_state_dict()
    held = dict(model.named_parameters())
    as_fp8 = all(torch.equal(held[n], _recast(held[n])) for n in decoded)
    rounded = {n: v.to(torch.bfloat16) for n, v in exact.items()} if exact else {}
    moved = any(not torch.equal(held[n], rounded[n]) for n in decoded) if exact else None
    buffers = [b for bset in state.sets.values() for b in bset.layout.buffers]
    return {
        "losses": losses,
        "exact": exact,
        "gathered": stats.get("all_gather", {}).get("payload_bytes", 0),
        "expected": 4 * sum(b.numel * (1 if b.gather_dtype else b.dtype.itemsize) for b in buffers),
        "scales": stats.get("fp8_scales", {}).get("calls", 0),
        "decoded": decoded,
        "as_fp8": as_fp8,
        "moved": moved,
    }


def _recast(weight: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise cast of ``weight`` decoded: its amax's scale, e4m3, back to bf16."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = (fp8_max / weight.float().abs().max().double().clamp(min=1e-12)).float()
    q = (weight.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return (q.float() / scale).to(weight.dtype)


def _with_and_without(stages: list[int], compiled: bool = False) -> dict:
    return {(s, fp8): _train(s, fp8, compiled) for s in stages for fp8 in (None, True)}


@pytest.mark.parametrize(
    ("world_size", "stages", "compiled"),
    [(1, [1], False), (2, [1, 2], False), (3, [1, 2], False), (4, [2], False), (2, [1], True)],
    ids=["1", "2", "3", "4", "2, blocks compiled"],
)
def test_fp8_gathers_after_the_step_train_to_the_bit_as_bf16_gathers(world_size, stages, compiled):
    """At stages 1 and 2 on 1-4 ranks (3: uneven shards of every weight), and with each block
    compiled (the waits and decodes run in the blocks' pre-hooks, outside their graphs): the
    same losses and fp32 params to the bit as bf16 gathers, while every fp8 weight's bucket
    crosses the wire in one byte an element (the bytes counted equal the layout's) after one
    all-reduce of the amaxes a step, and between steps those params hold their fp8 values
    decoded, not their main params rounded. One rank gathers and casts nothing."""
    for rank, r in enumerate(run_distributed(_with_and_without, world_size, stages, compiled, timeout=300)):
        for stage in stages:
            plain, fp8 = r[(stage, None)], r[(stage, True)]
            assert fp8["losses"] == plain["losses"], stage
            if rank == 0:
                assert fp8["exact"].keys() == plain["exact"].keys()
                assert all(torch.equal(v, fp8["exact"][k]) for k, v in plain["exact"].items()), stage
            assert plain["decoded"] == [] and plain["scales"] == 0
            if world_size == 1:
                assert fp8["decoded"] == [] and fp8["gathered"] == fp8["scales"] == 0
                continue
            assert fp8["decoded"] and all(n.startswith("blocks.") for n in fp8["decoded"])
            assert fp8["gathered"] == fp8["expected"] < plain["gathered"] == plain["expected"], stage
            assert fp8["scales"] == 4 and fp8["as_fp8"], stage
            assert fp8["moved"] is (True if rank == 0 else None), stage  # (rank 0 holds the exact values)


def _mesh() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {fp8: _train(2, fp8, group=mesh) for fp8 in (None, True)}


def test_fp8_gathers_after_the_step_over_a_replicate_by_shard_mesh():
    """A 2 x 2 mesh: the gathers and the amaxes' all-reduce run over each shard group of 2,
    the replicas holding the same values; the same run to the bit as bf16 gathers."""
    for rank, r in enumerate(run_distributed(_mesh, 4, timeout=300)):
        assert r[True]["losses"] == r[None]["losses"]
        assert r[True]["scales"] == 4 and r[True]["as_fp8"]
        if rank == 0:
            assert all(torch.equal(v, r[True]["exact"][k]) for k, v in r[None]["exact"].items())


def _resumed(path: str, stage: int, fp8: bool | None, save: bool) -> dict:
    """Two steps and a save (then two more), or a load and the same two more steps."""
    model, opt = _model(stage, fp8)
    before = None
    if save:
        _steps(model, opt, range(2))
        model.wait_for_params()
        before = {n: p.clone() for n, p in model.named_parameters()}
        flatshard.save_checkpoint(path, model, opt)
        after = dict(model.named_parameters())
        before = all(torch.equal(before[n], after[n]) for n in before)  # (the fp8 values put back)
    else:
        flatshard.load_checkpoint(path, model, opt)
    saved = model.full_state_dict()
    losses = _steps(model, opt, range(2, 4))
    return {"saved": saved, "losses": losses, "kept": before, "end": model.full_state_dict()}


def test_a_checkpoint_saves_the_exact_values_and_resumes_exactly(tmp_path):
    """Saved at stage 1 with fp8 gathers on 2 ranks: the params hold the same fp8 values after
    the save as before; loaded at stage 1 with fp8 gathers on 2 ranks, the next two steps equal
    the saving run's to the bit (the loaded params recast as a gather gives them); loaded at
    stage 2 on 3 ranks without, and at stage 3 with its own fp8 gathers, every fp32 value is
    the saved one, and at stage 2 the next steps equal a bf16 run that never gathered in fp8
    (the checkpoint holds exact values, not fp8 ones)."""
    path = str(tmp_path / "ckpt")
    (saved, _) = run_distributed(_resumed, 2, path, 1, True, True)
    assert saved["kept"] is True
    (resumed, _) = run_distributed(_resumed, 2, path, 1, True, False)
    assert resumed["losses"] == saved["losses"]
    assert all(torch.equal(v, resumed["end"][k]) for k, v in saved["end"].items())
    plain_path = str(tmp_path / "plain")
    run_distributed(_resumed, 2, plain_path, 1, None, True)
    for stage, fp8 in ((2, None), (3, None)):
        (loaded, *_) = run_distributed(_resumed, 3, path, stage, fp8, False)
        assert all(torch.equal(v, loaded["saved"][k]) for k, v in saved["saved"].items()), stage
        if stage == 2:
            (plain, *_) = run_distributed(_resumed, 3, plain_path, stage, fp8, False)
            assert loaded["losses"] == plain["losses"]


def _writes() -> dict:
    """A step, then: ``state_dict()`` twice, a write in place through an fp8 param, and a
    ``load_state_dict`` of the exact values."""
    model, opt = _model(1, True)
    _steps(model, opt, range(1))
    name = sorted(model.flatshard_state.fp8_values())[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.state_dict()
        model.state_dict()
    said = [str(w.message) for w in seen if "fp8" in str(w.message)]
    exact = {k: v.to(torch.bfloat16) for k, v in _gathered_exact(model).items()}
    with torch.no_grad():
        model.get_parameter(name).mul_(0.5)
    try:
        _steps(model, opt, range(1, 2))
        refused = ""
    except ShardedParamError as e:
        refused = str(e)
    model.load_state_dict(exact)
    loaded = model.get_parameter(name).detach().clone()
    return {"said": said, "refused": refused, "name": name, "loaded": loaded, "want": _recast(exact[name])}


def _gathered_exact(model) -> dict:
    """The fp32 main values on every rank (``full_state_dict`` gives them to rank 0)."""
    out = [model.full_state_dict()]
    torch.distributed.broadcast_object_list(out, src=0)
    return out[0]


def test_writes_through_fp8_params_are_refused_and_loads_are_recast():
    """``state_dict()`` warns once that those params hold fp8 values; ``p.mul_(0.5)`` on one
    is refused at the next forward naming it (it would reach the fp32 main params at fp8
    precision); a ``load_state_dict`` of the values is taken, each fp8 weight then holding
    torchao's cast of the loaded weight, decoded."""
    for r in run_distributed(_writes, 2):
        assert len(r["said"]) == 1, r["said"]
        assert r["name"] in r["refused"] and "fp8" in r["refused"], r["refused"]
        assert torch.equal(r["loaded"], r["want"])


def _refused(case: str) -> str:
    try:
        if case == "4-byte state":
            model = flatshard.shard(float8_gpt(), stage=2, mixed_precision=FP8)
            bf16 = flatshard.OptimizerPrecision(main_dtype=torch.bfloat16, state_dtype=torch.bfloat16)
            flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=bf16)
        else:
            model = float8_gpt() if case != "no float8 weight" else torch.nn.Linear(4, 4)
            stage = 0 if case == "stage 0" else 1
            asked = "yes" if case == "a str" else True
            dtype = None if case == "fp32 params" else torch.bfloat16
            mp = flatshard.MixedPrecision(param_dtype=dtype, fp8_gathers=asked)
            flatshard.shard(model, stage=stage, mixed_precision=mp)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("fp32 params", r"ValueError: .*torch.float32 params.*MixedPrecision\(param_dtype=torch.bfloat16\)"),
        ("stage 0", r"ValueError: .*stage 0, which gathers no params"),
        ("no float8 weight", r"ValueError: .*no weight is marked.*enable_fsdp_float8_all_gather=True"),
        ("a str", r"ValueError: MixedPrecision.fp8_gathers must be None, True or False, got 'yes'"),
        ("4-byte state", r"ValueError: param 'blocks\..*' is gathered in fp8 .*main_dtype=torch.float32"),
    ],
)
def test_what_cannot_keep_the_exact_values_is_refused(case, said):
    """On 2 ranks (a world of one rank gathers nothing, so it needs no exact copy), each
    before anything is built or stepped."""
    for got in run_distributed(_refused, 2, case):
        assert re.search(said, got), got


def _layouts(stage: int, fp8: bool | None) -> list[bool]:
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16, fp8_gathers=fp8)
    model = flatshard.shard(float8_gpt(), stage=stage, mixed_precision=mp)
    return [b.gather_dtype is not None for b in model.layouts["main"].buffers]


def _every_choice() -> dict:
    return {(stage, fp8): _layouts(stage, fp8) for stage in (1, 3) for fp8 in (None, True, False)}


def test_where_weights_are_gathered_in_fp8_is_the_choice_made():
    """None: at stage 3 only; True: at stages 1 and 3; False: at neither (a buffer of fp8
    gathers is a buffer of its own, so the layout says)."""
    (r, _) = run_distributed(_every_choice, 2)
    assert [any(r[k]) for k in ((1, None), (1, True), (1, False))] == [False, True, False]
    assert [any(r[k]) for k in ((3, None), (3, True), (3, False))] == [True, True, False]
