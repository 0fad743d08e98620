"""``flatshard plan``: the ZeRO formulas, and the real layout's numbers equal to what
``memory_report`` and ``CommStats`` measure at run time."""

import json

import pytest
import torch
import torch.distributed as dist

import flatshard
from _cli import cli, missing_from_help
from flatshard import DistributedOptimizer, memory_report
from flatshard.planner.offload import unit_ids
from flatshard.planner.plan import plan_from_count, plan_from_specs
from flatshard.planner.state_blocks import FORMATS
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig
from flatshard.toolkit.testing import run_distributed
from flatshard.wrap.specs import model_specs, stage3_units

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=True)


def test_reproduces_the_zero_paper_table():
    """ZeRO (Rajbhandari et al. 2020), Table 1: 7.5B params, 64 ranks, fp16 params and grads,
    Adam with 12 bytes of state per param: 120, 31.4, 16.6 and 1.88 GB per rank. At stage 3
    flatshard keeps no fp16 shard next to the fp32 main params (as FSDP2): 2Ψ/N less."""
    plans = plan_from_count(7.5e9, world_size=64, param_dtype="fp16", grad_dtype="fp16", optimizer="adam")
    got = [round(plans[s].bytes_per_rank / 1e9, 3) for s in range(4)]
    assert got == [120.0, 31.406, 16.641, round(1.875 - 2 * 7.5 / 64, 3)]


@pytest.mark.parametrize("world", [1, 3, 64])
def test_count_plan_is_the_design_formula(world):
    psi = 1_000_000
    plans = plan_from_count(psi, world_size=world, param_dtype="bf16", grad_dtype="fp32", optimizer="adamw")
    ring = (world - 1) / world
    expected = {
        0: (2 * psi + 4 * psi + 12 * psi, 2 * ring * 4 * psi),
        1: (2 * psi + 4 * psi + 12 * psi / world, ring * 6 * psi),
        2: (2 * psi + 16 * psi / world, ring * 6 * psi),
        3: (16 * psi / world, ring * 8 * psi),
    }
    for stage, (memory, comm) in expected.items():
        assert plans[stage].bytes_per_rank == pytest.approx(memory, abs=2)
        assert plans[stage].comm_bytes_per_step == pytest.approx(comm, abs=1)


