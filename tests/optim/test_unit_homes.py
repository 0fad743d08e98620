"""``Offload(units=...)`` at stage 3: the named units' shards, grads' frames, main params and
optimizer state on the host, every other unit's on the device ([Note: unit homes] in
``planner/offload.py``).

As in ``test_offload.py``, host and device are one memory on this CPU machine: the
trajectories are the check (the same fused kernel steps both homes, so they are bitwise the
unoffloaded run's), the bytes by ownership the second (their plan: ``tests/planning``)."""

import copy

import pytest
import torch

import flatshard
from flatshard import Buckets, Offload, Stage3
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig, tiny_model
from flatshard.toolkit.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=2)
FUSED = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}  # (every home: the host's kernel)
UNMERGED = Stage3(unit_bytes=None)  # (a unit a block)
HOMES = {"none": None, "units": ("blocks.0", "blocks.2"), "root": ("",), "all": ()}
STREAMED = Offload(step="device", stream_chunk=700)  # (everything on the host, a dozen chunks a step)


def _offload(home: str) -> Offload | None:
    if home == "streamed":
        return STREAMED
    units = HOMES[home]
    if units is None:
        return None
    return Offload() if home == "all" else Offload(units=units)


def _gpt(home: str, bf16: bool, steps: int = 3, compiled: str | None = None) -> dict:
    """The GPT at stage 3 trained ``steps`` clipped AdamW steps with ``home``'s offload;
    ``compiled``: each block compiled before sharding ("block") or the sharded model
    ("model"), on dynamo's aot_eager backend ([Note: compile backends in the suite])."""
    torch.manual_seed(0)
    kwargs: dict = {"stage": 3, "buckets": Buckets(size=3000), "stage3": UNMERGED}
    if bf16:
        kwargs["mixed_precision"] = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    gpt = GPT(CFG)
    if compiled == "block":
        for block in gpt.blocks:
            block.compile(backend="aot_eager")
    model = flatshard.shard(gpt, offload=_offload(home), **kwargs)
    run = torch.compile(model, backend="aot_eager") if compiled == "model" else model
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
    corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()
    losses = []
    for step in range(steps):
        loss = run(*corpus.batch(step, rank, 4))
        loss.backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.wait_for_params()
    homes = [b.main_on_host for bset in model.flatshard_state.sets.values() for b in bset.buffers]
    report = flatshard.memory_report(model, opt)
    return {"losses": losses, "params": model.full_state_dict(), "memory": report, "homes": homes}


def _every_home(bf16: bool) -> dict:
    return {home: _gpt(home, bf16) for home in HOMES}


@pytest.mark.parametrize(("world_size", "bf16"), [(1, False), (2, False), (3, False), (4, False), (3, True)])
def test_units_on_the_host_change_no_bit_of_training(world_size, bf16):
    """Some blocks, the root alone, every unit and none on the host: the same losses and
    params to the bit at every world size, fp32 and bf16 with fp32 main params; the named
    units' buffers (and only theirs) live on the host, so the host holds part of what
    ``Offload()`` puts there and the device keeps the rest."""
    for r in run_distributed(_every_home, world_size, bf16):
        want = r["none"]
        for home in ("units", "root", "all"):
            got = r[home]
            assert got["losses"] == want["losses"], home
            assert all(torch.equal(want["params"][k], v) for k, v in got["params"].items()), home
        assert not any(r["none"]["homes"]) and all(r["all"]["homes"])
        assert sum(r["units"]["homes"]) == 2 and sum(r["root"]["homes"]) == 1  # (a buffer a unit here)
        all_host, units_host = r["all"]["memory"].host, r["units"]["memory"].host
        assert 0 < r["root"]["memory"].host < units_host < all_host
        assert r["all"]["memory"].device < r["units"]["memory"].device < r["none"]["memory"].device


def _compiled_homes() -> dict:
    runs = [(c, home) for c in ("block", "model") for home in ("none", "units")] + [("model", "streamed")]
    return {(c, home): _gpt(home, False, compiled=c) for c, home in runs}


def test_compiled_models_with_units_on_the_host_train_as_without():
    """Each block compiled, and the whole sharded model compiled, on 2 ranks: units on the
    host change no bit of either (the gathers and copies run in hooks, outside the graphs);
    nor does the whole optimizer streamed to the device for its step under the compiled
    model (the step touches only the optimizer's tensors, outside any graph)."""
    for r in run_distributed(_compiled_homes, 2, timeout=300):
        for c, home in [("block", "units"), ("model", "units"), ("model", "streamed")]:
            want, got = r[(c, "none")], r[(c, home)]
            assert got["losses"] == want["losses"], (c, home)
            assert all(torch.equal(want["params"][k], v) for k, v in got["params"].items()), (c, home)
            assert all(got["homes"]) if home == "streamed" else any(got["homes"]), (c, home)
            assert got["memory"].host > 0, (c, home)


