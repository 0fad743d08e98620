"""``Offload(step="device")``: the offloaded optimizer's tensors stay at home on the host and
are streamed to the device a chunk at a time, stepped there and streamed back ([Note:
streamed step] in ``optim/streamed_step.py``).

On this CPU machine host and device are one memory and every copy is still made, so a
streamed run must equal the host-stepped ``Offload()`` run to the bit: the same kernel steps
the same values. Chunks are made small here (``Offload.stream_chunk``) so that every step streams
several, with runs of several buckets and groups in each."""

import copy
import itertools

import pytest
import torch

import flatshard
from flatshard import Buckets, Offload, Stage3
from flatshard.comm.collectives import DEVICE_TO_HOST, HOST_TO_DEVICE
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig
from flatshard.toolkit.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=2)
STAGES = [0, 1, 2, 3]
CHUNK = 700  # elements a chunk here: a dozen chunks a step
UNMERGED = Stage3(unit_bytes=None)  # (a unit a block)


def _model(stage: int, offload: Offload | None, variant: str) -> tuple:
    """The GPT sharded at ``stage`` and its optimizer: fp32 AdamW ("fp32"), bf16 params with
    fp32 main params ("bf16"), bf16 main params and moments ("4-byte": the precision-aware
    optimizer), SGD with momentum and blocks on the host ("units", stage 3)."""
    torch.manual_seed(0)
    kwargs: dict = {"stage": stage, "buckets": Buckets(size=3000), "offload": offload}
    if variant in ("bf16", "4-byte"):
        kwargs["mixed_precision"] = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    if stage == 3:
        kwargs["stage3"] = UNMERGED
    model = flatshard.shard(GPT(CFG), **kwargs)
    hyper: dict = {"lr": 1e-2, "weight_decay": 0.1}
    if variant == "4-byte":
        bf16 = torch.bfloat16
        hyper["precision"] = flatshard.OptimizerPrecision(main_dtype=bf16, state_dtype=bf16)
    cls = torch.optim.SGD if variant == "units" else torch.optim.AdamW
    if variant == "units":
        hyper["momentum"] = 0.9
    return model, flatshard.DistributedOptimizer(model, cls, **hyper)


def _train(stage: int, offload: Offload | None, variant: str, steps: int = 3) -> dict:
    """``steps`` clipped steps; the losses, the params, the memory report and the bytes each
    way over the host link."""
    model, opt = _model(stage, offload, variant)
    stats = model.flatshard_state.stats
    stats.reset()
    corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()
    losses = []
    for step in range(steps):
        loss = model(*corpus.batch(step, rank, 4))
        loss.backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.wait_for_params()
    link = {op: stats.payload_bytes[op] for op in (HOST_TO_DEVICE, DEVICE_TO_HOST)}
    chunks = 0 if opt._streamed is None else len(opt._streamed.chunks)
    streamed = [s for s in opt.shards if s.on_host]
    sizes = {  # (bytes of what a streamed step moves: runs, their state, their grads on the host)
        "main": sum(_nbytes(s.tensors) for s in streamed),
        "state": sum(_nbytes([v for t in s.tensors for v in opt.state[t].values()]) for s in streamed),
        "grads": sum(_nbytes(s.grads) for s in streamed if s.buffer.grads_on_host),
    }
    report = flatshard.memory_report(model, opt)
    params = model.full_state_dict()
    return {"losses": losses, "params": params, "memory": report, "link": link, "chunks": chunks, **sizes}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _host_and_device(variant: str) -> dict:
    units = ("blocks.0", "blocks.2") if variant == "units" else None
    stages = [3] if variant == "units" else STAGES
    offloads = [Offload(units=units), Offload(units=units, step="device", stream_chunk=CHUNK)]
    return {s: [_train(s, offload, variant) for offload in offloads] for s in stages}