def _measured(
    stage: int,
    precision: flatshard.OptimizerPrecision | None = None,
    offload: bool | tuple[str, ...] = False,
    low_bit: str | None = None,
    fp8: bool = False,
    step: str = "host",
) -> dict:
    """``low_bit``: a torchao class name, on the layout aligned to its blocks that the plan
    of its lower-case name assumes; ``fp8``: the blocks' linears converted to torchao's float8
    training with fp8 gathers ([Note: fp8 gathers]); ``offload``: True for ``Offload()``,
    unit names for ``Offload(units=...)`` at stage 3, each block a unit ([Note: unit homes]);
    ``step``: where the offloaded optimizer steps ([Note: streamed step])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    named = isinstance(offload, tuple)
    unit_bytes = None if named else flatshard.Stage3().unit_bytes
    chunk = 700  # (a streamed step moves several chunks: [Note: streamed step])
    homes = {"step": step, "stream_chunk": chunk}
    more: dict = {"offload": flatshard.Offload(**homes)} if offload is True else {}
    if named:
        more = {
            "offload": flatshard.Offload(units=offload, **homes),
            "stage3": flatshard.Stage3(unit_bytes=None),
        }
    buckets = flatshard.Buckets(size=3000, align=FORMATS[low_bit.lower()].align if low_bit else None)
    convert = _float8 if fp8 else (lambda module: module)
    if fp8 and stage in (1, 2):  # ([Note: fp8 gathers after the step])
        more["mixed_precision"] = flatshard.MixedPrecision(fp8_gathers=True)
    model = flatshard.shard(convert(GPT(CFG).to(torch.bfloat16)), stage=stage, buckets=buckets, **more)
    if low_bit:
        import torchao.optim

        torch.compiler.set_default_backend("eager")  # (torchao compiles its step: see test_blockwise_state)
        opt = DistributedOptimizer(model, getattr(torchao.optim, low_bit), lr=1e-3)
    else:
        opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, precision=precision)
    x, y = SyntheticCorpus(CFG.vocab_size, CFG.seq_len).batch(0, rank, 4)
    try:
        for _ in range(2):  # the second step is a steady one (stage 3 prefetches across steps)
            opt.zero_grad()  # (first: the step's grads are counted, as the plan counts them)
            model.comm_stats.reset()
            model(x, y).backward()
            opt.step()
    finally:
        torch.compiler.set_default_backend(None)
    stats = model.comm_stats.as_dict()
    model.wait_for_params()
    with torch.device("meta"):
        meta = convert(GPT(CFG).to(torch.bfloat16))
    specs = model_specs(meta, fp8_gathers=True if "mixed_precision" in more else None)
    stage3_specs = model_specs(meta, stage=3, unit_bytes=unit_bytes)
    homed: bool | frozenset[str] = offload is True
    if named:  # (the layout's ids of the named units)
        homed = unit_ids(offload, [u.names for u in stage3_units(meta, [], None, None)[0]])
    plan = plan_from_specs(
        specs,
        world_size=world,
        bucket_size=3000,
        optimizer=low_bit.lower() if low_bit else "adamw",
        rank=rank,
        stage3_specs=stage3_specs,
        precision=precision,
        offload=homed,
        streamed=step == "device",
        stream_chunk=chunk,
    )[stage]
    sent = sum(v["wire_bytes"] for op, v in stats.items() if op != "all_reduce" or stage == 0)
    link = sum(stats.get(op, {}).get("payload_bytes", 0) for op in ("host_to_device", "device_to_host"))
    measured = memory_report(model, opt).as_dict()
    staging = 0 if opt._streamed is None else opt._streamed.staging
    return {"measured": measured, "plan": plan.as_dict(), "sent": sent, "link": link, "staging": staging}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_layout_plan_equals_what_a_run_measures(stage):
    """Every rank's memory_report equals plan_from_specs for that rank, role by role, and
    the bytes sent in the step equal the planned comm bytes (the 8-byte norm aside)."""
    for r in run_distributed(_measured, 3, stage):
        plan, measured = r["plan"], r["measured"]
        for role in ("params", "grads", "main_params", "optimizer_state"):
            assert plan[role] == measured[role], (role, plan, measured)
        assert plan["comm_bytes_per_step"] == r["sent"]


def _float8(module: torch.nn.Module) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(module, config=config, module_filter_fn=lambda m, n: "blocks." in n)


@pytest.mark.parametrize(("stage", "offload"), [(3, False), (3, True), (1, False), (2, True)])
def test_the_plan_of_fp8_gathers_equals_what_a_run_measures(stage, offload):
    """The blocks' linears in torchao's float8 and fp8 gathers (at stages 1-2 asked for):
    their weights cross the wire in one byte an element, and at stage 3 (offloaded) the host
    link too; the plan from the meta model counts the same bytes as the run, role by role and
    sent (the all-reduce of the weights' amaxes, ``fp8_scales``, included)."""
    for r in run_distributed(_measured, 3, stage, offload=offload, fp8=True):
        plan, measured = r["plan"], r["measured"]
        for role in ("params", "grads", "main_params", "optimizer_state"):
            assert plan[role] == measured[role], (role, plan, measured)
        assert plan["comm_bytes_per_step"] == r["sent"]
        assert plan["link_bytes_per_step"] == r["link"]


@pytest.mark.parametrize(
    ("stage", "step"), [(0, "host"), (1, "host"), (2, "host"), (3, "host"), (1, "device"), (3, "device")]
)
def test_the_plan_of_an_offloaded_optimizer_equals_what_a_run_measures(stage, step):
    """With ``Offload()`` every rank's memory_report equals the plan role by role and in its
    host and device bytes, and the bytes copied over the host link in a steady step equal
    the plan's: grads down once, params up once a step (stages 0-2) or once a gather of
    this rank's part (stage 3, [Note: memory tiers]). At stages 2-3 the grad shards live on
    the host, so after the step the device holds the params of stage 2 and nothing at 3.
    Streamed to the device ([Note: streamed step]): no grads' frame at stage 1, and the link
    carries each run's main params and state both ways and its grads up (stage 3) besides."""
    for r in run_distributed(_measured, 3, stage, offload=True, step=step):
        plan, measured = r["plan"], r["measured"]
        for role in ("params", "grads", "main_params", "optimizer_state", "host", "device"):
            assert plan[role] == measured[role], (role, plan, measured)
        assert measured["grads"] > 0
        if stage >= 2:
            assert measured["device"] == (measured["params"] if stage == 2 else 0), measured
        assert plan["host"] > 0 and plan["link_bytes_per_step"] == r["link"] > 0, (plan, r["link"])
        assert plan["comm_bytes_per_step"] == r["sent"]
        assert plan["staging"] == r["staging"] and (r["staging"] > 0) == (step == "device")


@pytest.mark.parametrize(
    ("units", "step"), [(("blocks.1",), "host"), (("", "blocks.0"), "host"), (("blocks.1",), "device")]
)
def test_the_plan_of_offloaded_units_equals_what_a_run_measures(units, step):
    """``Offload(units=...)`` at stage 3 on 3 ranks: memory_report equals the plan of those
    units on the host ([Note: unit homes]) role by role and in host and device bytes; the
    host link carries the named units' grads down and their parts up at each gather, as the
    plan says; the other units' bytes stay on the device."""
    for r in run_distributed(_measured, 3, 3, offload=units, step=step):
        plan, measured = r["plan"], r["measured"]
        for role in ("params", "grads", "main_params", "optimizer_state", "host", "device"):
            assert plan[role] == measured[role], (role, plan, measured)
        assert 0 < plan["link_bytes_per_step"] == r["link"], (plan, r["link"])
        assert plan["staging"] == r["staging"] and (r["staging"] > 0) == (step == "device")
        assert 0 < measured["host"] < measured["main_params"] + measured["optimizer_state"], measured
        assert plan["comm_bytes_per_step"] == r["sent"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("main", [torch.float32, torch.bfloat16])
def test_the_plan_of_low_precision_state_equals_what_a_run_measures(stage, main):
    """bf16 AdamW moments, with fp32 or bf16 main params ([Note: precision-aware optimizer]):
    planned and measured role by role; at stage 3 bf16 main params leave the param shard in
    place, so the params are counted, not the main params."""
    precision = flatshard.OptimizerPrecision(main_dtype=main, state_dtype=torch.bfloat16)
    for r in run_distributed(_measured, 3, stage, precision):
        plan, measured = r["plan"], r["measured"]
        for role in ("params", "grads", "main_params", "optimizer_state"):
            assert plan[role] == measured[role], (role, plan, measured)
        assert (plan["main_params"] == 0) == (main == torch.bfloat16)


@pytest.mark.parametrize(
    ("low_bit", "stage"), [("AdamW8bit", 1), ("AdamW8bit", 3), ("AdamW4bit", 3), ("AdamWFp8", 1)]
)
def test_the_plan_of_torchaos_low_bit_state_equals_what_a_run_measures(stage, low_bit):
    """torchao's quantized moments ([Note: blockwise state]): each piece run's codes, block
    scales and code map where its whole param has 4096 elements or more (the MLP matrices
    here), fp32 moments for the rest, on a layout aligned to the blocks (256; 128 for the
    4-bit state); planned and measured role by role, at 3 ranks. Each class once, each stage
    (param shards at 3, whole params at 1) twice: the state is the same at stages 1-3."""
    for r in run_distributed(_measured, 3, stage, low_bit=low_bit):
        plan, measured = r["plan"], r["measured"]
        for role in ("params", "grads", "main_params", "optimizer_state"):
            assert plan[role] == measured[role], (role, plan, measured)
        assert plan["comm_bytes_per_step"] == r["sent"]


def test_plan_cli_json_and_table():
    out = cli(
        "plan",
        "--params",
        "7.5e9",
        "--world",
        "64",
        "--param-dtype",
        "fp16",
        "--grad-dtype",
        "fp16",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    stages = json.loads(out.stdout)["stages"]
    assert round(stages["1"]["bytes_per_rank"] / 1e9, 1) == 31.4
    assert set(stages["0"]) >= {"bytes_per_rank", "comm_bytes_per_step"}
    out = cli("plan", "--model", "tiny", "-n", "2", "--optimizer", "sgd-momentum")
    assert out.returncode == 0, out.stderr
    table, units = out.stdout.split("stage-3 units")
    assert "tiny (28,544 params), rank 0, 2 ranks" in table and len(table.splitlines()) == 6
    assert units.startswith(" (adjacent ones merged up to 1,048,576 bytes): 2 units of 3 modules"), units
    assert "blocks.0..blocks.1 (2)" in units
    low = cli("plan", "--params", "7e9", "-n", "8", "--main-dtype", "bf16", "--state-dtype", "bf16", "--json")
    stages = json.loads(low.stdout)[
        "stages"
    ]  # (the 7B on 8 ranks: 10.5 GB of state at stage 1, now 3.5)
    assert (stages["1"]["main_params"], stages["1"]["optimizer_state"]) == (0, 3.5e9), stages["1"]
    out = cli("plan", "--model", "tiny", "-n", "2", "--unit-bytes", "none")
    assert "stage-3 units (one per module): 3 units of 3 modules" in out.stdout, out.stdout
    fp8 = cli("plan", "--model", "tiny", "-n", "2", "--fp8-gathers", "--json")  # ([Note: fp8 gathers])
    assert fp8.returncode == 0, fp8.stderr
    plain = json.loads(cli("plan", "--model", "tiny", "-n", "2", "--json").stdout)["stages"]
    fewer = json.loads(fp8.stdout)["stages"]
    for stage in "123":  # (as MixedPrecision(fp8_gathers=True): stages 1-2 too)
        assert fewer[stage]["comm_bytes_per_step"] < plain[stage]["comm_bytes_per_step"], (fewer, plain)
    assert fewer["0"] == plain["0"]  # (stage 0 gathers nothing)
    drawn = {s: cli("layout", "--model", "tiny", "--stage", s, "--fp8-gathers").stdout for s in ("2", "3")}
    assert all("gathered in float8_e4m3fn" in d for d in drawn.values()), drawn
    out = cli("plan", "--model", "tiny", "-n", "2", "--offload")  # ([Note: memory tiers])
    assert "the optimizer offloaded" in out.stdout and "host link/step" in out.stdout, out.stdout
    streamed = json.loads(cli("plan", "--model", "tiny", "-n", "2", "--offload", "device", "--json").stdout)
    at_home = json.loads(cli("plan", "--model", "tiny", "-n", "2", "--offload", "--json").stdout)
    for stage in "123":  # ([Note: streamed step]: more over the link; no grads' frame at stage 1)
        s, h = streamed["stages"][stage], at_home["stages"][stage]
        assert s["link_bytes_per_step"] > h["link_bytes_per_step"] and s["host"] <= h["host"], stage
    table = cli("plan", "--model", "tiny", "-n", "2", "--offload", "device").stdout
    assert "stepped on the device" in table and "step staging" in table, table
    refused = cli("plan", "--params", "7e9", "--offload")
    assert refused.returncode == 2 and "--offload applies to --model only" in refused.stderr


def test_plan_with_tensor_parallelism_is_the_plan_of_one_tp_ranks_part():
    """``--tp 8 -n 8`` plans what each of 64 ranks holds: 1/8 of every param (its tp
    slice), sharded over the 8 data-parallel ranks like a model of that size."""
    ours = json.loads(cli("plan", "--params", "8e9", "-n", "8", "--tp", "8", "--json").stdout)["stages"]
    slice_ = json.loads(cli("plan", "--params", "1e9", "-n", "8", "--json").stdout)["stages"]
    assert ours == slice_
    uneven = json.loads(cli("plan", "--params", "7", "-n", "1", "--tp", "2", "--json").stdout)["stages"]
    assert uneven == json.loads(cli("plan", "--params", "4", "-n", "1", "--json").stdout)["stages"]
    table = cli("plan", "--params", "8e9", "-n", "8", "--tp", "8").stdout
    assert "8,000,000,000 params split over 8 tensor-parallel ranks, 8 ranks" in table, table
    assert "not yet offered" not in table  # (stage 3 composes with tensor parallelism now)
    refused = cli("plan", "--model", "tiny", "--tp", "2")
    assert refused.returncode == 2 and "--tp applies to --params only" in refused.stderr


def test_plan_with_pipeline_stages_is_the_plan_of_one_stage_of_a_tp_ranks_part():
    """``--tp 2 --pp 4 -n 8`` plans what each of 64 ranks holds: a quarter (its pipeline
    stage) of half of every param (its tp slice), sharded over the 8 data-parallel ranks."""
    ours = json.loads(cli("plan", "--params", "8e9", "-n", "8", "--tp", "2", "--pp", "4", "--json").stdout)
    assert ours["stages"] == json.loads(cli("plan", "--params", "1e9", "-n", "8", "--json").stdout)["stages"]
    uneven = json.loads(cli("plan", "--params", "7", "-n", "1", "--pp", "2", "--json").stdout)["stages"]
    assert uneven == json.loads(cli("plan", "--params", "4", "-n", "1", "--json").stdout)["stages"]
    table = cli("plan", "--params", "8e9", "-n", "8", "--tp", "2", "--pp", "4").stdout
    assert "split over 2 tensor-parallel ranks in 4 pipeline stages, 8 ranks" in table, table
    refused = cli("plan", "--model", "tiny", "--pp", "2")
    assert refused.returncode == 2 and "--pp applies to --params only" in refused.stderr


def test_plan_help_lists_every_option():
    assert not missing_from_help(
        "plan",
        (
            "--params",
            "--model",
            "--world-size",
            "--param-dtype",
            "--tp",
            "--grad-dtype",
            "--optimizer",
            "--main-dtype",
            "--state-dtype",
            "--offload",
            "--json",
        ),
    )


def _measured_lora(stage: int) -> dict:
    from _parity import LoRAGPT

    torch.manual_seed(0)
    model = flatshard.shard(LoRAGPT(), stage=stage, buckets=flatshard.Buckets(size=3000))
    opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = SyntheticCorpus(64, 16).batch(0, dist.get_rank(), 4)
    model(x, y).backward()
    opt.step()
    model.wait_for_params()
    return memory_report(model, opt).as_dict()


def _lora_offloaded(units: tuple[str, ...] | None) -> dict:
    """A LoRA GPT at stage 3 (a unit a block) with ``Offload()`` or ``Offload(units=...)``:
    what a step holds and copies over the host link, and its plan."""
    from _parity import LoRAGPT

    torch.manual_seed(0)
    offload = flatshard.Offload() if units is None else flatshard.Offload(units=units)
    model = flatshard.shard(
        LoRAGPT(),
        stage=3,
        buckets=flatshard.Buckets(size=3000),
        stage3=flatshard.Stage3(unit_bytes=None),
        offload=offload,
    )
    opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = SyntheticCorpus(64, 16).batch(0, dist.get_rank(), 4)
    for _ in range(2):  # (the second step is a steady one)
        opt.zero_grad()
        model.comm_stats.reset()
        model(x, y).backward()
        opt.step()
    model.wait_for_params()
    stats = model.comm_stats.as_dict()
    link = sum(stats.get(op, {}).get("payload_bytes", 0) for op in ("host_to_device", "device_to_host"))
    with torch.device("meta"):
        meta = LoRAGPT()
    homed: bool | frozenset[str] = True
    if units is not None:
        homed = unit_ids(units, [u.names for u in stage3_units(meta, [], None, None)[0]])
    plan = plan_from_specs(
        model_specs(meta),
        world_size=dist.get_world_size(),
        bucket_size=3000,
        rank=dist.get_rank(),
        stage3_specs=model_specs(meta, stage=3, unit_bytes=None),
        frozen_specs=model_specs(meta, frozen=True),
        stage3_frozen_specs=model_specs(meta, stage=3, frozen=True, unit_bytes=None),
        offload=homed,
    )[3]
    return {"measured": memory_report(model, opt).as_dict(), "plan": plan.as_dict(), "link": link}


@pytest.mark.parametrize("units", [None, ("blocks.1",)], ids=["all", "a-block"])
def test_an_offloaded_lora_models_frozen_base_lives_on_the_host(units):
    """QLoRA-FSDP's use: at stage 3 with ``Offload()`` the frozen base's shards live on the
    host with the adapters' optimizer (with ``units``, those of the named units), and each
    gather copies them up the host link: host bytes, device bytes and link bytes as planned
    on 3 ranks; the device holds none of the base's shards with ``Offload()``."""
    for r in run_distributed(_lora_offloaded, 3, units):
        plan, measured = r["plan"], r["measured"]
        for role in ("grads", "main_params", "optimizer_state"):
            assert plan[role] == measured[role], (role, plan, measured)
        # (each frozen param's placeholder is a few bytes the plan leaves out, on the device)
        assert 0 <= measured["params"] - plan["params"] <= 64, (plan, measured)
        assert plan["host"] == measured["host"] > 0 and plan["link_bytes_per_step"] == r["link"] > 0
        if units is None:
            assert measured["device"] <= 64 and measured["host"] > measured["params"] - 64, measured


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_of_a_lora_model_counts_frozen_params_without_grads_or_state(stage, capsys):
    """``flatshard plan --model`` on a LoRA model (frozen base, trainable adapters) equals
    what each rank measures: frozen params whole below stage 3 and sharded at it, with no
    grads and no optimizer state (it planned them as trained before)."""
    from _parity import LoRAGPT
    from flatshard.app.cli import main

    args = ["plan", "--model", "_parity:LoRAGPT", "-n", "3", "--param-dtype", "fp32"]
    args += ["--bucket-size", "3000", "--optimizer", "adamw", "--json"]
    plans = []
    for rank in range(3):
        assert main([*args, "--rank", str(rank)]) == 0
        plans.append(json.loads(capsys.readouterr().out)["stages"][str(stage)])
    for rank, measured in enumerate(run_distributed(_measured_lora, 3, stage)):
        plan = plans[rank]
        for role in ("grads", "main_params", "optimizer_state"):
            assert plan[role] == measured[role], (rank, role, plan, measured)
        # (at stage 3 each frozen param's placeholder is a few bytes the plan leaves out)
        assert 0 <= measured["params"] - plan["params"] <= (64 if stage == 3 else 0), (rank, plan, measured)
    trainable = sum(p.numel() for p in LoRAGPT().parameters() if p.requires_grad)
    assert plans[0]["optimizer_state"] <= 8 * trainable + 64  # (AdamW: 8 bytes a trained element)