def _llama(units: tuple[str, ...] | None) -> tuple[list[float], dict]:
    """A Llama built from a config, at stage 3, a unit a decoder layer, 3 AdamW steps."""
    torch.manual_seed(0)
    offload = None if units is None else Offload(units=units)
    model = flatshard.shard(tiny_model("llama", seq_len=16), stage=3, stage3=UNMERGED, offload=offload)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randint(1, 60, (2, 16), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict()


def _llama_both() -> tuple:
    return _llama(None), _llama(("model.layers.1",))


def test_a_transformers_llama_with_a_layer_on_the_host_trains_as_on_the_device():
    for (want, want_params), (got, got_params) in run_distributed(_llama_both, 3):
        assert want == got
        assert all(torch.equal(want_params[k], v) for k, v in got_params.items())


def _refused(kind: str) -> str:
    try:
        if kind == "unknown":
            flatshard.shard(GPT(CFG), stage=3, stage3=UNMERGED, offload=Offload(units=("blocks.9",)))
        else:
            flatshard.shard(GPT(CFG), stage=2, offload=Offload(units=("blocks.0",)))
    except ValueError as e:
        return str(e)
    return "no error"


def test_units_that_are_not_there_are_refused_by_name():
    """A name that is no unit's is refused naming it and the units there are; units below
    stage 3, beside a share or a budget, or given as one string are refused too."""
    (unknown, stage2) = [run_distributed(_refused, 1, kind)[0] for kind in ("unknown", "stage 2")]
    assert "'blocks.9' is not a stage-3 unit" in unknown and "'blocks.2'" in unknown, unknown
    assert "at stage 2 there are none" in stage2 and "Offload(optimizer=0.5)" in stage2, stage2
    with pytest.raises(ValueError, match="units or a share"):
        Offload(optimizer=0.5, units=("blocks.0",))
    with pytest.raises(ValueError, match="units or a device_budget"):
        Offload(device_budget=10**9, units=("blocks.0",))
    with pytest.raises(TypeError, match="collection of unit names"):
        Offload(units="blocks.0")


def _resume(path: str, saving_world: int) -> dict:
    """Saved after 2 steps on ``saving_world`` ranks with two blocks on the host; loaded here
    with another unit on the host (and with none), the next step equals on both."""
    rank, corpus = torch.distributed.get_rank(), SyntheticCorpus(CFG.vocab_size, CFG.seq_len)

    def pair(units):
        torch.manual_seed(1)
        offload = None if units is None else Offload(units=units)
        model = flatshard.shard(GPT(CFG), stage=3, stage3=UNMERGED, offload=offload)
        return model, flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)

    def step(model, opt, n):
        model(*corpus.batch(n, rank, 4)).backward()
        opt.step()
        opt.zero_grad()

    if torch.distributed.get_world_size() == saving_world:
        model, opt = pair(("blocks.0", "blocks.2"))
        step(model, opt, 0)
        step(model, opt, 1)
        flatshard.save_checkpoint(path, model, opt)
        return {"saved": model.full_state_dict()}
    out = {}
    for units in [("blocks.1",), None]:
        model, opt = pair(units)
        flatshard.load_checkpoint(path, model, opt)
        start = copy.deepcopy(model.full_state_dict())
        step(model, opt, 2)
        out[units] = (start, model.full_state_dict())
    return out


def test_a_checkpoint_of_units_on_the_host_loads_at_another_world_size_and_home(tmp_path):
    """Saved on 2 ranks with two blocks on the host; loaded on 3 ranks with another block on
    the host, and with none: the saved params, and one more step equal between the two."""
    path = str(tmp_path / "ckpt")
    (saved, *_) = run_distributed(_resume, 2, path, 2)
    (loaded, *_) = run_distributed(_resume, 3, path, 2)
    (start, moved), (start_none, moved_none) = loaded[("blocks.1",)], loaded[None]
    assert all(torch.equal(start[k], v) for k, v in saved["saved"].items())
    assert all(torch.equal(start_none[k], v) for k, v in saved["saved"].items())
    assert all(torch.equal(moved_none[k], v) for k, v in moved.items())
    assert any(not torch.equal(start[k], v) for k, v in moved.items())


def _between_phases() -> tuple:
    """Two steps, ``offload_states`` and ``reload_states`` between them, with a block on the
    host; and the same two steps without the round trip."""
    out = []
    for round_trip in (False, True):
        torch.manual_seed(0)
        model = flatshard.shard(GPT(CFG), stage=3, stage3=UNMERGED, offload=Offload(units=("blocks.1",)))
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
        corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()
        for n in range(2):
            model(*corpus.batch(n, rank, 4)).backward()
            opt.step()
            opt.zero_grad()
            if round_trip and n == 0:
                flatshard.offload_states(model, opt)
                on_device = flatshard.memory_report(model, opt).device
                flatshard.reload_states(model)
        out.append(model.full_state_dict())
    return out[0], out[1], on_device


def test_offload_states_moves_every_home_and_brings_it_back():
    for want, got, on_device in run_distributed(_between_phases, 2):
        assert on_device == 0
        assert all(torch.equal(want[k], v) for k, v in got.items())


def _grads_read(units: tuple[str, ...] | None) -> tuple:
    """After a backward: torch's own ``clip_grad_norm_`` over the params (their
    ``ShardedGrad``s, see [Note: grads seen by torch] in engine/grad_view.py) and the full
    grads ``summon_full_params(with_grads=True)`` gathers, then a step."""
    torch.manual_seed(0)
    offload = None if units is None else Offload(units=units)
    model = flatshard.shard(GPT(CFG), stage=3, stage3=UNMERGED, offload=offload)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, **FUSED)
    corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()
    model(*corpus.batch(0, rank, 4)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with model.summon_full_params(with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return norm, grads, model.full_state_dict()


def _grads_both() -> tuple:
    return _grads_read(None), _grads_read(("", "blocks.1"))


def test_grads_on_the_host_read_as_on_the_device():
    """The grad shards of units on the host are read where they live: torch's clipping over
    ``.grad`` (a norm of host and device pieces, a device scale applied to host pieces), the
    full grads gathered, and the clipped step all equal the run without offload, to the bit."""
    for (norm, grads, params), (norm_h, grads_h, params_h) in run_distributed(_grads_both, 2):
        assert torch.equal(norm, norm_h) and norm > 0.05  # (the clip binds)
        assert all(torch.equal(grads[k], v) for k, v in grads_h.items())
        assert all(torch.equal(params[k], v) for k, v in params_h.items())