@pytest.mark.parametrize(
    ("world_size", "variant"), [(1, "fp32"), (2, "fp32"), (3, "bf16"), (4, "4-byte"), (3, "units")]
)
def test_a_step_streamed_to_the_device_is_the_host_step_to_the_bit(world_size, variant):
    """At every stage (blocks on the host at stage 3 for "units": the resident runs step in
    one call, the others streamed): the streamed run's losses and params equal the
    host-stepped run's to the bit, through several chunks a step; the homes are the same
    (no grads' host frame at stages 0-1: a streamed step reads the device's grads), and the
    link carries what the host step sends plus the chunks both ways."""
    for r in run_distributed(_host_and_device, world_size, variant, timeout=300):
        for stage, (host, device) in r.items():
            assert device["chunks"] > 3, stage
            assert device["losses"] == host["losses"], stage
            assert all(torch.equal(host["params"][k], v) for k, v in device["params"].items()), stage
            h, d = host["memory"], device["memory"]
            assert d.optimizer_state == h.optimizer_state > 0 and d.main_params == h.main_params, stage
            assert d.host == h.host - (h.grads - d.grads if stage < 2 else 0), (stage, h, d)
            assert d.device == h.device, stage
            # the link carries the host run's copies, and each step's chunks: up the main params,
            # the state (from the second step: the first makes it on the device) and the grads
            # on the host (stages 2-3), back the main params and state; no grads' frame down
            up = device["link"][HOST_TO_DEVICE] - host["link"][HOST_TO_DEVICE]
            down = device["link"][DEVICE_TO_HOST] - host["link"][DEVICE_TO_HOST]
            assert up == 3 * device["main"] + 2 * device["state"] + 3 * device["grads"], stage
            assert down == 3 * (device["main"] + device["state"]) - 3 * (h.grads - d.grads), stage


def _other_inner(stage: int, offload: Offload, kind: str) -> tuple[list[float], dict]:
    """torchao's ``AdamW8bit`` (quantized state: tensor subclasses streamed), or two classes
    (SGD with momentum for the matrices, AdamW for the rest) with the embedding frozen after
    the first step (held back: [Note: params without a grad]); 3 steps."""
    torch.manual_seed(0)
    model = flatshard.shard(GPT(CFG), stage=stage, buckets=Buckets(size=3000), offload=offload)
    if kind == "8bit":
        from torchao.optim import AdamW8bit

        opt = flatshard.DistributedOptimizer(model, AdamW8bit, lr=1e-2, block_size=32)
    else:
        named = dict(model.named_parameters())
        matrices = [p for n, p in named.items() if p.dim() == 2 and "wte" not in n]
        rest = [p for p in named.values() if all(p is not m for m in matrices)]
        sgd = {"params": matrices, "optimizer_class": torch.optim.SGD, "momentum": 0.9}
        opt = flatshard.DistributedOptimizer(
            model, torch.optim.AdamW, params=[sgd, {"params": rest}], lr=1e-2
        )
    corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()
    losses = []
    for step in range(3):
        if step == 1 and kind == "grouped":
            model.wte.weight.requires_grad_(False)
        loss = model(*corpus.batch(step, rank, 4))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.wait_for_params()
    return losses, model.full_state_dict()


def _other_inner_both(kind: str) -> dict:
    offloads = [Offload(step=where, stream_chunk=CHUNK) for where in ("host", "device")]
    torch.compiler.set_default_backend("eager")  # (torchao compiles its step: see test_blockwise_state)
    try:
        return {s: [_other_inner(s, offload, kind) for offload in offloads] for s in (1, 3)}
    finally:
        torch.compiler.set_default_backend(None)  # (the ranks are kept for other tests)


@pytest.mark.parametrize("kind", ["8bit", "grouped"])
def test_low_bit_state_grouped_classes_and_held_params_stream_as_they_step_at_home(kind):
    for r in run_distributed(_other_inner_both, 2, kind):
        for stage, ((want, want_params), (got, got_params)) in r.items():
            assert got == want, stage
            assert all(torch.equal(want_params[k], v) for k, v in got_params.items()), stage


def _resume(path: str, saving_world: int) -> dict:
    """Streamed at stage 3 on ``saving_world`` ranks, 2 steps, saved; loaded here streamed at
    stage 2 and host-stepped at stage 3: the saved params, and one more step equal."""
    corpus, rank = SyntheticCorpus(CFG.vocab_size, CFG.seq_len), torch.distributed.get_rank()

    def step(model, opt, n):
        model(*corpus.batch(n, rank, 4)).backward()
        opt.step()
        opt.zero_grad()

    if torch.distributed.get_world_size() == saving_world:
        model, opt = _model(3, Offload(step="device", stream_chunk=CHUNK), "bf16")
        step(model, opt, 0)
        step(model, opt, 1)
        flatshard.save_checkpoint(path, model, opt)
        return {"saved": model.full_state_dict()}
    out = {}
    for stage, where in [(2, "device"), (3, "host")]:
        model, opt = _model(stage, Offload(step=where, stream_chunk=CHUNK), "bf16")
        flatshard.load_checkpoint(path, model, opt)
        start = copy.deepcopy(model.full_state_dict())
        step(model, opt, 2)
        out[where] = (start, model.full_state_dict())
    return out


def test_a_streamed_checkpoint_loads_at_another_world_size_stage_and_step_place(tmp_path):
    """Saved streamed at stage 3 on 2 ranks; loaded on 3 ranks streamed at stage 2 and
    host-stepped at stage 3: both start from the saved params and take the same next step
    (bf16 params, fp32 main params: the state streams home between steps)."""
    path = str(tmp_path / "ckpt")
    (saved, *_) = run_distributed(_resume, 2, path, 2)
    (loaded, *_) = run_distributed(_resume, 3, path, 2)
    (start_d, moved_d), (start_h, moved_h) = loaded["device"], loaded["host"]
    assert all(torch.equal(start_d[k], v) and torch.equal(start_h[k], v) for k, v in saved["saved"].items())
    assert all(torch.equal(moved_h[k], v) for k, v in moved_d.items())
    assert any(not torch.equal(start_d[k], v) for k, v in moved_d.items())


def test_a_chunk_and_the_one_before_never_share_the_arena():
    """[Note: streamed step]: chunks take pieces of one arena from its two ends by turns, so
    the two on the device at once are disjoint; the arena is the plan's staging (the largest
    pair of consecutive chunks) with each piece's start aligned."""
    from flatshard.optim.streamed_step import _Arena
    from flatshard.planner.offload import staging_bytes

    sizes = [[100, 300], [1000], [10, 20, 30], [700], [5]]
    arena = _Arena(torch.device("cpu"), sizes)
    align = _Arena.ALIGN
    aligned = [[-(-n // align) * align for n in chunk] for chunk in sizes]
    assert arena.memory.numel() == staging_bytes([sum(c) for c in aligned])
    base = arena.memory.data_ptr()
    spans = []
    for index in range(len(sizes)):
        pieces = list(arena.chunk(index))
        assert [p.numel() for p in pieces] == aligned[index]
        starts = [p.data_ptr() - base for p in pieces]
        assert all(
            s % align == 0 and s >= 0 and s + p.numel() <= arena.memory.numel()
            for s, p in zip(starts, pieces, strict=True)
        )
        spans.append({b for s, p in zip(starts, pieces, strict=True) for b in range(s, s + p.numel())})
    for a, b in itertools.pairwise(spans):
        assert not a & b


def test_where_the_step_runs_is_checked():
    with pytest.raises(ValueError, match=r"Offload\.step must be one of"):
        Offload(step="gpu")
    with pytest.raises(ValueError, match="not a share"):
        Offload(optimizer=0.5, step="device")
